"""Temporal tile skipping with the video tokens split over a mesh axis, called inside `jax.shard_map`.

Each device holds a contiguous chunk of the query rows and of the keys (bidirectional attention needs no load
balancing), and its rows' part of every layer's SkipState: skip [B, H, nq / n, nk], its q tiles against every kv
tile of the sequence. One `all_gather` brings every key and value to every device, and the device runs
`diffusion.attention` on its rows against them: the same plan, tiles, certificate and marking rule as one device
running the whole sequence, so each row's output and marks are the single call's (the all-gather strategy of
context parallelism; no partials to combine). Memory per device: the full K and V of one layer.
"""

from __future__ import annotations

import jax

from clis_kernels.diffusion import skipping


def attention(q, k, v, state: skipping.SkipState, *, thr, axis_name: str, **kw):
  """q [B, S/n, H, D], k/v [B, S/n, Hkv, D]: this device's chunk of a sequence split over `axis_name` (n devices,
  natural order); state: this device's rows of the layer's SkipState (shard a global `init_state` along its
  q-tile axis, 2). kw: as `diffusion.attention` (scale, block_sizes, stabilizer_name, tau, implementation,
  interpret, platform). Returns (out [B, S/n, H, D], this device's new state, SkipStats with the sparsity
  averaged over the axis)."""
  chunk, tile = q.shape[1], skipping.tiles(kw["block_sizes"])[0] if kw.get("block_sizes") else None
  if tile is not None and chunk % tile:
    raise ValueError(f"each device's {chunk} tokens must be a whole number of the skip grid's {tile}-row q tiles; "
                     "pad the sequence or choose block sizes that divide it")
  gather = lambda x: jax.lax.all_gather(x, axis_name, axis=1, tiled=True)
  out, state, stats = skipping.attention(q, gather(k), gather(v), state, thr=thr, **kw)
  stats = skipping.SkipStats(sparsity=jax.lax.pmean(stats.sparsity, axis_name), new_marks=stats.new_marks,
                             max_skipped_weight=stats.max_skipped_weight)
  return out, state, stats
