"""CLiS attention forward as a Pallas Triton kernel (NVIDIA GPUs).

Grid (q_block, batch, q_head); each program owns one [block_q, D] query tile and walks
the KV sequence. The prologue certifies the tile from its own rows and the K/V pre-pass
(stabilizer.key_bounds → row_bounds → stabilize), so no pre-pass reads q. A certified tile
runs the fixed-stabilizer loop (no row max, no rescale, weights summed on the tensor cores);
otherwise the same program runs the online softmax. Under the causal mask the
loop is split into the blocks wholly below the diagonal (no mask) and the few that
straddle it. Causal q tiles are visited last-first so the longest ones start early.
Layout: q [B, S, Hq, D], k/v [B, S, Hkv, D] (the API's, no transposes); lse [B, Hq, S].
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from clis_kernels import masks
from clis_kernels.common import dot_precision, out_struct
from clis_kernels.plan import Mode, stabilizer_inputs
from clis_kernels.stabilizer import (LOG2E, NEG, Certificate, KeyBounds, empty_rows, row_bounds, saved_lse, soft_cap,
                                     stabilize)

SUM_COLUMNS = 16  # width of the ones matrix the fixed path sums its weights with (Triton's minimum dot N)


def _is_pow2(x: int) -> bool:
  return x >= 1 and not x & (x - 1)


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tiles and launch shape of the forward and backward kernels.

  The forward's certified loop steps by block_k_fixed, its online loop by block_k: without
  the rescale the fixed loop is cheaper per key and prefers a different tile (H200 sweep,
  notes/kernels.md).
  document_ranges: causal packed calls skip the block pairs where no documents meet (masks.segment_block_ranges):
  the forward's and dQ's loops start at their rows' documents' first key block, dK/dV's end at its keys'
  documents' last query block. On by default (bit-identical to the full loops); False visits every causal block.
  """

  block_q: int = 128
  block_k: int = 128
  block_k_fixed: int = 64
  num_warps: int = 8
  num_stages: int = 3
  block_q_dq: int = 64
  block_k_dq: int = 64
  block_q_dkv: int = 64
  block_k_dkv: int = 64
  num_warps_bwd: int = 4
  num_stages_bwd: int = 2
  document_ranges: bool = True

  def __post_init__(self):
    for field in dataclasses.fields(self):
      value = getattr(self, field.name)
      if field.name.startswith("block") and not (_is_pow2(value) and value >= 16):
        raise ValueError(f"{field.name}={value} must be a power of two >= 16 (Triton tiles)")
      if field.name.startswith("num_warps") and value not in (1, 2, 4, 8, 16):
        raise ValueError(f"{field.name}={value} must be one of 1, 2, 4, 8, 16")
      if field.name.startswith("num_stages") and value < 1:
        raise ValueError(f"{field.name}={value} must be >= 1")

  @property
  def tile(self) -> int:
    return self.block_q

  @property
  def multiple(self) -> int:
    return max(getattr(self, f.name) for f in dataclasses.fields(self) if f.name.startswith("block"))

  @property
  def skip_tiles(self) -> tuple[int, int]:
    """(rows, keys) of a temporal-skipping tile: the q tile and the certified loop's step."""
    return self.block_q, self.block_k_fixed


def padded_head_dim(head_dim: int) -> int:
  """The head dim the Triton kernels run at (a power of two >= 16, Triton's dot shapes): the API pads
  q, k, v with zero columns up to it, which changes no logit; the output's extra columns are cut off."""
  return max(16, 1 << (head_dim - 1).bit_length())


def _fit(block: int, *, seq_len: int) -> int:
  """A tile no longer than the sequence rounded up to a power of two (at least 16)."""
  return min(block, max(16, 1 << (max(seq_len, 1) - 1).bit_length()))


