"""Temporal tile skipping (after LiteAttention) for bidirectional CLiS attention across denoising steps.

A (q tile, kv tile) pair whose weight is negligible for every row of the q tile at one call
is marked, and left out (QK, exp and PV: the kernel never loads it) at later calls of the same
layer; marks only accumulate (a skipped tile never comes back) until the caller starts from a
fresh state, which also recovers a dense step at any time. The state is an explicit pytree per
layer that the sampler threads through; nothing is global.

Marking rule, sound at the call that marks. Row i's weight on kv tile u is
    w_iu = Σ_{j∈u} 2^(t_ij − lse_i) ≤ block_k · 2^(max_{j∈u} t_ij − lse_i)          (base 2).
A kernel with a fixed stabilizer has no running max, so it bounds the exponent with what it
has: with m_iu the stabilizer in force after tile u (CLiS: the fixed M_i; online: the running
max, never above the final one) and l_i the final sum in the final stabilizer's units,
    max_{j∈u} t_ij − lse_i ≤ (max_{j∈u} t_ij − m_iu) − log2 l_i ≤ gap_u − log2_l,
gap_u = max over the tile's real rows of the first term, log2_l = min over them of log2 l_i.
A tile is marked when gap_u − log2_l + log2 block_k < thr (thr in log2 units; −inf marks
nothing): then every row's weight on it is < 2^thr. Every path (reference, pallas_gpu,
pallas_tpu) forms exactly these two per-tile numbers; pallas_mgpu forms the exact max_{j∈u} t_ij − lse_i
per row from its row maxima and lse (gap, with log2_l = 0), which the bound above only relaxes.
Guarantee: if row i leaves out tiles of total weight δ_i = Σ w_iu (weights of the inputs of
that call), its output moves by at most δ_i / (1 − δ_i) · max_j ‖v_j − o_i‖∞ ≤ 2·δ_i/(1 − δ_i)·max|v|,
and δ_i < (number of skipped tiles)·2^thr. A q tile may skip at most 2^(−thr−1) tiles (those with
the smallest bounds are kept as marks first), so δ_i < 1/2 at any thr and no row loses all its keys. At later calls the inputs have moved on; that the
weights stay small there is LiteAttention's observation (temporal coherence), not a theorem,
so `SkipStats` reports what was skipped and callers measure the error (bench_diffusion).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from clis_kernels import api, stabilizer
from clis_kernels import plan as plan_lib
from clis_kernels.diffusion.tile_lists import stable_rank


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SkipState:
  """One layer's skip marks. skip: [B, H, nq, nk] bool, True = left out; calls: int32, calls so far."""

  skip: jax.Array
  calls: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SkipStats:
  """sparsity: fraction of tiles skipped at this call; new_marks: tiles marked by it, [B, H, nq, nk];
  max_skipped_weight: the marking call's bound on the weight of each marked tile (2^thr)."""

  sparsity: jax.Array
  new_marks: jax.Array
  max_skipped_weight: jax.Array


def tiles(block_sizes) -> tuple[int, int]:
  """(rows, keys) of the skip grid, as the backend's BlockSizes.skip_tiles says (the q tile one kept-tile list
  serves, and the step of the kv loop that walks it)."""
  return block_sizes.skip_tiles


