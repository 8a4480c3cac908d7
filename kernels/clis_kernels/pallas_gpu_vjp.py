"""CLiS attention backward as Pallas Triton kernels (FlashAttention-2 style, from the saved lse).

No max anywhere: P = 2^(σ₂·q·kᵀ − lse), dP = dO·Vᵀ, dS = P∘(dP − Δ) with Δ = rowsum(dO∘O),
dQ = σ·dS·K, dK = σ·dSᵀ·Q, dV = Pᵀ·dO. Two kernels:
  dq:  grid (q_block, batch, q_head), loop over kv blocks (causal: up to the diagonal);
  dkv: grid (kv_block, batch, kv_head), loop over the group's query heads and q blocks,
       so GQA sums dK and dV in registers instead of in a second pass.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from clis_kernels import masks
from clis_kernels.common import dot_precision, out_struct
from clis_kernels.pallas_gpu import BlockSizes, first_keys
from clis_kernels.stabilizer import LOG2E, NEG, soft_cap


def _split(refs, has_segments, num_in, doc_ranges=False):
  """(the six operands, qseg, kseg, the range ref or None, outputs)."""
  ins, outs = refs[:num_in + doc_ranges], refs[num_in + doc_ranges:]
  ranges = ins[-1] if doc_ranges else None
  ins = ins[:num_in]
  if has_segments:
    return ins[:-2], ins[-2], ins[-1], ranges, outs
  return ins, None, None, ranges, outs


def _probabilities(q, k, lse, q_pos, k_pos, q_seg, k_seg, *, masked, causal, kv_len, window, sigma2, cap2,
                   precision):
  """(P, dcap): the block's probabilities and the soft cap's derivative 1 − tanh²(s/c) (None without)."""
  s = plgpu.dot(q, k, trans_b=True, precision=precision) * sigma2
  capped = soft_cap(s, cap2)
  mask = masks.visible(q_pos, k_pos, q_seg, k_seg, causal=causal, kv_len=kv_len, window=window) if masked else None
  if mask is not None:
    capped = jnp.where(mask, capped, NEG)
  dcap = None if cap2 is None else 1.0 - jnp.square(jnp.tanh(s / cap2))
  return jnp.exp2(capped - lse[:, None]), dcap


def _ds(p, dcap, dp, delta):
  """dS = P ∘ (dP − Δ), through the soft cap when there is one."""
  ds = p * (dp - delta[:, None])
  return ds if dcap is None else ds * dcap


def _dq_kernel(*refs, has_segments, causal, sigma2, scale, block_q, block_k, kv_len, precision, window, cap2,
               doc_ranges=False):
  (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref), qseg_ref, kseg_ref, first_ref, (dq_ref,) = _split(
      refs, has_segments, 8 if has_segments else 6, doc_ranges)
  q_block = pl.program_id(0)
  num_kv_blocks = k_ref.shape[0] // block_k
  q, do, lse, delta = q_ref[...], do_ref[...], lse_ref[...], delta_ref[...]
  q_pos = q_block * block_q + jnp.arange(block_q)
  q_seg = None if qseg_ref is None else qseg_ref[...]

  def body(start_k, dq, masked):
    kv_slice = pl.ds(start_k * block_k, block_k)
    k, v = k_ref[kv_slice, :], v_ref[kv_slice, :]
    k_seg = None if kseg_ref is None else kseg_ref[kv_slice]
    p, dcap = _probabilities(q, k, lse, q_pos, start_k * block_k + jnp.arange(block_k), q_seg, k_seg,
                             masked=masked, causal=causal, kv_len=kv_len, window=window, sigma2=sigma2, cap2=cap2,
                             precision=precision)
    ds = _ds(p, dcap, plgpu.dot(do, v, trans_b=True, precision=precision), delta)
    return dq + plgpu.dot(ds.astype(k.dtype), k, precision=precision)

  if window is not None:  # the window's band only, every block masked
    first, end = masks.window_kv_blocks(q_block, window=window, block_q=block_q, block_k=block_k,
                                        num_kv_blocks=num_kv_blocks, div=masks.idiv)
    dq = lax.fori_loop(first, end, functools.partial(body, masked=True), jnp.zeros(dq_ref.shape, jnp.float32))
    dq_ref[...] = (dq * scale).astype(dq_ref.dtype)
    return
  if causal:
    num_full, num_total = masks.causal_kv_blocks(q_block, block_q=block_q, block_k=block_k,
                                                  num_kv_blocks=num_kv_blocks, div=masks.idiv)
  else:
    num_full, num_total = masks.bidirectional_kv_blocks(kv_len=kv_len, block_k=block_k, num_kv_blocks=num_kv_blocks)
  dq = jnp.zeros(dq_ref.shape, jnp.float32)
  first = 0 if first_ref is None else jnp.minimum(masks.idiv(jnp.max(first_ref[...]), block_k), num_full)
  dq = lax.fori_loop(first, num_full, functools.partial(body, masked=has_segments), dq)
  dq = lax.fori_loop(num_full, num_total, functools.partial(body, masked=True), dq)
  dq_ref[...] = (dq * scale).astype(dq_ref.dtype)


def _dkv_kernel(*refs, has_segments, causal, sigma2, scale, block_q, block_k, kv_len, group, precision, window,
                cap2, doc_ranges=False):
  (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref), qseg_ref, kseg_ref, end_ref, (dk_ref, dv_ref) = _split(
      refs, has_segments, 8 if has_segments else 6, doc_ranges)
  kv_block = pl.program_id(0)
  num_q_blocks = q_ref.shape[0] // block_q
  k, v = k_ref[...], v_ref[...]
  k_pos = kv_block * block_k + jnp.arange(block_k)
  k_seg = None if kseg_ref is None else kseg_ref[...]

  def body(q_block, carry, head, masked):
    dk, dv = carry
    q_slice = pl.ds(q_block * block_q, block_q)
    q, do = q_ref[q_slice, head, :], do_ref[q_slice, head, :]
    lse, delta = lse_ref[head, q_slice], delta_ref[head, q_slice]
    q_seg = None if qseg_ref is None else qseg_ref[q_slice]
    p, dcap = _probabilities(q, k, lse, q_block * block_q + jnp.arange(block_q), k_pos, q_seg, k_seg,
                             masked=masked, causal=causal, kv_len=kv_len, window=window, sigma2=sigma2, cap2=cap2,
                             precision=precision)
    dv = dv + plgpu.dot(p.astype(do.dtype), do, trans_a=True, precision=precision)
    ds = _ds(p, dcap, plgpu.dot(do, v, trans_b=True, precision=precision), delta)
    dk = dk + plgpu.dot(ds.astype(q.dtype), q, trans_a=True, precision=precision)
    return dk, dv

  if window is not None:  # the band of q blocks whose rows see this kv block, every one masked
    first, first_full = masks.window_q_blocks(kv_block, window=window, block_q=block_q, block_k=block_k,
                                              num_q_blocks=num_q_blocks, div=masks.idiv)
  elif causal:
    first, first_full = masks.causal_q_blocks(kv_block, block_q=block_q, block_k=block_k,
                                               num_q_blocks=num_q_blocks, div=masks.idiv)
  else:
    first = first_full = 0
  # Non-causal block padding: kv blocks that reach past kv_len hide some keys.
  masked_tail = kv_len is not None and (kv_block + 1) * block_k > kv_len
  end = num_q_blocks if end_ref is None else jnp.maximum(masks.idiv(jnp.max(end_ref[...]), block_q), first_full)

  def per_head(head, carry):
    carry = lax.fori_loop(first, first_full, functools.partial(body, head=head, masked=True), carry)
    if window is not None:
      return carry
    tail = functools.partial(lax.fori_loop, first_full, end)
    if has_segments:
      return tail(functools.partial(body, head=head, masked=True), carry)
    if kv_len is None:
      return tail(functools.partial(body, head=head, masked=False), carry)
    return lax.cond(masked_tail, lambda c: tail(functools.partial(body, head=head, masked=True), c),
                    lambda c: tail(functools.partial(body, head=head, masked=False), c), carry)

  zeros = jnp.zeros(dk_ref.shape, jnp.float32)
  dk, dv = lax.fori_loop(0, group, per_head, (zeros, zeros))
  dk_ref[...] = (dk * scale).astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


def backward(q, k, v, segment_ids, o, lse, do, *, causal, scale, kv_len, block_sizes: BlockSizes,
             window=None, softcap=None, interpret=False):
  """Returns (dq, dk, dv) shaped like q, k, v."""
  batch, seq, num_heads, head_dim = q.shape
  kv_seq, num_kv_heads = k.shape[1:3]  # kv_seq may differ from seq (cross-attention)
  group = num_heads // num_kv_heads
  delta = jnp.einsum("bshd,bshd->bhs", o.astype(jnp.float32), do.astype(jnp.float32))
  has_seg = segment_ids is not None
  doc_ranges = block_sizes.document_ranges and causal and has_seg and window is None
  common = dict(has_segments=has_seg, causal=causal, sigma2=scale * LOG2E, scale=scale, kv_len=kv_len,
                precision=dot_precision(q.dtype), window=window, cap2=None if softcap is None else softcap * LOG2E,
                doc_ranges=doc_ranges)
  params = plgpu.CompilerParams(num_warps=block_sizes.num_warps_bwd, num_stages=block_sizes.num_stages_bwd)

  bq, bk = block_sizes.block_q_dq, block_sizes.block_k_dq
  row = lambda i, b, h: (b, i, h, 0)
  full_kv = lambda i, b, h: (b, 0, h // group, 0)
  in_specs = [
      pl.BlockSpec((None, bq, None, head_dim), row),
      pl.BlockSpec((None, kv_seq, None, head_dim), full_kv),
      pl.BlockSpec((None, kv_seq, None, head_dim), full_kv),
      pl.BlockSpec((None, bq, None, head_dim), row),
      pl.BlockSpec((None, None, bq), lambda i, b, h: (b, h, i)),
      pl.BlockSpec((None, None, bq), lambda i, b, h: (b, h, i)),
  ]
  args = [q, k, v, do, lse, delta]
  if has_seg:
    in_specs += [pl.BlockSpec((None, bq), lambda i, b, h: (b, i)), pl.BlockSpec((None, kv_seq), lambda i, b, h: (b, 0))]
    args += [segment_ids.q, segment_ids.kv]
  dq_args = args
  if doc_ranges:
    in_specs.append(pl.BlockSpec((None, None, 1), lambda i, b, h: (b, i, 0)))
    dq_args = args + [first_keys(segment_ids, rows=bq, keys=bk)]
  dq = pl.pallas_call(
      functools.partial(_dq_kernel, block_q=bq, block_k=bk, **common),
      grid=(seq // bq, batch, num_heads),
      in_specs=in_specs,
      out_specs=pl.BlockSpec((None, bq, None, head_dim), row),
      out_shape=out_struct(q.shape, q.dtype, q),
      compiler_params=params, interpret=interpret, name="clis_bwd_dq",
  )(*dq_args)

  bq, bk = block_sizes.block_q_dkv, block_sizes.block_k_dkv
  kv_row = lambda i, b, h: (b, i, h, 0)
  group_rows = lambda i, b, h: (b, 0, h, 0)  # the group's query heads, whole sequence
  group_stats = lambda i, b, h: (b, h, 0)
  in_specs = [
      pl.BlockSpec((None, seq, group, head_dim), group_rows),
      pl.BlockSpec((None, bk, None, head_dim), kv_row),
      pl.BlockSpec((None, bk, None, head_dim), kv_row),
      pl.BlockSpec((None, seq, group, head_dim), group_rows),
      pl.BlockSpec((None, group, seq), group_stats),
      pl.BlockSpec((None, group, seq), group_stats),
  ]
  if has_seg:
    in_specs += [pl.BlockSpec((None, seq), lambda i, b, h: (b, 0)), pl.BlockSpec((None, bk), lambda i, b, h: (b, i))]
  dkv_args = args
  if doc_ranges:
    in_specs.append(pl.BlockSpec((None, None, 1), lambda i, b, h: (b, i, 0)))
    dkv_args = args + [_query_ends(segment_ids, keys=bk, rows=bq)]
  dk, dv = pl.pallas_call(
      functools.partial(_dkv_kernel, block_q=bq, block_k=bk, group=group, **common),
      grid=(kv_seq // bk, batch, num_kv_heads),
      in_specs=in_specs,
      out_specs=[pl.BlockSpec((None, bk, None, head_dim), kv_row), pl.BlockSpec((None, bk, None, head_dim), kv_row)],
      out_shape=[out_struct(k.shape, k.dtype, q), out_struct(v.shape, v.dtype, q)],
      compiler_params=params, interpret=interpret, name="clis_bwd_dkv",
  )(*dkv_args)
  return dq, dk, dv


def _query_ends(segment_ids, *, keys: int, rows: int):
  """masks.causal_document_ranges's end per block of `keys` keys, as one past its last query: [B, Sk / keys, 1]."""
  _, end = masks.causal_document_ranges(segment_ids, block_q=rows, block_k=keys)
  return (end * rows)[..., None]