def default_block_sizes(head_dim: int, seq_len: int, dtype) -> BlockSizes:
  """Tiles per head dim and dtype (f32 tiles take twice the shared memory), shrunk for short sequences."""
  fit = functools.partial(_fit, seq_len=seq_len)
  bwd = lambda b, warps, stages: dict(block_q_dq=fit(b), block_k_dq=fit(b), block_q_dkv=fit(b), block_k_dkv=fit(b),
                                      num_warps_bwd=warps, num_stages_bwd=stages)
  if jnp.dtype(dtype).itemsize > 2:
    return BlockSizes(fit(64), fit(32), fit(32), 4, 2, **bwd(32, 4, 1))
  if head_dim <= 64:
    return BlockSizes(fit(128), fit(128), fit(64), 4, 3, **bwd(64, 4, 2))
  if head_dim <= 128:
    return BlockSizes(fit(128), fit(128), fit(64), 8, 3, **bwd(64, 4, 2))
  return BlockSizes(fit(64), fit(32), fit(32), 8, 2, **bwd(32, 4, 1))


def hopper_block_sizes(head_dim: int, seq_len: int, dtype, *, softcap: float | None = None) -> BlockSizes:
  """`default_block_sizes` for the Triton backward behind the Mosaic GPU forward (Hopper only): above head dim 128,
  64-row and 64-key backward tiles in 8 warps, one stage (H200, D 256, causal 8k GQA 16/8: forward+backward 1.24x
  the 32-row tiles, the same gradients; notes/experiments/triton_bwd_d256.py, BENCHMARKS.md §1). Other GPUs keep the
  smaller tiles (less shared memory). softcap: taken, as plan.make_plan passes it to every backward heuristic; no
  tile here depends on it."""
  del softcap
  tiles = default_block_sizes(head_dim, seq_len, dtype)
  if head_dim <= 128 or jnp.dtype(dtype).itemsize > 2:
    return tiles
  fit = functools.partial(_fit, seq_len=seq_len)
  return dataclasses.replace(tiles, block_q_dq=fit(64), block_k_dq=fit(64), block_q_dkv=fit(64), block_k_dkv=fit(64),
                             num_warps_bwd=8, num_stages_bwd=1)


def certify_tile(q, centre, radius, headroom, threshold, k_diag, row_real, *, sigma2: float, cap2=None):
  """(M [block_q], certified) of one q tile, from its rows and the K/V pre-pass (stabilizer.py).

  q [block_q, D]; centre [D] or [block_q, D]; radius, headroom, threshold (1,); k_diag [block_q, D]
  (each row's own key, causal or packed) or None; row_real [block_q] bool.
  """
  centre = centre.astype(jnp.float32)
  upper, lower = row_bounds(q.astype(jnp.float32), centre if centre.ndim == 2 else centre[None, :], radius,
                            None if k_diag is None else k_diag.astype(jnp.float32), sigma2=sigma2, cap2=cap2)
  m, row_ok = stabilize(upper, lower, headroom, threshold, row_real)
  return m, jnp.sum((~row_ok).astype(jnp.int32)) == 0


def fixed_update(acc, l, p, v, precision):
  """One certified kv step, no max and no rescale. The weights enter P·V rounded to v's dtype and
  l sums exactly those (stabilizer.py), on the tensor cores: p·ones keeps the sum off the vector
  units. l is [block_q, SUM_COLUMNS] (equal columns); `fixed_sum` reduces it."""
  p = p.astype(v.dtype)
  ones = jnp.ones((p.shape[1], SUM_COLUMNS), v.dtype)
  return acc + plgpu.dot(p, v, precision=precision), l + plgpu.dot(p, ones, precision=precision)


def fixed_sum(l):
  return l.sum(axis=1) * (1.0 / SUM_COLUMNS)  # the columns are equal: exact


def online_update(acc, m, l, s, v, precision):
  """One online-softmax kv step on base-2 logits s [block_q, block_k]: new max, rescale, accumulate."""
  m_new = jnp.maximum(m, s.max(axis=1))
  alpha = jnp.exp2(m - m_new)
  p = jnp.exp2(s - m_new[:, None])
  return acc * alpha[:, None] + plgpu.dot(p.astype(v.dtype), v, precision=precision), m_new, l * alpha + p.sum(axis=1)


