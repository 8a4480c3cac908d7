"""Attention backends for the example DiT, and the flow-matching Euler sampler.

`make_attend(name)` gives the model's self-attention: "xla" (dense jax.nn), "cudnn", "online"
and "clis" (clis_kernels.attention, bidirectional), "clis_cp" / "online_cp" (the video tokens split over every
device, clis_kernels.context_parallel), "clis_skip" / "online_skip"
(kernels/clis_kernels/diffusion temporal tile skipping, one SkipState per layer threaded by the sampler,
thr per step from `diffusion.threshold_schedule`), and "clis_skip_cp" / "online_skip_cp" (the same with the tokens
split over every device: diffusion.context_parallel).
"""

from __future__ import annotations

import functools
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from clis_kernels import attention as clis_attention
from clis_kernels import context_parallel
from clis_kernels import diffusion
from clis_kernels import plan as plan_lib
from examples.video_dit.model import DiTConfig, VideoDiT

BACKENDS = ("xla", "cudnn", "online", "clis", "online_cp", "clis_cp", "online_skip", "clis_skip", "online_skip_cp",
            "clis_skip_cp")


def is_skipping(name: str) -> bool:
  """Whether backend `name` threads SkipStates (the *_skip and *_skip_cp backends)."""
  return name.removesuffix("_cp").endswith("_skip")


@functools.lru_cache(maxsize=None)
def skip_plan(cfg: DiTConfig) -> plan_lib.Plan:
  """The skip path's plan: plan.py picks this platform's skip kernel and its tiles (Triton on GPUs,
  Mosaic on TPUs, the reference elsewhere)."""
  return plan_lib.make_plan(dtype=jnp.dtype(cfg.dtype), head_dim=cfg.head_dim, seq_len=cfg.tokens, skipping=True)


def _skip_kw(cfg: DiTConfig) -> dict:
  """The skip path's tiles only: diffusion.attention then makes the same automatic choices as the dense `clis`
  call (the loop: online where the entry does not certify by default, as on Hopper), so with nothing skipped it is
  the dense kernel's output bit for bit, and a skipped sample differs from the dense one only by what skipping left
  out."""
  return dict(block_sizes=skip_plan(cfg).block_sizes)


def make_attend(name: str, thr=None, cfg: DiTConfig | None = None):
  """attend(q, k, v, state) -> (out, state, sparsity or None); thr is traced for the skip backends,
  which take their plan from cfg."""
  if name not in BACKENDS:
    raise ValueError(f"attention={name!r} must be one of {BACKENDS}")
  if name in ("xla", "cudnn"):
    return lambda q, k, v, state: (jax.nn.dot_product_attention(q, k, v, implementation=name), state, None)
  if name in ("online", "clis"):
    return lambda q, k, v, state: (clis_attention(q, k, v, causal=False, stabilizer=name), state, None)
  if name in ("online_cp", "clis_cp"):
    return _context_parallel_attend(name.removesuffix("_cp"))
  kw = _skip_kw(cfg)
  if name.endswith("_cp"):
    return _context_parallel_skip_attend(name.removesuffix("_skip_cp"), thr, kw)

  def attend(q, k, v, state):
    out, state, stats = diffusion.attention(q, k, v, state, thr=thr, stabilizer_name=name.removesuffix("_skip"),
                                            **kw)
    return out, state, stats.sparsity
  return attend


def _context_parallel_attend(stabilizer: str):
  """Self-attention with the video tokens split over every device (a `context` mesh axis, natural order:
  bidirectional attention needs no load balancing); the token count must be a multiple of 2 × devices."""
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ("context",))
  tokens = P(None, "context")

  @functools.partial(jax.shard_map, mesh=mesh, in_specs=(tokens,) * 3, out_specs=tokens)
  def run(q, k, v):
    return context_parallel.context_parallel_attention(q, k, v, axis_name="context", causal=False,
                                                       stabilizer=stabilizer, combine=stabilizer, layout="contiguous")

  return lambda q, k, v, state: (run(q, k, v), state, None)


