"""The train loop: one jitted step over a (data, fsdp, tensor) mesh, optax AdamW, orbax checkpoints.

Reading order: `Trainer.__init__` builds tokenizer, model, mesh, optimizer and data;
`Trainer.run` restores or initialises the state, then steps, logs, evaluates and saves.
Metrics go to the console and to run_dir/metrics.jsonl.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from clis_train import checkpoint, data, model
from clis_train.attention import BATCH_AXES, make_attention
from clis_train.config import Config, ConfigError, to_dict

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
  sizes = {"data": mesh_cfg.data, "fsdp": mesh_cfg.fsdp, "tensor": mesh_cfg.tensor}
  fixed = int(np.prod([s for s in sizes.values() if s != -1]))
  if list(sizes.values()).count(-1) > 1:
    raise ConfigError("at most one of mesh.data, mesh.fsdp, mesh.tensor may be -1")
  if -1 in sizes.values():
    if len(devices) % fixed:
      raise ConfigError(f"mesh axes {sizes} do not divide the {len(devices)} devices")
    sizes = {k: (len(devices) // fixed if v == -1 else v) for k, v in sizes.items()}
  total = int(np.prod(list(sizes.values())))
  if total > len(devices) or min(sizes.values()) < 1:
    raise ConfigError(f"mesh {sizes} needs {total} devices; {len(devices)} are available")
  grid = np.array(devices[:total]).reshape(sizes["data"], sizes["fsdp"], sizes["tensor"])
  return jax.sharding.Mesh(grid, ("data", "fsdp", "tensor"))


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
    self.model = model.Transformer(self.dims, make_attention(cfg.attention, self.mesh,
                                                             granularity=cfg.attention_granularity),
                                   dtype=jnp.dtype(cfg.model.dtype), remat=cfg.model.remat)
    self.global_batch = cfg.data.per_device_batch * self.mesh.size
    self.batch_sharding = NamedSharding(self.mesh, P(BATCH_AXES))
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, cfg.optim.lr, cfg.optim.warmup_steps, max(cfg.train.steps, cfg.optim.warmup_steps + 1),
        end_value=cfg.optim.lr * cfg.optim.min_lr_ratio)
    self.schedule = schedule
    self.optimizer = optax.chain(
        optax.clip_by_global_norm(cfg.optim.grad_clip),
        optax.adamw(schedule, b1=cfg.optim.b1, b2=cfg.optim.b2, eps=cfg.optim.eps,
                    weight_decay=cfg.optim.weight_decay, mask=lambda p: jax.tree.map(lambda x: x.ndim >= 2, p)))
    self._compile()

  # ------------------------------------------------------------------ state and steps
  def _init_state(self, rng):
    rows = self.mesh.shape["data"] * self.mesh.shape["fsdp"]  # one row per batch shard
    dummy = jnp.zeros((rows, self.cfg.data.seq_len), jnp.int32)
    params = self.model.init(rng, dummy, dummy, jnp.ones_like(dummy))["params"]
    return {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": self.optimizer.init(params)}

  def _compile(self):
    abstract = jax.eval_shape(self._init_state, jax.random.PRNGKey(0))
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
    self.init_state = jax.jit(self._init_state, out_shardings=self.state_shardings)
    self.train_step = jax.jit(self._train_step, in_shardings=(self.state_shardings, self.batch_sharding),
                              out_shardings=(self.state_shardings, None), donate_argnums=0)
    self.eval_step = jax.jit(self._loss, in_shardings=(self.param_shardings, self.batch_sharding))

  def _loss(self, params, batch):
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
    metrics = {"loss": loss, "certified_fraction": certified, "grad_norm": optax.tree.norm(grads),
               "lr": self.schedule(state["step"])}
    return {"step": state["step"] + 1, "params": params, "opt_state": opt_state}, metrics

  def logits(self, params, tokens, positions=None, segment_ids=None):
    """Forward pass for evaluation and tests: float32 logits [B, S, vocab]."""
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape) if positions is None else positions
    segment_ids = jnp.ones_like(tokens) if segment_ids is None else segment_ids
    return self.model.apply({"params": params}, tokens, positions, segment_ids, mutable=["intermediates"])[0]

  # ------------------------------------------------------------------ the loop
  def run(self, on_step=None) -> list[dict]:
    """Trains to cfg.train.steps; returns the metric records (also appended to metrics.jsonl).

    on_step(step, metrics) is called after every step (tests use it to simulate a crash).
    """
    cfg = self.cfg
    run_dir = pathlib.Path(cfg.run_dir)
    examples = data.build_examples(cfg.data, self.tokenizer)
    batches = data.packed_batches(examples.train, seq_len=cfg.data.seq_len, batch_size=self.global_batch,
                                  seed=cfg.seed, packing_bins=cfg.data.packing_bins)
    mngr = checkpoint.manager(cfg.run_dir, every=cfg.checkpoint.every, keep=cfg.checkpoint.keep)
    if mngr.latest_step() is not None and not cfg.checkpoint.resume:
      raise checkpoint.CheckpointError(
          f"run_dir={cfg.run_dir!r} already holds checkpoints (steps {list(mngr.all_steps())}); set "
          "checkpoint.resume=true to continue it, or choose another run_dir")
    start, state = checkpoint.restore_latest(mngr, self.abstract_state, batches) if cfg.checkpoint.resume else (None, None)
    if state is None:
      start = 0
      state = self.init_state(jax.random.PRNGKey(cfg.seed))
      if cfg.checkpoint.init_from:
        params = checkpoint.load_params(cfg.checkpoint.init_from, self.abstract_state["params"])
        params = jax.device_put(params, self.param_shardings)
        state = self.init_state_from(params)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps(to_dict(cfg), indent=1))
    records = []
    flops = model.flops_per_token(self.dims, cfg.data.seq_len)
    peak = peak_flops_per_device(cfg)
    tokens_per_step = self.global_batch * cfg.data.seq_len
    progress = _progress(cfg, start)
    t_last, steps_since = time.perf_counter(), 0
    try:
      with open(run_dir / "metrics.jsonl", "a") as log:
        for step in range(start, cfg.train.steps):
          batch = jax.device_put(next(batches), self.batch_sharding)
          state, metrics = self.train_step(state, batch)
          steps_since += 1
          done = step + 1
          if done % cfg.train.log_every == 0 or done == cfg.train.steps:
            metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
            now = time.perf_counter()
            step_time = (now - t_last) / steps_since
            t_last, steps_since = now, 0
            record = {"step": done, **metrics, "step_time_s": step_time, "tokens_per_s": tokens_per_step / step_time,
                      "mfu": None if peak is None else flops * tokens_per_step / step_time / (peak * self.mesh.size)}
            if cfg.attention != "clis":
              record["certified_fraction"] = None
            records.append(record)
            log.write(json.dumps(record) + "\n")
            log.flush()
            progress.set_postfix(loss=f"{metrics['loss']:.4f}", tok_s=f"{record['tokens_per_s']:.0f}")
          if done % cfg.train.eval_every == 0 and examples.eval:
            eval_record = {"step": done, "eval_loss": self.evaluate(state["params"], examples.eval)}
            records.append(eval_record)
            log.write(json.dumps(eval_record) + "\n")
          if done % cfg.checkpoint.every == 0 or done == cfg.train.steps:
            checkpoint.save(mngr, done, state, batches, force=True)
          progress.update(1)
          if on_step is not None:
            on_step(done, metrics)
    finally:
      progress.close()
      mngr.wait_until_finished()
      mngr.close()
    self.state = state
    return records

  def init_state_from(self, params):
    return jax.jit(lambda p: {"step": jnp.zeros((), jnp.int32), "params": p, "opt_state": self.optimizer.init(p)},
                   out_shardings=self.state_shardings)(params)

  def evaluate(self, params, eval_examples) -> float:
    """Mean loss over cfg.train.eval_batches packed batches of held-out data (same batches every time)."""
    batches = data.packed_batches(eval_examples, seq_len=self.cfg.data.seq_len, batch_size=self.global_batch,
                                  seed=0, packing_bins=self.cfg.data.packing_bins, shuffle=False)
    losses = [float(self.eval_step(params, jax.device_put(next(batches), self.batch_sharding))[0])
              for _ in range(self.cfg.train.eval_batches)]
    return float(np.mean(losses))


def _progress(cfg, start):
  from tqdm import tqdm
  return tqdm(total=cfg.train.steps, initial=start, disable=not cfg.train.progress_bar, desc="train",
              dynamic_ncols=True)


def train(cfg: Config, on_step=None) -> list[dict]:
  return Trainer(cfg).run(on_step=on_step)
