"""Bidirectional CLiS forward (Triton) that visits only the kv tiles of a per-tile list.

Grid (q_block, batch, head), as kernels/clis_kernels/pallas_gpu.py. Each program reads its row of
`visit` [B, H, nq, nk_pad] (kv tile indices to visit, kept tiles first, in order) and
`count` [B, H, nq], and loops over the first `count` entries: a skipped tile is never
loaded, so the time saved tracks the fraction skipped. The certificate is computed in the
prologue from KeyBounds (stabilizer.row_bounds), as in the main kernel.

With `track`, each visited tile also yields the marking statistic of skipping.py:
  gap[u]  = max over real rows of (max_{j∈u} t_ij − m_i)   (m: fixed M, or the running max
            after the tile on the online path; never above the final stabilizer)
  log2_l  = min over real rows of log2 l_i                 (l in the final stabilizer's units)
so that max_{j∈u} t_ij − lse_i ≤ gap[u] − log2_l for every real row. Only tracking calls
pay for the row max; other calls run the plain certified loop.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from clis_kernels import masks
from clis_kernels.diffusion.tile_lists import kept_tiles
from clis_kernels.plan import Mode, stabilizer_inputs
from clis_kernels.common import dot_precision
from clis_kernels.pallas_gpu import (SUM_COLUMNS, BlockSizes, certify_tile, fixed_sum, fixed_update, online_update,
                                      write_outputs)
from clis_kernels.stabilizer import LOG2E, NEG, KeyBounds


def _kernel(q_ref, k_ref, v_ref, visit_ref, count_ref, *refs, certify: bool, track: bool, sigma2: float,
            block_q: int, block_k: int, kv_len: int | None, seq_len: int, precision):
  if certify:
    centre_ref, radius_ref, headroom_ref, threshold_ref = refs[:4]
    refs = refs[4:]
  o_ref, lse_ref, tiles_ref, gap_ref, log2_l_ref = refs
  q_block = pl.program_id(0)
  q = q_ref[...]
  q_pos = q_block * block_q + jnp.arange(block_q)
  row_real = q_pos < seq_len
  count = jnp.sum(count_ref[...])
  num_slots = visit_ref.shape[0]

  def body(slot, carry, fixed):
    acc, m, l, gap = carry
    u = jnp.sum(visit_ref[pl.ds(slot, 1)])  # the kv tile this step visits
    k = k_ref[pl.ds(u * block_k, block_k), :]
    v = v_ref[pl.ds(u * block_k, block_k), :]
    s = plgpu.dot(q, k, trans_b=True, precision=precision) * sigma2
    mask = masks.visible(q_pos, u * block_k + jnp.arange(block_k), None, None, causal=False, kv_len=kv_len)
    if mask is not None:
      s = jnp.where(mask, s, NEG)
    if fixed:
      acc, l = fixed_update(acc, l, jnp.exp2(s - m[:, None]), v, precision)
    else:
      acc, m, l = online_update(acc, m, l, s, v, precision)
    if track:
      tile_gap = jnp.max(jnp.where(row_real, s.max(axis=1) - m, NEG))
      gap = jnp.where(jnp.arange(num_slots) == u, tile_gap, gap)
    return acc, m, l, gap

  def run(fixed, m0):
    l0 = jnp.zeros((block_q, SUM_COLUMNS) if fixed else (block_q,), jnp.float32)
    carry = (jnp.zeros(o_ref.shape, jnp.float32), m0, l0, jnp.full((num_slots,), NEG, jnp.float32))
    acc, m, l, gap = lax.fori_loop(0, count, functools.partial(body, fixed=fixed), carry)
    return acc, m, (fixed_sum(l) if fixed else l), gap

  online = lambda: run(False, jnp.full((block_q,), NEG, jnp.float32))
  if certify:
    m0, certified = certify_tile(q, centre_ref[...], radius_ref[...], headroom_ref[...], threshold_ref[...], None,
                                 row_real, sigma2=sigma2)
    acc, m, l, gap = lax.cond(certified, lambda: run(True, m0), online)
  else:
    certified = jnp.bool_(False)
    acc, m, l, gap = online()

  empty, l_safe = write_outputs(acc, m, l, certified, o_ref, lse_ref, tiles_ref)
  gap_ref[...] = gap
  log2_l_ref[...] = jnp.broadcast_to(jnp.min(jnp.where(row_real & ~empty, jnp.log2(l_safe), jnp.inf)), (1,))


def forward(q, k, v, skip, stab, *, mode: Mode, scale: float, kv_len: int | None, seq_len: int,
            block_sizes: BlockSizes, track: bool, interpret: bool = False):
  """The skip-forward contract of kernels/clis_kernels/diffusion (skipping.py calls every backend's so): q, k, v padded
  to whole tiles ([B, S, H, D], [B, Sk, Hkv, D]); skip [B, H, nq, nk] bool (SkipState.skip); stab as
  plan.stabilizer_inputs takes it for `mode`
  (KeyBounds or None: this kernel certifies in its prologue). Returns (o, gap [B, H, nq, nk], log2_l [B, H, nq])."""
  if mode not in (Mode.KEYS, Mode.ONLINE):
    raise ValueError(f"the Triton skip kernel certifies each tile itself: {mode=} must be Mode.KEYS or Mode.ONLINE")
  keys, _ = stabilizer_inputs(stab, mode)
  nk = skip.shape[-1]
  visit, count = kept_tiles(skip, width=max(16, 1 << (nk - 1).bit_length()))
  o, _, _, gap, log2_l = forward_listed(q, k, v, visit, count, keys, scale=scale, kv_len=kv_len, seq_len=seq_len,
                                        block_sizes=block_sizes, track=track, interpret=interpret)
  return o, gap[..., :nk], log2_l


def forward_listed(q, k, v, visit, count, keys: KeyBounds | None, *, scale: float, kv_len: int | None, seq_len: int,
                   block_sizes: BlockSizes, track: bool, interpret: bool = False):
  """Bidirectional attention over listed kv tiles (tile = block_q × block_k_fixed).

  q [B, S, H, D], k/v [B, Sk, Hkv, D] (padded to whole tiles); visit [B, H, nq, nk_pad] int32
  with nk_pad a power of two ≥ nk; count [B, H, nq] int32. keys: the CLiS pre-pass, or None
  for the online softmax. Returns (o, lse [B, H, S], certified [B, H, nq] bool,
  gap [B, H, nq, nk_pad] f32 (NEG where not visited or not tracked), log2_l [B, H, nq] f32).
  """
  batch, seq, heads, head_dim = q.shape
  group = heads // k.shape[2]
  bq, bk = block_sizes.block_q, block_sizes.block_k_fixed
  nq, nk_pad = seq // bq, visit.shape[-1]
  qmap = lambda i, b, h: (b, i, h, 0)
  tile = lambda i, b, h: (b, h, i)
  kv_head = lambda i, b, h: (b, h // group, 0)
  in_specs = [pl.BlockSpec((None, bq, None, head_dim), qmap),
              pl.BlockSpec((None, k.shape[1], None, head_dim), lambda i, b, h: (b, 0, h // group, 0)),
              pl.BlockSpec((None, k.shape[1], None, head_dim), lambda i, b, h: (b, 0, h // group, 0)),
              pl.BlockSpec((None, None, None, nk_pad), lambda i, b, h: (b, h, i, 0)),
              pl.BlockSpec((None, None, 1), tile)]
  args = [q, k, v, visit, count]
  if keys is not None:
    if keys.centre.shape[1] != 1 or keys.radius.shape[-1] != 1:
      raise ValueError("the skip kernel takes the bidirectional, unpacked KeyBounds (one centre and radius per head)")
    in_specs += [pl.BlockSpec((None, None, None, head_dim), lambda i, b, h: (b, 0, h // group, 0))]
    in_specs += [pl.BlockSpec((None, None, 1), kv_head)] * 3
    args += [keys.centre, keys.radius, keys.headroom[..., None], keys.threshold[..., None]]
  kernel = functools.partial(_kernel, certify=keys is not None, track=track, sigma2=scale * LOG2E, block_q=bq,
                             block_k=bk, kv_len=kv_len, seq_len=seq_len, precision=dot_precision(q.dtype))
  o, lse, tiles, gap, log2_l = pl.pallas_call(
      kernel,
      grid=(nq, batch, heads),
      in_specs=in_specs,
      out_specs=[pl.BlockSpec((None, bq, None, head_dim), qmap), pl.BlockSpec((None, None, bq), tile),
                 pl.BlockSpec((None, None, 1), tile), pl.BlockSpec((None, None, None, nk_pad), lambda i, b, h: (b, h, i, 0)),
                 pl.BlockSpec((None, None, 1), tile)],
      out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((batch, heads, seq), jnp.float32),
                 jax.ShapeDtypeStruct((batch, heads, nq), jnp.int32),
                 jax.ShapeDtypeStruct((batch, heads, nq, nk_pad), jnp.float32),
                 jax.ShapeDtypeStruct((batch, heads, nq), jnp.float32)],
      compiler_params=plgpu.CompilerParams(num_warps=block_sizes.num_warps, num_stages=block_sizes.num_stages),
      interpret=interpret,
      name="clis_skip_fwd" if keys is not None else "online_skip_fwd",
  )(*args)
  return o, lse, tiles != 0, gap, log2_l
