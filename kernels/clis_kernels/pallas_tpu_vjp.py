"""CLiS attention backward as Pallas Mosaic TPU kernels (FlashAttention-2 style, from the saved lse).

P = 2^(σ₂·q·kᵀ − lse), dP = dO·Vᵀ, dS = P∘(dP − Δ), dQ = σ·dS·K, dK = σ·dSᵀ·Q, dV = Pᵀ·dO.
  dq:  grid (batch, q_head, q_block, kv_block), kv minor, dQ in an f32 scratch;
  dkv: grid (batch, kv_head, kv_block, group_head, q_block), the last two axes reduce
       into f32 dK/dV scratch, so GQA sums over the group's query heads in VMEM.
Blocks hidden by the causal mask are skipped and their DMAs elided, as in the forward.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from clis_kernels import masks
from clis_kernels.common import dot_precision, out_struct
from clis_kernels.pallas_tpu import (BlockSizes, block_flags, block_mask, compiler_params, first_kv_blocks,
                                     interpret_mode, last_visible_kv_block, mask_branches, nn_dot, nt_dot,
                                     segment_operands, tn_dot, to_head_major)
from clis_kernels.stabilizer import LOG2E, NEG, soft_cap


def _grads_of_block(q, k, v, do, lse, delta, mask, *, sigma2, precision, cap2):
  """P and dS of one (q block, kv block) pair (dS through the soft cap when there is one)."""
  s = nt_dot(q, k, precision) * sigma2
  capped = soft_cap(s, cap2)
  if mask is not None:
    capped = jnp.where(mask, capped, NEG)
  p = jnp.exp2(capped - lse)
  ds = p * (nt_dot(do, v, precision) - delta)
  if cap2 is not None:
    ds = ds * (1.0 - jnp.square(jnp.tanh(s / cap2)))
  return p, ds


def _dq_kernel(*refs, has_segments, causal, sigma2, scale, block_q, block_k, kv_len, num_kv_blocks, precision,
               window, cap2, num_q_blocks=0, doc_ranges=False):
  first_ref, refs = (refs[0], refs[1:]) if doc_ranges else (None, refs)
  q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = refs[:6]
  qseg_ref, kseg_ref = refs[6:8] if has_segments else (None, None)
  dq_ref, dq_scr = refs[-2:]
  i, j = pl.program_id(2), pl.program_id(3)

  @pl.when(j == 0)
  def _init():
    dq_scr[...] = jnp.zeros_like(dq_scr)

  def update(masked):
    mask = block_mask(i, j, qseg_ref, kseg_ref, causal=causal, kv_len=kv_len, block_q=block_q,
                      block_k=block_k, window=window) if masked else None
    _, ds = _grads_of_block(q_ref[...], k_ref[...], v_ref[...], do_ref[...], lse_ref[...], delta_ref[...], mask,
                            sigma2=sigma2, precision=precision, cap2=cap2)
    dq_scr[...] += nn_dot(ds.astype(k_ref.dtype), k_ref[...], precision)

  runs, needs_mask = block_flags(i, j, causal=causal, has_segments=has_segments, kv_len=kv_len,
                                 block_q=block_q, block_k=block_k, window=window)
  if doc_ranges:  # kv blocks before the rows' documents' first key
    runs = runs & (j >= first_ref[pl.program_id(0) * num_q_blocks + i])
  for masked in mask_branches(causal=causal, has_segments=has_segments, kv_len=kv_len, window=window):
    pl.when(runs & (needs_mask if masked else ~needs_mask))(functools.partial(update, masked))

  @pl.when(j == num_kv_blocks - 1)
  def _finish():
    dq_ref[...] = (dq_scr[...] * scale).astype(dq_ref.dtype)


def _dkv_kernel(*refs, has_segments, causal, sigma2, scale, block_q, block_k, kv_len, group,
                num_q_blocks, precision, window, cap2, num_kv_blocks=0, doc_ranges=False):
  last_ref, refs = (refs[0], refs[1:]) if doc_ranges else (None, refs)
  q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = refs[:6]
  qseg_ref, kseg_ref = refs[6:8] if has_segments else (None, None)
  dk_ref, dv_ref, dk_scr, dv_scr = refs[-4:]
  j, g, i = pl.program_id(2), pl.program_id(3), pl.program_id(4)

  @pl.when((g == 0) & (i == 0))
  def _init():
    dk_scr[...] = jnp.zeros_like(dk_scr)
    dv_scr[...] = jnp.zeros_like(dv_scr)

  def update(masked):
    mask = block_mask(i, j, qseg_ref, kseg_ref, causal=causal, kv_len=kv_len, block_q=block_q,
                      block_k=block_k, window=window) if masked else None
    q, do = q_ref[...], do_ref[...]
    p, ds = _grads_of_block(q, k_ref[...], v_ref[...], do, lse_ref[...], delta_ref[...], mask,
                            sigma2=sigma2, precision=precision, cap2=cap2)
    dv_scr[...] += tn_dot(p.astype(do.dtype), do, precision)
    dk_scr[...] += tn_dot(ds.astype(q.dtype), q, precision)

  runs, needs_mask = block_flags(i, j, causal=causal, has_segments=has_segments, kv_len=kv_len,
                                 block_q=block_q, block_k=block_k, window=window)
  if doc_ranges:  # q blocks after the keys' documents' last query
    runs = runs & (i <= last_ref[pl.program_id(0) * num_kv_blocks + j])
  for masked in mask_branches(causal=causal, has_segments=has_segments, kv_len=kv_len, window=window):
    pl.when(runs & (needs_mask if masked else ~needs_mask))(functools.partial(update, masked))

  @pl.when((g == group - 1) & (i == num_q_blocks - 1))
  def _finish():
    dk_ref[...] = (dk_scr[...] * scale).astype(dk_ref.dtype)
    dv_ref[...] = dv_scr[...].astype(dv_ref.dtype)


def backward(q, k, v, segment_ids, o, lse, do, *, causal, scale, kv_len, block_sizes: BlockSizes,
             window=None, softcap=None, interpret=False):
  """Returns (dq, dk, dv) shaped like q, k, v."""
  batch, seq, num_heads, head_dim = q.shape
  kv_seq, num_kv_heads = k.shape[1:3]
  group = num_heads // num_kv_heads
  delta = jnp.einsum("bshd,bshd->bhs", o.astype(jnp.float32), do.astype(jnp.float32))[..., None]
  lse = lse[..., None]
  qh, kh, vh, doh = (to_head_major(x) for x in (q, k, v, do))
  has_seg = segment_ids is not None
  seg_args = list(segment_operands(segment_ids)) if has_seg else []
  common = dict(has_segments=has_seg, causal=causal, sigma2=scale * LOG2E, scale=scale, kv_len=kv_len,
                precision=dot_precision(q.dtype), window=window, cap2=None if softcap is None else softcap * LOG2E)
  interp = interpret_mode(interpret)

  # dQ: kv blocks on the minor axis; causal steps past the diagonal repeat the last block.
  bq, bk = block_sizes.block_q_dq, block_sizes.block_k_dq
  nq, nk = seq // bq, kv_seq // bk
  last_kv = functools.partial(last_visible_kv_block, causal=causal, kv_len=kv_len, block_q=bq, block_k=bk,
                              num_kv_blocks=nk)
  doc_ranges = block_sizes.document_ranges and causal and has_seg and window is None
  kv_block = lambda b, i, j, *refs: jnp.minimum(j, last_kv(i))  # steps outside the range repeat a block: no DMA
  prefetch = []
  if doc_ranges:
    prefetch = [first_kv_blocks(segment_ids, block_q=bq, block_k=bk)]
    kv_block = lambda b, i, j, first: jnp.minimum(jnp.maximum(j, first[b * nq + i]), last_kv(i))
  kv_index = lambda b, h, i, j, *refs: (b, h // group, kv_block(b, i, j, *refs), 0)
  row_index = lambda b, h, i, j, *refs: (b, h, i, 0)
  in_specs = [pl.BlockSpec((None, None, bq, head_dim), row_index),
              pl.BlockSpec((None, None, bk, head_dim), kv_index),
              pl.BlockSpec((None, None, bk, head_dim), kv_index),
              pl.BlockSpec((None, None, bq, head_dim), row_index),
              pl.BlockSpec((None, None, bq, 1), row_index),
              pl.BlockSpec((None, None, bq, 1), row_index)]
  if has_seg:
    in_specs += [pl.BlockSpec((None, bq, 1), lambda b, h, i, j, *refs: (b, i, 0)),
                 pl.BlockSpec((None, 1, bk), lambda b, h, i, j, *refs: (b, 0, kv_block(b, i, j, *refs)))]
  dq = pl.pallas_call(
      functools.partial(_dq_kernel, block_q=bq, block_k=bk, num_kv_blocks=nk, num_q_blocks=nq,
                        doc_ranges=doc_ranges, **common),
      out_shape=out_struct(qh.shape, q.dtype, q),
      compiler_params=compiler_params(("parallel", "parallel", "parallel", "arbitrary"), interpret),
      interpret=interp, name="clis_bwd_dq_tpu",
      **_grid(prefetch, grid=(batch, num_heads, nq, nk), in_specs=in_specs,
              out_specs=pl.BlockSpec((None, None, bq, head_dim), row_index),
              scratch_shapes=[pltpu.VMEM((bq, head_dim), jnp.float32)]),
  )(*prefetch, qh, kh, vh, doh, lse, delta, *seg_args)

  # dK/dV: (group head, q block) reduce on the minor axes; causal skips q blocks above the diagonal.
  bq, bk = block_sizes.block_q_dkv, block_sizes.block_k_dkv
  nq, nk = seq // bq, kv_seq // bk
  first_q = (lambda j: (j * bk) // bq) if causal else (lambda j: 0)
  q_block = lambda b, j, i, *refs: jnp.maximum(i, first_q(j))  # steps outside the range repeat a block: no DMA
  prefetch = []
  if doc_ranges:
    prefetch = [_last_q_blocks(segment_ids, block_q=bq, block_k=bk)]
    q_block = lambda b, j, i, last: jnp.minimum(jnp.maximum(i, first_q(j)), last[b * nk + j])
  q_index = lambda b, h, j, g, i, *refs: (b, h * group + g, q_block(b, j, i, *refs), 0)
  kv_index = lambda b, h, j, g, i, *refs: (b, h, j, 0)
  in_specs = [pl.BlockSpec((None, None, bq, head_dim), q_index),
              pl.BlockSpec((None, None, bk, head_dim), kv_index),
              pl.BlockSpec((None, None, bk, head_dim), kv_index),
              pl.BlockSpec((None, None, bq, head_dim), q_index),
              pl.BlockSpec((None, None, bq, 1), q_index),
              pl.BlockSpec((None, None, bq, 1), q_index)]
  if has_seg:
    in_specs += [pl.BlockSpec((None, bq, 1), lambda b, h, j, g, i, *refs: (b, q_block(b, j, i, *refs), 0)),
                 pl.BlockSpec((None, 1, bk), lambda b, h, j, g, i, *refs: (b, 0, j))]
  dk, dv = pl.pallas_call(
      functools.partial(_dkv_kernel, block_q=bq, block_k=bk, group=group, num_q_blocks=nq, num_kv_blocks=nk,
                        doc_ranges=doc_ranges, **common),
      out_shape=[out_struct(kh.shape, k.dtype, q), out_struct(vh.shape, v.dtype, q)],
      compiler_params=compiler_params(("parallel", "parallel", "parallel", "arbitrary", "arbitrary"), interpret),
      interpret=interp, name="clis_bwd_dkv_tpu",
      **_grid(prefetch, grid=(batch, num_kv_heads, nk, group, nq), in_specs=in_specs,
              out_specs=[pl.BlockSpec((None, None, bk, head_dim), kv_index)] * 2,
              scratch_shapes=[pltpu.VMEM((bk, head_dim), jnp.float32), pltpu.VMEM((bk, head_dim), jnp.float32)]),
  )(*prefetch, qh, kh, vh, doh, lse, delta, *seg_args)
  return to_head_major(dq), to_head_major(dk), to_head_major(dv)


def _grid(prefetch, **spec):
  """pallas_call's grid arguments: plain, or a PrefetchScalarGridSpec when range tables are prefetched."""
  if not prefetch:
    return spec
  return dict(grid_spec=pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=len(prefetch), **spec))


def _last_q_blocks(segment_ids, *, block_q: int, block_k: int):
  """masks.causal_document_ranges's last q block (end − 1) per kv block, flat [B · Sk/block_k] for scalar prefetch."""
  return (masks.causal_document_ranges(segment_ids, block_q=block_q, block_k=block_k)[1] - 1).reshape(-1)