def init_state(batch: int, heads: int, seq_len: int, block_sizes) -> SkipState:
  """A state with nothing skipped: the next call is dense."""
  bq, bk = tiles(block_sizes)
  padded = -(-seq_len // block_sizes.multiple) * block_sizes.multiple
  return SkipState(jnp.zeros((batch, heads, padded // bq, padded // bk), bool), jnp.zeros((), jnp.int32))


def threshold_schedule(step: int, *, num_steps: int, dense_steps: int, thr_early: float = -20.0,
                       thr_late: float = -10.0) -> float:
  """thr (log2) for a denoising step: dense (−inf) for the first dense_steps, then stricter early,
  moving linearly from thr_early to thr_late by the last step."""
  if step < dense_steps:
    return -math.inf
  frac = (step - dense_steps) / max(1, num_steps - 1 - dense_steps)
  return thr_early + (thr_late - thr_early) * frac


def _within_budget(candidates, bound, skip, thr):
  """Keeps the candidates with the smallest bounds so that no q tile skips more than
  max_skipped(thr) = 2^(−thr−1) tiles: then δ_i < 1/2 for every row (the guarantee above stays
  meaningful, and a row never loses all its keys, however loose thr is)."""
  budget = jnp.floor(jnp.exp2(-jnp.asarray(thr, jnp.float32) - 1.0))
  allowed = jnp.maximum(budget - skip.sum(-1, keepdims=True), 0.0)  # [B, H, nq, 1]
  rank = stable_rank(jnp.where(candidates, bound, jnp.inf))  # rank of each tile among this q tile's candidates
  return candidates & (rank < allowed)


def attention(q, k, v, state: SkipState, *, thr, scale: float | None = None, block_sizes=None,
              stabilizer_name: str = "clis", tau: float | None = None, implementation: str | None = None,
              interpret: bool = False, platform=None):
  """Bidirectional attention that leaves out the tiles `state` marks and marks new ones.

  q [B, S, H, D], k/v [B, Sk, Hkv, D]. thr: log2 threshold, a float (−inf: mark nothing, and
  skip the marking work) or a traced scalar (a schedule under one jit; marks when finite).
  implementation: None (the platform's skip kernel, through plan.py: the Mosaic GPU kernel on Hopper, the
  Triton one on other GPUs, the Mosaic TPU one on TPUs, the reference elsewhere), or "reference", "pallas_mgpu",
  "pallas_gpu", "pallas_tpu";
  interpret=True runs a kernel on the CPU. block_sizes: that backend's.
  Returns (out like q, new SkipState, SkipStats).
  """
  api.check_inputs(q, k, v, None, False, stabilizer_name, "tile", tau)
  plan = plan_lib.make_plan(dtype=q.dtype, head_dim=q.shape[-1], seq_len=max(q.shape[1], k.shape[1]),
                            stabilizer=stabilizer_name, bound="radius", causal=False, skipping=True,
                            implementation=implementation, block_sizes=block_sizes, interpret=interpret,
                            platform=platform)
  bs = plan.block_sizes
  scale = float(scale) if scale is not None else 1.0 / math.sqrt(q.shape[-1])
  bq, bk = tiles(bs)
  seq_len, kv_seq_len = q.shape[1], k.shape[1]
  qp, kp, vp = (api.pad_seq(api.pad_axis(x, 3, to=plan.head_dim), plan.multiple) for x in (q, k, v))  # as api
  kv_len = kv_seq_len if kp.shape[1] != kv_seq_len else None
  nq, nk = qp.shape[1] // bq, kp.shape[1] // bk
  if state.skip.shape != (q.shape[0], q.shape[2], nq, nk):
    raise ValueError(f"state.skip.shape={state.skip.shape} must be {(q.shape[0], q.shape[2], nq, nk)} for these "
                     "inputs and block sizes; make it with init_state(...)")
  tau = stabilizer.default_tau(q.dtype) if tau is None else tau
  stab = api.stabilizer_input(plan, qp, kp, vp, None, causal=False, scale=scale, tau=tau, granularity="tile",
                              seq_len=seq_len, kv_seq_len=kv_seq_len, window=None, separate_ids=False, softcap=None)
  track = not isinstance(thr, (int, float)) or thr > -math.inf
  out, gap, log2_l = plan.backend.skip_forward(qp, kp, vp, state.skip, stab, mode=plan.mode, scale=scale,
                                               kv_len=kv_len, seq_len=seq_len, block_sizes=bs, track=track,
                                               interpret=interpret)

  new_marks = jnp.zeros_like(state.skip)
  if track:
    bound = gap - log2_l[..., None] + math.log2(bk)
    new_marks = _within_budget((bound < thr) & ~state.skip, bound, state.skip, thr)
  stats = SkipStats(sparsity=state.skip.mean(), new_marks=new_marks,
                    max_skipped_weight=jnp.exp2(jnp.asarray(thr, jnp.float32)))
  return out[:, :seq_len, :, :q.shape[-1]], SkipState(state.skip | new_marks, state.calls + 1), stats


def calibrate_thr(q, k, v, state: SkipState, *, target: float = 0.01, lo: float = -40.0, hi: float = -1.0,
                  iters: int = 10, **kw) -> tuple[float, float]:
  """The loosest thr in [lo, hi] (log2) whose new marks keep this call's output within `target`
  relative L1 error of the output with no new marks (LiteAttention's calibration, per layer and call).

  Bisects on thr; each probe marks with `attention(..., thr)` and measures the error by running
  again with those marks applied. hi stays ≤ −1: above it the skip budget 2^(−thr−1) is < 1 tile. Returns (thr, measured error); (-inf, 0.0) if even `lo` misses.
  kw: as `attention` (block_sizes, implementation, ...). Python-level: call it outside jit.
  """
  reference_out = attention(q, k, v, state, thr=-math.inf, **kw)[0].astype(jnp.float32)
  scale = float(jnp.mean(jnp.abs(reference_out)))

  def error(thr):
    marked = attention(q, k, v, state, thr=thr, **kw)[1]
    out = attention(q, k, v, marked, thr=-math.inf, **kw)[0].astype(jnp.float32)
    return float(jnp.mean(jnp.abs(out - reference_out))) / max(scale, 1e-30)

  best = (-math.inf, 0.0)
  if (err := error(lo)) > target:
    return best
  best = (lo, err)
  for _ in range(iters):
    mid = (lo + hi) / 2
    if (err := error(mid)) <= target:
      best, lo = (mid, err), mid
    else:
      hi = mid
  return best
