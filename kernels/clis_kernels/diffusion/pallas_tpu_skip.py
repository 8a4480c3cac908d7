"""Bidirectional CLiS forward (Pallas TPU) that visits only the kv tiles of a per-tile list.

Splash-attention habits, as kernels/clis_kernels/pallas_tpu.py: head-major layout, grid (batch, head, q block,
step) with the step axis sequential. `visit` [B, H, nq, nk] (kept tiles first, in order),
`count` [B, H, nq] and the certificate's tile flags arrive as scalar-prefetched SMEM tables; the
K/V index maps fetch tile visit[b, h, i, min(step, count − 1)], so the steps past `count` repeat
the last fetched block (no DMA) and compute nothing: skipped tiles are never loaded. The
certificate is the XLA pre-pass's (M per row, a flag per tile), as in pallas_tpu.

With `track`, step j also yields skipping.py's marking statistic for the tile it visits,
  gap = max over real rows of (max_{k∈tile} t − m)   (m: the stabilizer in force after the tile),
kept per step in lane j of a [1, nk] row (a vector select: no dynamic lane store), and the
q tile's min over real rows of log2 l; the wrapper puts the gaps back in tile order.
We have no TPU: checked in Pallas TPU interpret mode on the CPU. The tables live in SMEM, so
B·H·nq·nk must stay within it (about 10^5 entries: S ≈ 40k at 512-row tiles and 12 heads).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from clis_kernels.common import dot_precision, out_struct
from clis_kernels.diffusion.tile_lists import kept_tiles
from clis_kernels.plan import Mode, stabilizer_inputs
from clis_kernels.pallas_tpu import (BlockSizes, compiler_params, finish, interpret_mode, nt_dot, tile_update,
                                     to_head_major)
from clis_kernels.stabilizer import LOG2E, NEG, Certificate


def _kernel(visit_ref, count_ref, cert_ref, q_ref, k_ref, v_ref, m_in_ref, o_ref, lse_ref, gap_ref, log2_l_ref,
            acc_scr, m_scr, l_scr, gap_scr, *, fixed_mode, track, sigma2, block_q, block_k, kv_len, seq_len,
            num_heads, num_q_blocks, num_steps, precision):
  b, h, i, j = (pl.program_id(a) for a in range(4))
  row = (b * num_heads + h) * num_q_blocks + i
  count = count_ref[row]
  tile = visit_ref[row * num_steps + jnp.minimum(j, jnp.maximum(count - 1, 0))]  # the kv tile step j visits
  certified = cert_ref[row] != 0 if fixed_mode else jnp.bool_(False)
  row_real = i * block_q + jax.lax.broadcasted_iota(jnp.int32, (block_q, 1), 0) < seq_len

  @pl.when(j == 0)
  def _init():
    m_scr[...] = jnp.where(certified, m_in_ref[...], NEG)
    l_scr[...] = jnp.zeros_like(l_scr)
    acc_scr[...] = jnp.zeros_like(acc_scr)
    gap_scr[...] = jnp.full_like(gap_scr, NEG)

  def update(fixed):
    s = nt_dot(q_ref[...], k_ref[...], precision) * sigma2
    if kv_len is not None:  # block padding past the real keys
      k_pos = tile * block_k + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
      s = jnp.where(k_pos < kv_len, s, NEG)
    m_after = tile_update(s, v_ref[...], m_scr, l_scr, acc_scr, fixed=fixed, precision=precision)
    if track:
      tile_gap = jnp.max(jnp.where(row_real, s.max(axis=1, keepdims=True) - m_after, NEG))
      lane = jax.lax.broadcasted_iota(jnp.int32, gap_scr.shape, 1)
      gap_scr[...] = jnp.where(lane == j, tile_gap, gap_scr[...])

  for fixed in ((False, True) if fixed_mode else (False,)):
    pl.when((j < count) & (certified if fixed else ~certified))(functools.partial(update, fixed))

  @pl.when(j == num_steps - 1)
  def _finish():
    empty, l_safe = finish(acc_scr, m_scr, l_scr, o_ref, lse_ref)
    gap_ref[...] = gap_scr[...]
    log2_l_ref[...] = jnp.full(log2_l_ref.shape, jnp.min(jnp.where(row_real & ~empty, jnp.log2(l_safe), jnp.inf)))


def forward(q, k, v, skip, stab, *, mode: Mode, scale: float, kv_len: int | None, seq_len: int,
            block_sizes: BlockSizes, track: bool, interpret: bool = False):
  """The skip-forward contract of kernels/clis_kernels/diffusion (skipping.py calls every backend's so): q, k, v padded
  to whole tiles ([B, S, H, D], [B, Sk, Hkv, D]); skip [B, H, nq, nk] bool (SkipState.skip); stab as
  plan.stabilizer_inputs takes it for `mode`
  (the XLA pre-pass's Certificate, or None). Returns (o, gap [B, H, nq, nk], log2_l [B, H, nq])."""
  if mode is Mode.KEYS:
    raise ValueError(f"the Mosaic TPU skip kernel takes the XLA certificate: {mode=} must not be Mode.KEYS")
  _, cert = stabilizer_inputs(stab, mode)
  visit, count = kept_tiles(skip)
  o, _, gap, log2_l = forward_listed(q, k, v, visit, count, cert, scale=scale, kv_len=kv_len, seq_len=seq_len,
                                     block_sizes=block_sizes, track=track, interpret=interpret)
  return o, gap, log2_l


def forward_listed(q, k, v, visit, count, cert: Certificate | None, *, scale: float, kv_len: int | None,
                   seq_len: int, block_sizes: BlockSizes, track: bool, interpret: bool = False):
  """Bidirectional attention over listed kv tiles (tile = block_q × block_k).

  q [B, S, H, D], k/v [B, Sk, Hkv, D] (padded to whole tiles); visit [B, H, nq, nk] int32, a
  permutation of each row's tiles with the kept ones first; count [B, H, nq] int32. cert: the
  XLA certificate, or None for the online softmax. Returns (o, lse [B, H, S], gap [B, H, nq, nk]
  f32 per tile, NEG where not visited or not tracked, log2_l [B, H, nq] f32).
  """
  batch, seq, heads, head_dim = q.shape
  group = heads // k.shape[2]
  bq, bk = block_sizes.block_q, block_sizes.block_k
  nq, nk = seq // bq, k.shape[1] // bk
  fixed_mode = cert is not None
  if fixed_mode:
    m_in, cert_flat = cert.m[..., None], cert.certified.astype(jnp.int32).reshape(-1)
  else:
    m_in, cert_flat = jnp.zeros((batch, heads, seq, 1), jnp.float32), jnp.zeros((1,), jnp.int32)

  def kv_index(b, h, i, j, visit_ref, count_ref, cert_ref):
    row = (b * heads + h) * nq + i
    step = jnp.minimum(j, jnp.maximum(count_ref[row] - 1, 0))
    return b, h // group, visit_ref[row * nk + step], 0

  q_index = lambda b, h, i, j, *_: (b, h, i, 0)
  tile_row = lambda b, h, i, j, *_: (b, h, i, 0, 0)
  kernel = functools.partial(_kernel, fixed_mode=fixed_mode, track=track, sigma2=scale * LOG2E, block_q=bq,
                             block_k=bk, kv_len=kv_len, seq_len=seq_len, num_heads=heads, num_q_blocks=nq,
                             num_steps=nk, precision=dot_precision(q.dtype))
  o, lse, gap, log2_l = pl.pallas_call(
      kernel,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=3,
          grid=(batch, heads, nq, nk),
          in_specs=[pl.BlockSpec((None, None, bq, head_dim), q_index),
                    pl.BlockSpec((None, None, bk, head_dim), kv_index),
                    pl.BlockSpec((None, None, bk, head_dim), kv_index),
                    pl.BlockSpec((None, None, bq, 1), q_index)],
          out_specs=[pl.BlockSpec((None, None, bq, head_dim), q_index), pl.BlockSpec((None, None, bq, 1), q_index),
                     pl.BlockSpec((None, None, None, 1, nk), tile_row),
                     pl.BlockSpec((None, None, None, 1, 1), tile_row)],
          scratch_shapes=[pltpu.VMEM((bq, head_dim), jnp.float32), pltpu.VMEM((bq, 1), jnp.float32),
                          pltpu.VMEM((bq, 1), jnp.float32), pltpu.VMEM((1, nk), jnp.float32)]),
      out_shape=[out_struct((batch, heads, seq, head_dim), q.dtype, q),
                 out_struct((batch, heads, seq, 1), jnp.float32, q),
                 out_struct((batch, heads, nq, 1, nk), jnp.float32, q),
                 out_struct((batch, heads, nq, 1, 1), jnp.float32, q)],
      compiler_params=compiler_params(("parallel", "parallel", "parallel", "arbitrary"), interpret),
      interpret=interpret_mode(interpret),
      name="clis_skip_fwd_tpu" if fixed_mode else "online_skip_fwd_tpu",
  )(visit.reshape(-1), count.reshape(-1), cert_flat, to_head_major(q), to_head_major(k), to_head_major(v), m_in)
  gap = jnp.take_along_axis(gap[:, :, :, 0], jnp.argsort(visit, axis=-1), axis=-1)  # step order → tile order
  return to_head_major(o), lse[..., 0], gap, log2_l[:, :, :, 0, 0]
