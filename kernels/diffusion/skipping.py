"""Temporal tile skipping (after LiteAttention) for bidirectional CLiS attention across denoising steps.

A (q tile, kv tile) pair whose weight is negligible for every row of the q tile at one call
is marked, and left out (QK, exp and PV) at later calls of the same layer; marks only
accumulate (a skipped tile never comes back) until the caller starts from a fresh state,
which also recovers a dense step at any time. The state is an explicit pytree per layer that
the sampler threads through; nothing is global.

Marking rule, sound at the call that marks. Row i's weight on kv tile u is
    w_iu = Σ_{j∈u} 2^(t_ij − lse_i) ≤ block_k · 2^(max_{j∈u} t_ij − lse_i)          (base 2)
and a tile is marked when that bound is below 2^thr for every real row of the q tile (thr in
log2 units; thr = −inf marks nothing). With the fixed CLiS stabilizer M_i, the kernel can form
max_{j∈u} t_ij − lse_i = (max_{j∈u} t_ij − M_i) − log2 l_i from quantities it already has.
Guarantee: if row i leaves out tiles of total weight δ_i = Σ w_iu (weights of the inputs of
that call), its output moves by at most δ_i / (1 − δ_i) · max_j ‖v_j − o_i‖∞ ≤ 2·δ_i/(1 − δ_i)·max|v|,
and δ_i < (number of skipped tiles)·2^thr. At later calls the inputs have moved on; that the
weights stay small there is LiteAttention's observation (temporal coherence), not a theorem,
so `SkipStats` reports what was skipped and callers measure the error (bench_diffusion).
This module is the reference path (pure JAX); the Pallas kernels do not read skip lists yet.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from clis_kernels import api, masks, reference, stabilizer


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


def init_state(batch: int, heads: int, seq_len: int, block_sizes: reference.BlockSizes) -> SkipState:
  """A state with nothing skipped: the next call is dense."""
  nq = -(-seq_len // block_sizes.multiple) * block_sizes.multiple // block_sizes.block_q
  nk = nq * block_sizes.block_q // block_sizes.block_k
  return SkipState(jnp.zeros((batch, heads, nq, nk), bool), jnp.zeros((), jnp.int32))


def threshold_schedule(step: int, *, num_steps: int, dense_steps: int, thr_early: float = -20.0,
                       thr_late: float = -10.0) -> float:
  """thr (log2) for a denoising step: dense (−inf) for the first dense_steps, then stricter early,
  moving linearly from thr_early to thr_late by the last step."""
  if step < dense_steps:
    return -math.inf
  frac = (step - dense_steps) / max(1, num_steps - 1 - dense_steps)
  return thr_early + (thr_late - thr_early) * frac


def attention(q, k, v, state: SkipState, *, thr: float, scale: float | None = None,
              block_sizes: reference.BlockSizes | None = None, stabilizer_name: str = "clis", tau: float = 64.0):
  """Bidirectional attention that leaves out the tiles `state` marks and marks new ones.

  q [B, S, H, D], k/v [B, Sk, Hkv, D]. Returns (out like q, new SkipState, SkipStats).
  """
  api._validate(q, k, v, None, False, stabilizer_name, "tile", tau)
  scale = float(scale) if scale is not None else 1.0 / math.sqrt(q.shape[-1])
  bs = block_sizes or reference.default_block_sizes(q.shape[-1], max(q.shape[1], k.shape[1]), q.dtype)
  seq_len, kv_seq_len = q.shape[1], k.shape[1]
  qp, kp, vp = (api._pad_seq(x, bs.multiple) for x in (q, k, v))
  kv_len = kv_seq_len if kp.shape[1] != kv_seq_len else None
  nq, nk = qp.shape[1] // bs.block_q, kp.shape[1] // bs.block_k
  if state.skip.shape != (q.shape[0], q.shape[2], nq, nk):
    raise ValueError(f"state.skip.shape={state.skip.shape} must be {(q.shape[0], q.shape[2], nq, nk)} for these "
                     "inputs and block sizes; make it with init_state(...)")
  cert = None
  if stabilizer_name == "clis":
    cert = stabilizer.certify(qp, kp, vp, None, causal=False, scale=scale, tau=tau, granularity="tile",
                              block_q=bs.block_q, seq_len=kv_seq_len)
  out, lse, tile_max = reference.forward_with_tiles(qp, kp, vp, None, cert, causal=False, scale=scale,
                                                    kv_len=kv_len, block_sizes=bs, tile_skip=state.skip,
                                                    tile_max=True)
  # Bound on each row's weight per kv tile, log2: max_j t_ij − lse_i + log2(block_k); skipped tiles count as -inf.
  bound = tile_max - lse[..., None] + math.log2(bs.block_k)  # [B, H, S, nk]
  real_rows = masks.query_is_real(None, qp.shape[1], seq_len)[0]
  bound = jnp.where(real_rows[None, None, :, None], bound, -jnp.inf)
  per_tile = bound.reshape(bound.shape[0], bound.shape[1], nq, bs.block_q, nk).max(axis=3)
  new_marks = (per_tile < thr) & ~state.skip
  skip = state.skip | new_marks
  stats = SkipStats(sparsity=state.skip.mean(), new_marks=new_marks,
                    max_skipped_weight=jnp.asarray(2.0 ** thr if thr > -math.inf else 0.0, jnp.float32))
  return out[:, :seq_len], SkipState(skip, state.calls + 1), stats
