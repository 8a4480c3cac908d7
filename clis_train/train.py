"""The train loop: one jitted step over a (data, fsdp, tensor) mesh, optax AdamW, orbax checkpoints.

Reading order: `Trainer.__init__` builds tokenizer, model, mesh, optimizer and data;
`Trainer.run` restores or initialises the state, then steps, logs, evaluates and saves.
Metrics go to the console and to run_dir/metrics.jsonl.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import math
import os
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from clis_kernels import context_parallel
from clis_train import checkpoint, data, model
from clis_train import sources as data_sources
from clis_train.attention import BATCH_AXES, make_attention, unsupported as attention_unsupported
from clis_train.config import CERTIFYING, Config, ConfigError, to_dict
from clis_train.errors import GracefulStop, Interrupted, TrainingError
from clis_train.runlock import RunLock

PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "TPU v6": 918.0, "TPU v5 lite": 197.0,
                    "TPU v5": 459.0, "TPU v4": 275.0}


def maybe_initialize_distributed() -> None:
  """Multi-host runs: JAX's own distributed runtime, when the usual environment says so.

  JAX_COORDINATOR_ADDRESS (+ JAX_NUM_PROCESSES and JAX_PROCESS_ID, which JAX itself does not
  read from the environment) for a hand-launched cluster; SLURM and Cloud TPU are auto-detected.
  """
  if "JAX_COORDINATOR_ADDRESS" in os.environ:
    count, index = os.environ.get("JAX_NUM_PROCESSES"), os.environ.get("JAX_PROCESS_ID")
    jax.distributed.initialize(num_processes=None if count is None else int(count),
                               process_id=None if index is None else int(index))
  elif int(os.environ.get("SLURM_NTASKS", "1")) > 1 or os.environ.get("TPU_WORKER_HOSTNAMES"):
    jax.distributed.initialize()


def make_mesh(mesh_cfg) -> jax.sharding.Mesh:
  devices = jax.devices()
  sizes = {"data": mesh_cfg.data, "fsdp": mesh_cfg.fsdp, "context": mesh_cfg.context, "tensor": mesh_cfg.tensor}
  fixed = int(np.prod([s for s in sizes.values() if s != -1]))
  if list(sizes.values()).count(-1) > 1:
    raise ConfigError("at most one of mesh.data, mesh.fsdp, mesh.context, mesh.tensor may be -1")
  if -1 in sizes.values():
    if len(devices) % fixed:
      raise ConfigError(f"mesh axes {sizes} do not divide the {len(devices)} devices")
    sizes = {k: (len(devices) // fixed if v == -1 else v) for k, v in sizes.items()}
  total = int(np.prod(list(sizes.values())))
  if total > len(devices) or min(sizes.values()) < 1:
    raise ConfigError(f"mesh {sizes} needs {total} devices; {len(devices)} are available")
  grid = np.array(devices[:total]).reshape(*sizes.values())
  return jax.sharding.Mesh(grid, tuple(sizes))


def _param_spec(path, leaf, mesh) -> P:
  """fsdp shards the model dimension of every matrix, tensor its head/ffn/vocab dimension."""
  names = [str(getattr(p, "key", getattr(p, "name", getattr(p, "idx", "")))) for p in path]
  if leaf.ndim < 2:
    return P()
  fits = lambda axis, size: axis if size % mesh.shape[axis] == 0 else None
  if names[-1] == "embedding":  # [vocab, dim]
    return P(fits("tensor", leaf.shape[0]), fits("fsdp", leaf.shape[1]))
  if names[-2] in ("wo", "w2"):  # [heads·hd or ffn, dim]
    return P(fits("tensor", leaf.shape[0]), fits("fsdp", leaf.shape[1]))
  return P(fits("fsdp", leaf.shape[0]), fits("tensor", leaf.shape[1]))  # [dim, heads·hd / ffn / vocab]


def peak_flops_per_device(cfg: Config) -> float | None:
  if cfg.train.peak_tflops_per_device is not None:
    return cfg.train.peak_tflops_per_device * 1e12
  kind = jax.devices()[0].device_kind
  for name, tflops in PEAK_BF16_TFLOPS.items():
    if name.lower() in kind.lower():
      return tflops * 1e12
  return None


class Trainer:
  def __init__(self, cfg: Config):
    maybe_initialize_distributed()
    self.cfg = cfg
    self.tokenizer = data.make_tokenizer(cfg.data.tokenizer)
    self.dims = model.resolve_dims(cfg.model, self.tokenizer.vocab_size)
    self.mesh = make_mesh(cfg.mesh)
    for layer in range(self.dims.n_layers):  # one ConfigError before anything is traced
      problem = attention_unsupported(cfg.attention, window=self.dims.layer_window(layer),
                                      softcap=self.dims.attn_soft_cap, sinks=self.dims.sinks,
                                      context=self.mesh.shape["context"])
      if problem:
        raise ConfigError(f"model.preset={cfg.model.preset!r} (layer {layer}): {problem}")
    self.model = model.Transformer(self.dims, make_attention(cfg.attention, self.mesh,
                                                             granularity=cfg.attention_granularity,
                                                             context_strategy=cfg.mesh.context_strategy),
                                   dtype=jnp.dtype(cfg.model.dtype), remat=cfg.model.remat)
    self.context = self.mesh.shape["context"]  # devices that share each sequence
    self.global_batch = cfg.data.per_device_batch * self.mesh.size // self.context
    self.host_batch = self.global_batch // jax.process_count()  # each host reads and packs its own rows
    self.batch_sharding = NamedSharding(self.mesh, P(BATCH_AXES, "context"))
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, cfg.optim.lr, cfg.optim.warmup_steps, max(cfg.train.steps, cfg.optim.warmup_steps + 1),
        end_value=cfg.optim.lr * cfg.optim.min_lr_ratio)
    self.schedule = schedule
    # apply_if_finite leaves params and moments as they were when a gradient is NaN/inf; the loop
    # stops the run (train.on_nonfinite=stop) or lets it skip up to max_skipped_steps in a row.
    skips = cfg.train.max_skipped_steps if cfg.train.on_nonfinite == "skip" else 0
    self.optimizer = optax.apply_if_finite(optax.chain(
        optax.clip_by_global_norm(cfg.optim.grad_clip),
        optax.adamw(schedule, b1=cfg.optim.b1, b2=cfg.optim.b2, eps=cfg.optim.eps,
                    weight_decay=cfg.optim.weight_decay, mask=lambda p: jax.tree.map(lambda x: x.ndim >= 2, p))),
        max_consecutive_errors=skips)
    self._compile()

  # ------------------------------------------------------------------ state and steps
  def _state_from(self, params):
    return {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": self.optimizer.init(params)}

  def init_state(self, rng):
    """A fresh state, sharded: parameters drawn leaf by leaf (model.init_params: one small program per parameter
    shape, no forward and no attention kernel traced or compiled), then the optimizer's zeros."""
    return self.init_state_from(model.init_params(self.abstract_params, rng, self.param_shardings))

  def init_state_from(self, params):
    """The state at step 0 around `params` (sharded as self.param_shardings)."""
    return self._init_from(params)

  def _compile(self):
    rows = self.mesh.shape["data"] * self.mesh.shape["fsdp"]  # one row per batch shard
    self.abstract_params = model.abstract_params(self.model, (rows, self.cfg.data.seq_len))
    abstract = jax.eval_shape(self._state_from, self.abstract_params)
    self.param_shardings = jax.tree_util.tree_map_with_path(
        lambda p, x: NamedSharding(self.mesh, _param_spec(p, x, self.mesh)), abstract["params"])
    self.state_shardings = {
        "step": NamedSharding(self.mesh, P()),
        "params": self.param_shardings,
        "opt_state": jax.tree_util.tree_map_with_path(
            lambda p, x: NamedSharding(self.mesh, _param_spec(p, x, self.mesh) if x.ndim >= 2 else P()),
            abstract["opt_state"]),
    }
    self.abstract_state = jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
                                       abstract, self.state_shardings)
    self._init_from = jax.jit(self._state_from, out_shardings=self.state_shardings)
    self.train_step = jax.jit(self._train_step, in_shardings=(self.state_shardings, self.batch_sharding),
                              out_shardings=(self.state_shardings, None), donate_argnums=0)
    self.eval_step = jax.jit(self._loss, in_shardings=(self.param_shardings, self.batch_sharding))
    self.all_finite = jax.jit(lambda p: jnp.all(jnp.stack([jnp.isfinite(x).all() for x in jax.tree.leaves(p)])))

  def _loss(self, params, batch):
    batch = {k: self._zigzag(v) for k, v in batch.items()}  # the loss is a mean over tokens: order is free
    logits, extra = self.model.apply({"params": params}, batch["inputs"], batch["positions"], batch["segment_ids"],
                                     mutable=["intermediates"])
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    weights = batch["weights"] * (batch["segment_ids"] != 0)
    loss = (ce * weights).sum() / jnp.maximum(weights.sum(), 1.0)
    certified = jnp.mean(jnp.stack(jax.tree.leaves(extra["intermediates"])))
    return loss, certified

  def _train_step(self, state, batch):
    (loss, certified), grads = jax.value_and_grad(self._loss, has_aux=True)(state["params"], batch)
    updates, opt_state = self.optimizer.update(grads, state["opt_state"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    grad_norm = optax.tree.norm(grads)
    metrics = {"loss": loss, "certified_fraction": certified, "grad_norm": grad_norm,
               "lr": self.schedule(state["step"]), "finite": jnp.isfinite(loss) & jnp.isfinite(grad_norm)}
    return {"step": state["step"] + 1, "params": params, "opt_state": opt_state}, metrics

  def logits(self, params, tokens, positions=None, segment_ids=None):
    """Forward pass for evaluation and tests: float32 logits [B, S, vocab]."""
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape) if positions is None else positions
    segment_ids = jnp.ones_like(tokens) if segment_ids is None else segment_ids
    tokens, positions, segment_ids = (self._zigzag(x) for x in (tokens, positions, segment_ids))
    logits = self.model.apply({"params": params}, tokens, positions, segment_ids, mutable=["intermediates"])[0]
    return logits if self.context == 1 else context_parallel.from_zigzag(logits, self.context)

  def _zigzag(self, x):
    """[B, S, ...] in the order context parallelism shards (each device a chunk from either end of every sequence:
    clis_kernels.context_parallel); positions travel with their tokens, so RoPE and the loss are unchanged."""
    return x if self.context == 1 else context_parallel.to_zigzag(x, self.context)

  # ------------------------------------------------------------------ the loop
  def run(self, on_step=None, stop: GracefulStop | None = None) -> list[dict]:
    """Trains to cfg.train.steps; returns the metric records (also appended to metrics.jsonl).

    Holds run_dir's lock for the whole run (one trainer per run_dir). on_step(step, metrics) is
    called after every step (tests use it to simulate a crash).
    """
    lock = RunLock(self.cfg.run_dir) if jax.process_index() == 0 else contextlib.nullcontext()
    with lock:
      return self._run(pathlib.Path(self.cfg.run_dir), on_step, stop or GracefulStop())

  def _start(self, mngr, batches):
    """(first step, state): restored from the newest intact checkpoint, or initialised."""
    cfg = self.cfg
    if mngr.latest_step() is not None and not cfg.checkpoint.resume:
      raise checkpoint.CheckpointError(
          f"run_dir={cfg.run_dir!r} already holds checkpoints (steps {list(mngr.all_steps())}); set "
          "checkpoint.resume=true to continue it, or choose another run_dir")
    start, state = (checkpoint.restore_latest(mngr, self.abstract_state, batches, on_corrupt=cfg.checkpoint.on_corrupt)
                    if cfg.checkpoint.resume else (None, None))
    if state is not None:
      return start, state
    state = self.init_state(jax.random.PRNGKey(cfg.seed))
    if cfg.checkpoint.init_from:
      params = checkpoint.load_params(cfg.checkpoint.init_from, self.abstract_state["params"], dims=self.dims)
      state = self.init_state_from(jax.device_put(params, self.param_shardings))
    return 0, state

  def _run(self, run_dir: pathlib.Path, on_step, stop: GracefulStop) -> list[dict]:
    cfg = self.cfg
    sources = data_sources.build_sources(cfg.data, self.tokenizer)
    batches = data_sources.batches(sources, seq_len=cfg.data.seq_len, batch_size=self.host_batch, seed=cfg.seed,
                                   packing_bins=cfg.data.packing_bins, workers=cfg.data.workers)
    has_eval = any(s.eval is not None for s in sources)
    mixture = np.zeros(len(sources), np.int64)  # tokens per source since the last eval interval
    mngr = checkpoint.manager(cfg.run_dir, every=cfg.checkpoint.every, keep=cfg.checkpoint.keep)
    t_init = time.perf_counter()
    try:
      start, state = self._start(mngr, batches)
      jax.block_until_ready(state)
      init_s = time.perf_counter() - t_init
    except BaseException:
      mngr.close()
      raise
    if start >= cfg.train.steps:
      mngr.close()
      print(f"clis-train: run_dir={cfg.run_dir!r} already finished (checkpoint step {start}, train.steps="
            f"{cfg.train.steps}); nothing to train. Raise train.steps to continue it.", file=sys.stderr)
      self.state = state
      return []
    restart = _write_config(run_dir, cfg, start)
    progress = _progress(cfg, start)
    say = progress.write if cfg.train.progress_bar else lambda line: print(line, flush=True)
    say(f"resumed from step {start} ({run_dir / 'checkpoints' / str(start)})" if start else
        f"initialised from {cfg.checkpoint.init_from}" if cfg.checkpoint.init_from else
        f"initialised at random (seed {cfg.seed}); {self.dims.num_params() / 1e6:.1f}M parameters")
    board = _tensorboard(cfg, run_dir)
    records = []
    flops = model.flops_per_token(self.dims, cfg.data.seq_len)
    peak = peak_flops_per_device(cfg)
    tokens_per_step = self.global_batch * cfg.data.seq_len
    t_last, steps_since, bad_in_a_row, done = time.perf_counter(), 0, 0, start
    saved = mngr.latest_step()
    stop.in_loop = True
    try:
      with open(run_dir / "metrics.jsonl", "a") as log:
        if restart is not None:
          log.write(_json_line(restart))
        for step in range(start, cfg.train.steps):
          batch = next(batches)
          if "source" in batch:  # a mixture: count each source's real tokens, then leave the field on the host
            mixture += np.bincount(batch.pop("source")[batch["segment_ids"] != 0], minlength=len(sources))
          state, metrics = self.train_step(state, self.to_device(batch))
          steps_since += 1
          done = step + 1
          if done == start + 1:  # the first step's compile, and when it ended (scripts/h200 measure time to it)
            jax.block_until_ready(metrics)
            say(f"first step done at unix time {time.time():.2f}: state ready in {init_s:.1f} s, first step "
                f"(compile and run) {time.perf_counter() - t_init - init_s:.1f} s")
          if not bool(metrics["finite"]):  # checked every step: a non-finite update is never saved
            bad_in_a_row += 1
            values = {k: float(v) for k, v in jax.device_get(metrics).items() if k != "finite"}
            skipped = cfg.train.on_nonfinite == "skip" and bad_in_a_row <= cfg.train.max_skipped_steps
            log.write(_json_line({"step": done, "event": "nonfinite", "update_skipped": skipped, **values}))
            log.flush()
            if not skipped:
              raise TrainingError(
                  f"step {done}: loss={values['loss']}, grad_norm={values['grad_norm']} is not finite; training "
                  f"stopped (train.on_nonfinite={cfg.train.on_nonfinite}"
                  + (f", {bad_in_a_row} in a row" if cfg.train.on_nonfinite == "skip" else "")
                  + f"). {_kept(saved)}; lower optim.lr, or set train.on_nonfinite=skip to skip such updates")
          else:
            bad_in_a_row = 0
          if done % cfg.train.log_every == 0 or done == cfg.train.steps:
            metrics = {k: float(v) for k, v in jax.device_get(metrics).items() if k != "finite"}
            now = time.perf_counter()
            step_time = (now - t_last) / steps_since
            t_last, steps_since = now, 0
            record = {"step": done, **metrics, "step_time_s": step_time, "tokens_per_s": tokens_per_step / step_time,
                      "mfu": None if peak is None else flops * tokens_per_step / step_time / (peak * self.mesh.size)}
            if cfg.attention not in CERTIFYING:
              record["certified_fraction"] = None
            records.append(record)
            log.write(_json_line(record))
            log.flush()
            say(_console_line(record, cfg.train.steps))
            board.write(record)
          if done % cfg.train.eval_every == 0 and len(sources) > 1:
            shares = data_sources.realised_shares(mixture)
            mix_record = {"step": done, "mixture": {s.name: round(f, 4) for s, f in zip(sources, shares)},
                          "mixture_weights": {s.name: s.weight for s in sources}}
            mixture[:] = 0
            records.append(mix_record)
            log.write(_json_line(mix_record))
            say(f"step {done} | mixture " + " ".join(f"{k} {v:.3f}" for k, v in mix_record["mixture"].items()))
          if done % cfg.train.eval_every == 0 and has_eval:
            eval_record = {"step": done, "eval_loss": self.evaluate(state["params"], sources)}
            records.append(eval_record)
            log.write(_json_line(eval_record))
            say(f"step {done} | eval_loss {eval_record['eval_loss']:.4f}")
            board.write(eval_record)
          if done % cfg.checkpoint.every == 0 or done == cfg.train.steps:
            saved = self._save(mngr, done, state, batches, saved)
          progress.update(1)
          if on_step is not None:
            on_step(done, metrics)
          if stop.requested:  # SIGINT/SIGTERM during the step: stop here, with a whole state
            raise KeyboardInterrupt
    except KeyboardInterrupt:
      if cfg.train.save_on_interrupt and done != saved:
        saved = self._save(mngr, done, state, batches, saved)
      raise Interrupted(f"interrupted at step {done}; {_kept(saved)}; run the same command to resume") from None
    finally:
      stop.in_loop = False
      progress.close()
      board.close()
      mngr.wait_until_finished()
      mngr.close()
    self.state = state
    return records

  def _save(self, mngr, step, state, batches, saved):
    """Saves a finite state as `step` (returns step); a non-finite one is never saved."""
    if not bool(self.all_finite(state["params"])):
      raise TrainingError(f"step {step}: the parameters are not finite; not saved. {_kept(saved)}")
    try:
      checkpoint.save(mngr, step, state, batches, force=True)
    except OSError as e:
      raise TrainingError(f"step {step}: could not write the checkpoint under {mngr.directory} ({e.strerror or e}); "
                          f"free space or point run_dir elsewhere. {_kept(saved)}") from e
    return step

  def evaluate(self, params, held_out) -> float:
    """Mean loss over cfg.train.eval_batches packed batches of held-out data (same batches every time):
    `held_out` a list of examples, or the sources (sources.build_sources) whose eval splits are mixed."""
    kw = dict(seq_len=self.cfg.data.seq_len, batch_size=self.host_batch, seed=0,
              packing_bins=self.cfg.data.packing_bins, shuffle=False)
    from_sources = bool(held_out) and isinstance(held_out[0], data_sources.Source)
    batches = data_sources.batches(held_out, split="eval", **kw) if from_sources else data.packed_batches(held_out, **kw)
    losses = []
    for _ in range(self.cfg.train.eval_batches):
      batch = next(batches)
      batch.pop("source", None)
      losses.append(float(self.eval_step(params, self.to_device(batch))[0]))
    return float(np.mean(losses))

  def to_device(self, batch):
    """This host's rows of the global batch → global arrays sharded over the batch axes."""
    if jax.process_count() == 1:
      return jax.device_put(batch, self.batch_sharding)
    return jax.tree.map(lambda x: jax.make_array_from_process_local_data(self.batch_sharding, x), batch)


def _kept(saved: int | None) -> str:
  return "no checkpoint was written yet" if saved is None else f"checkpoints up to step {saved} are intact"


def _json_line(record: dict) -> str:
  """One metrics.jsonl line, valid JSON: non-finite numbers become null and are listed under 'nonfinite'."""
  bad = [k for k, v in record.items() if isinstance(v, float) and not math.isfinite(v)]
  clean = {k: (None if k in bad else v) for k, v in record.items()}
  if bad:
    clean["nonfinite"] = bad
  return json.dumps(clean, allow_nan=False) + "\n"


def _write_config(run_dir: pathlib.Path, cfg: Config, start: int) -> dict | None:
  """Writes run_dir/config.json (the config in force); on a resume, returns the restart record for
  metrics.jsonl with the keys that changed since the last start."""
  path = run_dir / "config.json"
  new = to_dict(cfg)
  restart = None
  if start > 0:
    old = json.loads(path.read_text()) if path.is_file() else {}
    flat = lambda d, pre="": {f"{pre}{k}": v for k0, v0 in d.items()
                              for k, v in (flat(v0, f"{k0}.").items() if isinstance(v0, dict) else [(k0, v0)])}
    before, after = flat(old), flat(new)
    restart = {"step": start, "event": "restart", "time": datetime.datetime.now().isoformat(timespec="seconds"),
               "changed": {k: [before.get(k), v] for k, v in after.items() if before.get(k) != v}}
  run_dir.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(new, indent=1))
  return restart