def write_outputs(acc, m, l, certified, o_ref, lse_ref, tiles_ref, lse_sum=None):
  """Normalises and stores o, the base-2 lse (from lse_sum where given: a certified tile's unrounded weights,
  stabilizer.py "Normalisation") and the tile's certificate flag; rows that saw no key get o = 0 and EMPTY_LSE.
  Returns (empty rows, l with empty rows set to 1)."""
  empty = empty_rows(l, m)
  l_safe = jnp.where(empty, 1.0, l)
  o_ref[...] = jnp.where(empty[:, None], 0.0, acc / l_safe[:, None]).astype(o_ref.dtype)
  lse_ref[...] = saved_lse(m, l_safe, empty, lse_sum)
  tiles_ref[...] = jnp.broadcast_to(certified.astype(jnp.int32), (1,))
  return empty, l_safe


def _fwd_kernel(*refs, has_segments: bool, mode: str, causal: bool, sigma2: float, block_q: int, block_k: int,
                block_k_fixed: int, kv_len: int | None, seq_len: int, num_q_blocks: int, precision, window, cap2,
                doc_ranges: bool = False):
  q_ref, k_ref, v_ref = refs[:3]
  qseg_ref, kseg_ref = refs[3:5] if has_segments else (None, None)
  first_ref = refs[3 + 2 * has_segments] if doc_ranges else None  # the tile's documents' first key
  stab_refs, (o_ref, lse_ref, tiles_ref) = refs[3 + 2 * has_segments + doc_ranges:-3], refs[-3:]
  pid = pl.program_id(0)
  q_block = num_q_blocks - 1 - pid if causal else pid
  q = q_ref[...]
  q_pos = q_block * block_q + jnp.arange(block_q)
  q_seg = None if qseg_ref is None else qseg_ref[...]

  def scores(start_k, block, masked):
    k = k_ref[pl.ds(start_k * block, block), :]
    s = soft_cap(plgpu.dot(q, k, trans_b=True, precision=precision) * sigma2, cap2)
    if masked:
      k_pos = start_k * block + jnp.arange(block)
      k_seg = None if kseg_ref is None else kseg_ref[pl.ds(start_k * block, block)]
      mask = masks.visible(q_pos, k_pos, q_seg, k_seg, causal=causal, kv_len=kv_len, window=window)
      s = s if mask is None else jnp.where(mask, s, NEG)
    return s

  def fixed_body(start_k, carry, masked):
    acc, m, (l, l_lse) = carry
    p = jnp.exp2(scores(start_k, block_k_fixed, masked) - m[:, None])
    acc, l = fixed_update(acc, l, p, v_ref[pl.ds(start_k * block_k_fixed, block_k_fixed), :], precision)
    return acc, m, (l, l_lse + p.sum(axis=1))  # the unrounded weights' sum, for lse

  def online_body(start_k, carry, masked):
    acc, m, l = carry
    return online_update(acc, m, l, scores(start_k, block_k, masked), v_ref[pl.ds(start_k * block_k, block_k), :],
                         precision)

  def run(body, block, m0, l0):
    # Blocks [0, num_full) need no mask unless segments hide keys; [num_full, num_total) do.
    num_kv_blocks = k_ref.shape[0] // block
    carry = (jnp.zeros(o_ref.shape, jnp.float32), m0, l0)
    if window is not None:  # only the blocks of the window's band, every one masked
      first, end = masks.window_kv_blocks(q_block, window=window, block_q=block_q, block_k=block,
                                          num_kv_blocks=num_kv_blocks, div=masks.idiv)
      return lax.fori_loop(first, end, functools.partial(body, masked=True), carry)
    if causal:
      num_full, num_total = masks.causal_kv_blocks(q_block, block_q=block_q, block_k=block,
                                                    num_kv_blocks=num_kv_blocks, div=masks.idiv)
    else:
      num_full, num_total = masks.bidirectional_kv_blocks(kv_len=kv_len, block_k=block, num_kv_blocks=num_kv_blocks)
    first = 0 if first_ref is None else jnp.minimum(masks.idiv(jnp.max(first_ref[...]), block), num_full)
    carry = lax.fori_loop(first, num_full, functools.partial(body, masked=qseg_ref is not None), carry)
    return lax.fori_loop(num_full, num_total, functools.partial(body, masked=True), carry)

  def fixed(m0):
    acc, m, (l, l_lse) = run(fixed_body, block_k_fixed, m0, (jnp.zeros((block_q, SUM_COLUMNS), jnp.float32),
                                                               jnp.zeros((block_q,), jnp.float32)))
    return acc, m, fixed_sum(l), l_lse

  def online():
    acc, m, l = run(online_body, block_k, jnp.full((block_q,), NEG, jnp.float32), jnp.zeros((block_q,), jnp.float32))
    return acc, m, l, l

  if mode == "online":
    certified, l_lse = jnp.bool_(False), None  # lse from l itself
    acc, m, l, _ = online()
  else:
    if mode == "keys":  # certificate from this tile's rows, no pre-pass over q
      centre_ref, radius_ref, headroom_ref, threshold_ref = stab_refs
      own_key = causal or has_segments or window is not None
      k_diag = k_ref[pl.ds(q_block * block_q, block_q), :] if own_key else None
      row_real = q_pos < seq_len
      if q_seg is not None:
        row_real = row_real & (q_seg != 0)
      m0, certified = certify_tile(q, centre_ref[...], radius_ref[...], headroom_ref[...], threshold_ref[...],
                                   k_diag, row_real, sigma2=sigma2, cap2=cap2)
    else:  # "cert": m and the tile's certificate from the XLA pre-pass
      m_ref, cert_ref = stab_refs
      m0, certified = m_ref[...], jnp.sum(cert_ref[...]) > 0
    acc, m, l, l_lse = lax.cond(certified, lambda: fixed(m0), online)
  write_outputs(acc, m, l, certified, o_ref, lse_ref, tiles_ref, lse_sum=l_lse)