def _context_parallel_skip_attend(stabilizer: str, thr, kw: dict):
  """Temporal skipping with the video tokens split over every device (natural order): each device runs its rows
  against every key (diffusion.context_parallel) with its rows of each layer's SkipState."""
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ("context",))
  tokens = P(None, "context")
  states = diffusion.SkipState(skip=P(None, None, "context", None), calls=P())

  @functools.partial(jax.shard_map, mesh=mesh, in_specs=(tokens,) * 3 + (states,), out_specs=(tokens, states, P()))
  def run(q, k, v, state):  # thr: a Python float (−inf: no marking work) or the step's traced scalar
    out, state, stats = diffusion.context_parallel.attention(q, k, v, state, thr=thr, axis_name="context",
                                                             stabilizer_name=stabilizer, **kw)
    return out, state, stats.sparsity

  return run


def make_calibrating_attend(name: str, target: float, thrs: list, cfg: DiTConfig):
  """Like make_attend's skip backends, but each call bisects its own thr to `target` relative L1
  error (diffusion.calibrate_thr) and appends it to `thrs`. Eager (Python-level): not under jit."""
  if name.endswith("_cp"):
    raise ValueError(f"calibrating thr runs on one device: attention={name!r} splits the tokens; use "
                     f"{name.removesuffix('_cp')!r} with calibrate, or a thr schedule")
  kw = dict(_skip_kw(cfg), stabilizer_name=name.removesuffix("_skip"))

  def attend(q, k, v, state):
    thr, _ = diffusion.calibrate_thr(q, k, v, state, target=target, **kw)
    thrs.append(thr)
    out, state, stats = diffusion.attention(q, k, v, state, thr=thr, **kw)
    return out, state, stats.sparsity
  return attend


def init_skip_states(cfg: DiTConfig, batch: int):
  return [diffusion.init_state(batch, cfg.heads, cfg.tokens, skip_plan(cfg).block_sizes) for _ in range(cfg.layers)]


@functools.lru_cache(maxsize=None)
def _step_fn(cfg: DiTConfig, name: str, track: bool):
  def step(params, x, t, dt, condition, states, thr):
    model = VideoDiT(cfg, make_attend(name, thr if track else -math.inf, cfg))
    velocity, states, aux = model.apply({"params": params}, x, jnp.full((x.shape[0],), t), condition, states)
    return x - dt * velocity, states, aux
  return jax.jit(step)


def sample(params, cfg: DiTConfig, noise, condition, *, attention: str, steps: int = 20, dense_steps: int = 4,
           thr_early: float = -14.0, thr_late: float = -8.0, calibrate: float | None = None, timing: bool = False,
           keep_states: bool = False):
  """Euler from t=1 (noise) to t=0. Returns (video, per-step records: t, thr, sparsity (and per layer), ms, and
  the skip states each step ran with (a list per step; None entries without skipping) when
  keep_states, else the final states). calibrate: instead of the thr schedule, each layer bisects
  its thr to this relative L1 error at every step after the dense ones (eager steps, slower)."""
  skip = is_skipping(attention)
  states = init_skip_states(cfg, noise.shape[0]) if skip else None
  x, records, history = noise, [], []
  ts = jnp.linspace(1.0, 0.0, steps + 1)
  for i in range(steps):
    thr = diffusion.threshold_schedule(i, num_steps=steps, dense_steps=dense_steps, thr_early=thr_early,
                                       thr_late=thr_late) if skip else -math.inf
    layer_thrs = []
    if skip and calibrate is not None and i >= dense_steps:
      model = VideoDiT(cfg, make_calibrating_attend(attention, calibrate, layer_thrs, cfg))

      def fn(params, x, t, dt, condition, states, thr, model=model):
        velocity, states, aux = model.apply({"params": params}, x, jnp.full((x.shape[0],), t), condition, states)
        return x - dt * velocity, states, aux
    else:
      fn = _step_fn(cfg, attention, skip and thr > -math.inf)
    args = (params, x, ts[i], ts[i] - ts[i + 1], condition, states, jnp.float32(max(thr, -1e4)))
    history.append(states)
    t0 = time.perf_counter()
    x, states, aux = fn(*args)
    x = jax.block_until_ready(x)
    ms = (time.perf_counter() - t0) * 1e3
    layer_sparsity = [float(a) for a in aux] if skip else None
    sparsity = float(jnp.mean(jnp.asarray(layer_sparsity))) if skip else 0.0
    if layer_thrs:  # calibrated: the loosest layer's thr stands for the step (it decides whether marks are made)
      thr = max(layer_thrs)
    records.append(dict(step=i, t=float(ts[i]), thr=thr, layer_thrs=layer_thrs or None, sparsity=sparsity,
                        layer_sparsity=layer_sparsity, ms=ms if timing else None))
  return x, records, (history if keep_states else states)