def _console_line(record: dict, steps: int) -> str:
  """One line per train.log_every: step, loss, lr, grad norm, tokens/s, MFU (peak known), certified."""
  parts = [f"step {record['step']}/{steps}", f"loss {record['loss']:.4f}", f"lr {record['lr']:.2e}",
           f"grad_norm {record['grad_norm']:.3f}", f"tokens/s {record['tokens_per_s']:.0f}"]
  if record.get("mfu") is not None:
    parts.append(f"mfu {record['mfu']:.3f}")
  if record.get("certified_fraction") is not None:
    parts.append(f"certified {record['certified_fraction']:.3f}")
  return " | ".join(parts)


class _Board:
  """TensorBoard event files in run_dir/tensorboard through tensorboardX (a maintained, framework-free
  writer of the standard event format: no TensorFlow or PyTorch needed); off on other processes and
  with train.tensorboard=false."""

  def __init__(self, logdir: pathlib.Path | None):
    self.writer = None
    if logdir is not None:
      from tensorboardX import SummaryWriter
      self.writer = SummaryWriter(logdir=str(logdir))

  def write(self, record: dict) -> None:
    if self.writer is None:
      return
    group = "eval" if "eval_loss" in record else "train"
    for key, value in record.items():
      if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        self.writer.add_scalar(f"{group}/{key.removeprefix('eval_')}", value, record["step"])
    self.writer.flush()

  def close(self) -> None:
    if self.writer is not None:
      self.writer.close()


def _tensorboard(cfg: Config, run_dir: pathlib.Path) -> _Board:
  return _Board(run_dir / "tensorboard" if cfg.train.tensorboard and jax.process_index() == 0 else None)


def _progress(cfg, start):
  from tqdm import tqdm
  return tqdm(total=cfg.train.steps, initial=start, disable=not cfg.train.progress_bar, desc="train",
              dynamic_ncols=True)


def train(cfg: Config, on_step=None, stop: GracefulStop | None = None) -> list[dict]:
  return Trainer(cfg).run(on_step=on_step, stop=stop)
