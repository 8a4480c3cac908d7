"""The block bound's per-row (U, L) as a Pallas Triton kernel (NVIDIA GPUs): `stabilizer.block_row_bounds`
without its [rows, num_blocks] intermediate in memory.

Grid (q tile, batch, q heads of one kv head); each program owns a [block_q, D] query tile per head and
  * walks the key-block centres it may see in chunks of `centres`: U = max σ₂(q·ĉ_u + ‖q‖ r̂_u) (one
    small matmul per chunk on the tensor cores, so its cost is ~block/16 of the attention's QKᵀ);
  * scores the exceptional keys exactly (one [block_q, E] matmul): into U and L where visible;
  * scores its own diagonal tile of keys exactly for L (and the mean key, bidirectional).
The centres enter the matmul rounded to q's dtype (ĉ); the radii it gets are widened by
‖c − ĉ‖ (triangle inequality) and by 2^-16‖ĉ‖ (f32 accumulation over D ≤ 256 products), so U stays an
upper bound of the exact logits. The same statement of the bound as stabilizer.py; `supports` names the
calls it takes (local windows, bidirectional packed rows and separate q/kv ids stay in XLA).
Layout: q/k [B, S, H, D]; centres [B, nb, Hkv, D]; radii [B, Hkv, nb]; out U, L [B, Hq, S] base 2.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from clis_kernels import masks
from clis_kernels.common import dot_precision, out_struct
from clis_kernels.stabilizer import LOG2E, NEG, BlockBounds, rounded_centres


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """rows: query rows per program, also the own tile of keys scored for L; heads: q heads of one kv
  head per program (each chunk of centres is loaded once for all of them; the gcd with the group is
  taken); centres: key-block centres per matmul of the upper bound's loop; num_warps, num_stages:
  Triton's launch."""

  rows: int = 64
  heads: int = 4
  centres: int = 64
  num_warps: int = 4
  num_stages: int = 2

  def __post_init__(self):
    for name in ("rows", "centres"):
      value = getattr(self, name)
      if value < 16 or value & (value - 1):
        raise ValueError(f"{name}={value} must be a power of two >= 16 (Triton's dots)")
    if self.heads < 1:
      raise ValueError(f"heads={self.heads} must be >= 1")
    if self.num_warps not in (1, 2, 4, 8, 16):
      raise ValueError(f"num_warps={self.num_warps} must be one of 1, 2, 4, 8, 16")


def supports(*, causal: bool, packed: bool, window, separate_ids: bool, same_length: bool, multiple: int,
             head_dim: int) -> bool:
  """Whether the kernel takes this call: causal (packed or not) or bidirectional unpacked, equal q/k
  lengths (the own tile), no local window, lengths padded to a multiple of the default rows, and a power-of-two
  head dim (Triton's blocks; MLA's 192 takes the XLA statement)."""
  return window is None and not separate_ids and same_length and multiple % BlockSizes().rows == 0 and (
      causal or not packed) and takes_head_dim(head_dim)


def takes_head_dim(head_dim: int) -> bool:
  """Powers of two only (Triton's blocks): MLA's 192 takes the XLA statement."""
  return head_dim & (head_dim - 1) == 0