def first_keys(segment_ids, *, rows: int, keys: int):
  """masks.causal_document_ranges's first kv block per tile of `rows` queries, as its first key: [B, S / rows, 1]."""
  first, _ = masks.causal_document_ranges(segment_ids, block_q=rows, block_k=keys)
  return (first * keys)[..., None]


def forward(q, k, v, segment_ids, stab: KeyBounds | Certificate | None, *, mode: Mode, causal, scale, kv_len,
            block_sizes: BlockSizes, seq_len: int | None = None, window=None, softcap=None, interpret=False):
  """Returns (o [B, S, Hq, D], lse [B, Hq, S] f32 base 2, certified tiles [B, Hq, nq] bool or None).

  mode (plan.Mode) names the stabilizer: KEYS, stab the K/V pre-pass (the kernel certifies each tile
  from its own rows); CERTIFICATE or BLOCKS, stab an XLA pre-pass's Certificate; ONLINE, None (the
  online softmax). window: local (left, right) or None; softcap: c of c·tanh(s / c) or None.
  seq_len: the real query length (rows past it are block padding), needed with KEYS.
  """
  keys, cert = stabilizer_inputs(stab, mode)
  batch, seq, num_heads, head_dim = q.shape
  group = num_heads // k.shape[2]
  bq = block_sizes.block_q
  nq = seq // bq
  if head_dim != padded_head_dim(head_dim):
    raise ValueError(f"{head_dim=} must be a power of two >= 16 for pallas_gpu.forward; "
                     "clis_kernels.attention pads other head dims (padded_head_dim)")
  # Grid (q tile, batch, head); causal tiles run last-first so the longest start early.
  qmap = (lambda i, b, h: (b, nq - 1 - i, h, 0)) if causal else (lambda i, b, h: (b, i, h, 0))
  rowmap = (lambda i, b, h: (b, h, nq - 1 - i)) if causal else (lambda i, b, h: (b, h, i))
  kvmap = lambda i, b, h: (b, 0, h // group, 0)
  seg_q_map = (lambda i, b, h: (b, nq - 1 - i)) if causal else (lambda i, b, h: (b, i))
  kv_head_scalar = lambda i, b, h: (b, h // group, 0)

  kv_seq = k.shape[1]  # may differ from seq (cross-attention)
  in_specs = [
      pl.BlockSpec((None, bq, None, head_dim), qmap),
      pl.BlockSpec((None, kv_seq, None, head_dim), kvmap),
      pl.BlockSpec((None, kv_seq, None, head_dim), kvmap),
  ]
  args = [q, k, v]
  if segment_ids is not None:
    in_specs += [pl.BlockSpec((None, bq), seg_q_map), pl.BlockSpec((None, kv_seq), lambda i, b, h: (b, 0))]
    args += [segment_ids.q, segment_ids.kv]
  doc_ranges = block_sizes.document_ranges and causal and segment_ids is not None and window is None
  if doc_ranges:
    in_specs.append(pl.BlockSpec((None, None, 1), lambda i, b, h: (*seg_q_map(i, b, h), 0)))
    args.append(first_keys(segment_ids, rows=bq, keys=min(block_sizes.block_k, block_sizes.block_k_fixed)))
  if keys is not None:
    mode = "keys"
    if keys.centre.shape[1] == 1:  # one centre per (batch, kv head)
      in_specs.append(pl.BlockSpec((None, None, None, head_dim), lambda i, b, h: (b, 0, h // group, 0)))
    else:  # bidirectional packed: each query position's segment centre
      in_specs.append(pl.BlockSpec((None, bq, None, head_dim), lambda i, b, h: (*qmap(i, b, h)[:2], h // group, 0)))
    tile_of = (lambda i, b, h: (b, h // group, qmap(i, b, h)[1])) if keys.radius.shape[-1] > 1 else kv_head_scalar
    in_specs += [pl.BlockSpec((None, None, 1), tile_of)] + [pl.BlockSpec((None, None, 1), kv_head_scalar)] * 2
    args += [keys.centre, keys.radius, keys.headroom[..., None], keys.threshold[..., None]]
  elif cert is not None:
    mode = "cert"
    in_specs += [pl.BlockSpec((None, None, bq), rowmap), pl.BlockSpec((None, None, 1), rowmap)]
    args += [cert.m, cert.certified.astype(jnp.int32)]
  else:
    mode = "online"
  kernel = functools.partial(
      _fwd_kernel, has_segments=segment_ids is not None, mode=mode, causal=causal, sigma2=scale * LOG2E,
      block_q=bq, block_k=block_sizes.block_k, block_k_fixed=block_sizes.block_k_fixed, kv_len=kv_len,
      seq_len=seq if seq_len is None else seq_len, num_q_blocks=nq, precision=dot_precision(q.dtype), window=window,
      cap2=None if softcap is None else softcap * LOG2E, doc_ranges=doc_ranges)
  o, lse, tiles = pl.pallas_call(
      kernel,
      grid=(nq, batch, num_heads),
      in_specs=in_specs,
      out_specs=[pl.BlockSpec((None, bq, None, head_dim), qmap), pl.BlockSpec((None, None, bq), rowmap),
                 pl.BlockSpec((None, None, 1), rowmap)],
      out_shape=[out_struct(q.shape, q.dtype, q),
                 out_struct((batch, num_heads, seq), jnp.float32, q),
                 out_struct((batch, num_heads, nq), jnp.int32, q)],
      compiler_params=plgpu.CompilerParams(num_warps=block_sizes.num_warps, num_stages=block_sizes.num_stages),
      interpret=interpret,
      name="online_fwd" if mode == "online" else "clis_fwd",
  )(*args)
  return o, lse, (None if mode == "online" else tiles != 0)
