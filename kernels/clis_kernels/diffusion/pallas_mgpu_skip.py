"""Temporal tile skipping on Hopper: the Mosaic GPU forward (pallas_mgpu.forward_listed) walking kept-tile lists.

A skip tile is one CTA's rows (2 x block_q = 128) by one KV block (block_kv): the CTA's memory warpgroup
loads only the listed blocks and both compute warpgroups walk the same list, in the certified loop or the
online one. With `track`, the kernel writes each visited block's row maxima max_{j∈u} t_ij; this module
turns them and the kernel's lse into the marking statistic of skipping.py, exactly:
    gap[u] = max over the tile's real rows of (max_{j∈u} t_ij − lse_i),   log2_l = 0,
so gap − log2_l = max_{i, j∈u} (t_ij − lse_i), the quantity the other backends bound from above.
"""

from __future__ import annotations

import jax.numpy as jnp

from clis_kernels import pallas_mgpu
from clis_kernels.diffusion.tile_lists import kept_tiles
from clis_kernels.plan import Mode, stabilizer_inputs
from clis_kernels.stabilizer import NEG


def forward(q, k, v, skip, stab, *, mode: Mode, scale: float, kv_len: int | None, seq_len: int,
            block_sizes: pallas_mgpu.BlockSizes, track: bool, interpret: bool = False):
  """The skip-forward contract of kernels/clis_kernels/diffusion (see pallas_gpu_skip.forward): q, k, v padded to whole
  tiles; skip [B, H, nq, nk] bool with nq = S / (2·block_q), nk = Sk / block_kv; stab KeyBounds (Mode.KEYS:
  each warpgroup certifies its rows in the prologue) or None (Mode.ONLINE).
  Returns (o, gap [B, H, nq, nk] (NEG where skipped or not tracked), log2_l [B, H, nq] (zeros))."""
  if mode not in (Mode.KEYS, Mode.ONLINE):
    raise ValueError(f"the Mosaic GPU skip kernel certifies each tile itself: {mode=} must be Mode.KEYS or "
                     "Mode.ONLINE")
  if interpret:
    raise ValueError("implementation='pallas_mgpu' has no interpret mode; use implementation='pallas_gpu' with "
                     "interpret=True to run a skip kernel on a CPU")
  keys, _ = stabilizer_inputs(stab, mode)
  batch, heads, nq, nk = skip.shape
  visit, count = kept_tiles(skip, width=max(16, 1 << nk.bit_length()))  # a free last entry for the count
  visit = visit.at[..., -1].set(count)
  o, lse, _, rowmax = pallas_mgpu.forward_listed(q, k, v, visit, keys, mode=mode, scale=scale, kv_len=kv_len,
                                                 block_sizes=block_sizes, track=track)
  log2_l = jnp.zeros((batch, heads, nq), jnp.float32)
  if not track:
    return o, jnp.full(skip.shape, NEG, jnp.float32), log2_l
  rows = block_sizes.skip_tiles[0]
  real = (jnp.arange(q.shape[1]) < seq_len)[None, None, None, :]
  excess = jnp.where(real, rowmax - lse[:, :, None, :], NEG)  # [B, H, nk, S]; unvisited blocks: garbage
  gap = excess.reshape(batch, heads, nk, nq, rows).max(axis=-1).transpose(0, 1, 3, 2)
  return o, jnp.where(skip, NEG, gap), log2_l