def _kernel(*refs, causal: bool, has_segments: bool, sigma2: float, block_q: int, heads: int, centres: int,
            block: int, kv_len: int, num_blocks: int, num_q_blocks: int, precision):
  q_ref, k_ref, centres_ref, radii_ref, ke_ref, epos_ref, eok_ref = refs[:7]
  rest = refs[7:]
  if has_segments:
    qseg_ref, kseg_ref, eseg_ref, *rest = rest
  mean_ref = None if causal else rest[0]
  upper_ref, lower_ref = rest[-2:]
  q_block = num_q_blocks - 1 - pl.program_id(0) if causal else pl.program_id(0)
  qs = [q_ref[:, h, :] for h in range(heads)]  # the tile of each q head sharing this kv head, [block_q, D]
  norms = [jnp.sqrt((q.astype(jnp.float32) ** 2).sum(axis=1)) for q in qs]
  rows = q_block * block_q + jnp.arange(block_q)
  q_seg = qseg_ref[...] if has_segments else None

  def centres_step(c, uppers):  # one chunk of centres, loaded once for every head
    u = c * centres + jnp.arange(centres)
    chunk, radii = centres_ref[pl.ds(c * centres, centres), :], radii_ref[pl.ds(c * centres, centres)]
    sees = u[None, :] < num_blocks
    if causal:
      sees = sees & (u[None, :] * block <= rows[:, None])
    return tuple(jnp.maximum(upper, jnp.where(sees, plgpu.dot(q, chunk, trans_b=True, precision=precision)
                                              + norm[:, None] * radii[None, :], NEG).max(axis=1))
                 for q, norm, upper in zip(qs, norms, uppers))

  last_row = (q_block + 1) * block_q - 1
  num_chunks = (last_row // block) // centres + 1 if causal else pl.cdiv(num_blocks, centres)
  uppers = lax.fori_loop(0, num_chunks, centres_step, (jnp.full((block_q,), NEG, jnp.float32),) * heads)

  k_e, ok_e = ke_ref[...], eok_ref[...][None, :] != 0
  seen = masks.visible(rows, epos_ref[...], q_seg, eseg_ref[...] if has_segments else None, causal=causal, kv_len=None)
  seen = ok_e if seen is None else seen & ok_e
  own_keys = pl.ds(q_block * block_q, block_q)
  k_own = k_ref[own_keys, :]
  ok = masks.visible(rows, q_block * block_q + jnp.arange(block_q), q_seg, kseg_ref[own_keys] if has_segments else None,
                     causal=causal, kv_len=None if causal else kv_len)
  for h, (q, upper) in enumerate(zip(qs, uppers)):
    exact = jnp.where(seen, plgpu.dot(q, k_e, trans_b=True, precision=precision), NEG).max(axis=1)
    s_own = plgpu.dot(q, k_own, trans_b=True, precision=precision)
    lower = (s_own if ok is None else jnp.where(ok, s_own, NEG)).max(axis=1)
    if mean_ref is not None:
      lower = jnp.maximum(lower, (q.astype(jnp.float32) * mean_ref[...][None, :]).sum(axis=1))
    upper_ref[h, :] = jnp.maximum(upper, exact) * sigma2
    lower_ref[h, :] = jnp.maximum(lower, exact) * sigma2


def row_bounds(q, k, segment_ids, bounds: BlockBounds, *, causal: bool, scale: float, block: int, kv_len: int,
               block_sizes: BlockSizes = BlockSizes(), interpret: bool = False):
  """Base-2 (U, L) [B, Hq, Sq] f32, as stabilizer.block_row_bounds (own_block = block_sizes.rows) computes them.

  q [B, S, Hq, D], k [B, S, Hkv, D] (S a multiple of the rows and of `block`); segment_ids: SegmentIds
  with q ids equal to kv ids, or None; kv_len: the real key count (bidirectional rows see no key past it).
  """
  block_q, chunk = block_sizes.rows, block_sizes.centres
  if q.shape[1] % block_q:
    raise ValueError(f"{block_sizes.rows=} must divide the padded sequence length {q.shape[1]}")
  q, k = lax.stop_gradient((q, k))
  batch, seq, num_heads, head_dim = q.shape
  hkv = k.shape[2]
  group = num_heads // hkv
  nq, nb = seq // block_q, bounds.centres.shape[1]
  padded_nb = pl.cdiv(nb, chunk) * chunk
  rounded, radii = rounded_centres(bounds.centres, bounds.radii, q.dtype)
  centres = jnp.pad(rounded, ((0, 0), (0, padded_nb - nb), (0, 0), (0, 0)))
  radii = jnp.pad(radii, ((0, 0), (0, 0), (0, padded_nb - nb)))
  positions = bounds.exceptional  # [B, Hkv, E]
  k_e = jnp.take_along_axis(k, positions.transpose(0, 2, 1)[..., None], axis=1)  # [B, E, Hkv, D]
  num_e = max(16, 1 << (positions.shape[-1] - 1).bit_length())  # Triton dots: a power of two >= 16
  pad_e = num_e - positions.shape[-1]
  k_e = jnp.pad(k_e, ((0, 0), (0, pad_e), (0, 0), (0, 0)))
  positions = jnp.pad(positions, ((0, 0), (0, 0), (0, pad_e)))
  ok_e = jnp.pad(bounds.is_exceptional, ((0, 0), (0, 0), (0, pad_e))).astype(jnp.int32)

  # Grid (q tile, batch, group of `heads` q heads of one kv head); causal tiles run last-first so the
  # longest start early. Each program loads a chunk of centres once for all its heads.
  heads = math.gcd(group, block_sizes.heads)
  qmap = (lambda i, b, h: (b, nq - 1 - i, h, 0)) if causal else (lambda i, b, h: (b, i, h, 0))
  rowmap = (lambda i, b, h: (b, h, nq - 1 - i)) if causal else (lambda i, b, h: (b, h, i))
  kv_head = lambda i, b, h: (b, 0, h * heads // group, 0)
  per_kv_head = lambda i, b, h: (b, h * heads // group, 0)
  in_specs = [pl.BlockSpec((None, block_q, heads, head_dim), qmap),
              pl.BlockSpec((None, seq, None, head_dim), kv_head),
              pl.BlockSpec((None, padded_nb, None, head_dim), kv_head),
              pl.BlockSpec((None, None, padded_nb), per_kv_head),
              pl.BlockSpec((None, num_e, None, head_dim), kv_head),
              pl.BlockSpec((None, None, num_e), per_kv_head),
              pl.BlockSpec((None, None, num_e), per_kv_head)]
  args = [q, k, centres, radii, k_e, positions, ok_e]
  if segment_ids is not None:
    seg_e = jnp.take_along_axis(segment_ids.kv[:, None, :], bounds.exceptional, axis=2)
    in_specs += [pl.BlockSpec((None, block_q), lambda i, b, h: qmap(i, b, h)[:2]),
                 pl.BlockSpec((None, seq), lambda i, b, h: (b, 0)),
                 pl.BlockSpec((None, None, num_e), per_kv_head)]
    args += [segment_ids.q, segment_ids.kv, jnp.pad(seg_e, ((0, 0), (0, 0), (0, pad_e)))]
  if not causal:  # the mean of the real keys: max >= mean
    real = (jnp.arange(seq) < kv_len)[None, :, None, None]
    mean = jnp.where(real, k.astype(jnp.float32), 0.0).sum(1) / max(kv_len, 1)  # [B, Hkv, D]
    in_specs.append(pl.BlockSpec((None, None, head_dim), per_kv_head))
    args.append(mean)
  kernel = functools.partial(_kernel, causal=causal, has_segments=segment_ids is not None, sigma2=scale * LOG2E,
                             block_q=block_q, heads=heads, centres=chunk, block=block, kv_len=kv_len, num_blocks=nb, num_q_blocks=nq,
                             precision=dot_precision(q.dtype))
  row_struct = out_struct((batch, num_heads, seq), jnp.float32, q)
  return pl.pallas_call(
      kernel,
      grid=(nq, batch, num_heads // heads),
      in_specs=in_specs,
      out_specs=[pl.BlockSpec((None, heads, block_q), rowmap)] * 2,
      out_shape=[row_struct, row_struct],
      compiler_params=plgpu.CompilerParams(num_warps=block_sizes.num_warps, num_stages=block_sizes.num_stages),
      interpret=interpret,
      name="clis_block_bounds",
  )(*args)
