"""Which keys a query may see, and which blocks of the (q, k) grid need a mask at all.

Segment-id convention (MaxText's): ids are ints per position; a query sees a key only
when both have the same id, and id 0 marks padding, which sees nothing and is seen by
nothing (such rows return 0). Without segment ids every position is real. Positions at
or past `seq_len` are block padding added by the API and are never visible.
These functions are plain jnp so that every backend, Pallas kernels included, uses them.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SegmentIds:
  """Segment ids of the queries, q [B, Sq], and of the keys, kv [B, Sk] (int; 0 = padding).

  One [B, S] array passed to `attention` means the same ids for both; separate ids let queries
  and keys be padded differently (cross-attention, decode against a padded cache).
  """

  q: jax.Array
  kv: jax.Array


def segment_ids_of(segment_ids) -> SegmentIds | None:
  """SegmentIds from what callers pass: one [B, S] array (the same ids for queries and keys), a
  SegmentIds, or None."""
  if segment_ids is None or isinstance(segment_ids, SegmentIds):
    return segment_ids
  return SegmentIds(segment_ids, segment_ids)


def visible(q_pos, k_pos, q_seg, k_seg, *, causal: bool, kv_len: int | None, window=None):
  """[Bq, Bk] bool for query positions q_pos [Bq] and key positions k_pos [Bk].

  q_seg/k_seg: segment ids of those positions, or None. kv_len: keys at or past it are
  hidden (None when nothing needs hiding by position). window: (left, right), a query at i sees
  keys i − left ≤ j ≤ i + right only (local attention), or None.
  """
  by_position = causal or window is not None  # expand only what the rule reads: no dead ops in kernels
  q_pos = q_pos[:, None] if by_position else None
  k_pos = k_pos[None, :] if by_position or kv_len is not None else None
  q_seg, k_seg = (None, None) if q_seg is None else (q_seg[:, None], k_seg[None, :])
  return visible_pairs(q_pos, k_pos, q_seg, k_seg, causal=causal, kv_len=kv_len, window=window)


def visible_pairs(q_pos, k_pos, q_seg, k_seg, *, causal: bool, kv_len: int | None, window=None):
  """The same rule elementwise, on arrays that broadcast against each other (any shape): whether
  the key at k_pos (id k_seg) is visible to the query at q_pos (id q_seg); None when nothing hides."""
  mask = None

  def both(a, b):
    return b if a is None else jnp.logical_and(a, b)

  if causal:
    mask = both(mask, q_pos >= k_pos)
  if q_seg is not None:
    mask = both(mask, jnp.logical_and(q_seg == k_seg, k_seg != 0))
  if kv_len is not None:
    mask = both(mask, k_pos < kv_len)
  if window is not None:
    left, right = window
    offset = k_pos - q_pos
    mask = both(mask, jnp.logical_and(offset >= -left, offset <= right))
  return mask


def as_window(local_window_size, *, causal: bool):
  """(left, right) from jax.nn's `local_window_size` (an int w means (w, w); causal caps right at 0),
  or None."""
  if local_window_size is None:
    return None
  left, right = (local_window_size, local_window_size) if isinstance(local_window_size, int) else local_window_size
  return (int(left), 0 if causal else int(right))


def window_kv_blocks(q_block, *, window, block_q: int, block_k: int, num_kv_blocks: int, div):
  """(first, end): the kv blocks [first, end) that hold keys some row of q block `q_block` sees
  under the local window (left, right); all of them take the mask."""
  left, right = window
  first = jnp.maximum(div(q_block * block_q - left, block_k), 0)
  end = jnp.minimum(div((q_block + 1) * block_q - 1 + right, block_k) + 1, num_kv_blocks)
  return first, end


def window_full_blocks(row0, *, rows: int, window, block: int, kv_len: int | None, div):
  """(lo, hi): the column blocks [lo, hi) of `block` keys that every row in [row0, row0 + rows) sees whole under
  the local window (left, right) (and kv_len); the band's other blocks take the mask. hi may be below lo when
  the window is narrower than the rows (no block is whole). Rows that are keys (a dK/dV kernel, columns = query
  blocks) pass the window mirrored, (right, left)."""
  left, right = window
  lo = div(jnp.maximum(row0 + rows - 1 - left, 0) + block - 1, block)
  hi = div(row0 + right + 1, block)
  if kv_len is not None:
    hi = jnp.minimum(hi, kv_len // block)
  return lo, hi


def masked_edges(first, end, whole):
  """(lead, full): steps [first, lead) and [full, end) take the mask, [lead, full) are whole (whole = (lo, hi) of
  window_full_blocks, clamped into the band)."""
  lead = jnp.minimum(jnp.maximum(whole[0], first), end)
  return lead, jnp.minimum(jnp.maximum(whole[1], lead), end)


def window_q_blocks(kv_block, *, window, block_q: int, block_k: int, num_q_blocks: int, div):
  """(first, end): the q blocks [first, end) with rows that see some key of kv block `kv_block`."""
  left, right = window
  first = jnp.maximum(div(kv_block * block_k - right, block_q), 0)
  end = jnp.minimum(div((kv_block + 1) * block_k - 1 + left, block_q) + 1, num_q_blocks)
  return first, end


def _is_real(ids, num: int, seq_len: int) -> jax.Array:
  real = (jnp.arange(num) < seq_len)[None, :]
  return real if ids is None else jnp.logical_and(real, ids != 0)


def key_is_real(segment_ids: SegmentIds | None, num_keys: int, seq_len: int) -> jax.Array:
  """[B, Sk] (or [1, Sk]) bool: the key is neither block padding nor segment padding."""
  return _is_real(None if segment_ids is None else segment_ids.kv, num_keys, seq_len)


def query_is_real(segment_ids: SegmentIds | None, num_queries: int, seq_len: int) -> jax.Array:
  """[B, Sq] (or [1, Sq]) bool: the query is neither block padding nor segment padding."""
  return _is_real(None if segment_ids is None else segment_ids.q, num_queries, seq_len)


def idiv(a, b):
  """Integer division for block arithmetic inside kernels (lax.div, truncating), both sides int32, so
  Python ints do not become int64 when jax_enable_x64 is on."""
  return jax.lax.div(jnp.asarray(a, jnp.int32), jnp.asarray(b, jnp.int32))


def causal_kv_blocks(q_block, *, block_q: int, block_k: int, num_kv_blocks: int, div):
  """KV-block ranges for one q block under the causal mask.

  Returns (num_full, num_total): blocks [0, num_full) lie wholly below the diagonal and
  need no causal mask; [num_full, num_total) straddle it. `div` is the integer division
  of the caller (lax.div inside kernels).
  """
  num_full = div(q_block * block_q, block_k)
  num_total = jnp.minimum(div((q_block + 1) * block_q + block_k - 1, block_k), num_kv_blocks)
  return num_full, num_total


def bidirectional_kv_blocks(*, kv_len: int | None, block_k: int, num_kv_blocks: int):
  """(num_full, num_total) without a causal mask: blocks past kv_len (block padding) are
  skipped, and the one that straddles it is masked."""
  if kv_len is None:
    return num_kv_blocks, num_kv_blocks
  return kv_len // block_k, -(-kv_len // block_k)


def causal_q_blocks(kv_block, *, block_q: int, block_k: int, num_q_blocks: int, div):
  """Q-block ranges for one kv block under the causal mask (the dK/dV loop).

  Returns (first, first_full): q blocks [first, first_full) straddle the diagonal,
  [first_full, num_q_blocks) see the whole kv block.
  """
  first = div(kv_block * block_k, block_q)
  first_full = jnp.minimum(div((kv_block + 1) * block_k - 1 + block_q - 1, block_q), num_q_blocks)
  return first, first_full


def _id_intervals(ids, block: int):
  """[B, S] ids -> ([B, S/block], [B, S/block]) min and max of each block's non-padding ids (an empty block:
  int32 max and min, an interval nothing overlaps)."""
  ids = ids.astype(jnp.int32).reshape(ids.shape[0], -1, block)
  big, small = jnp.iinfo(jnp.int32).max, jnp.iinfo(jnp.int32).min
  return jnp.where(ids != 0, ids, big).min(-1), jnp.where(ids != 0, ids, small).max(-1)


def segment_block_ranges(row_ids, col_ids, *, row_block: int, col_block: int):
  """(first, last) [B, S_rows/row_block] int32: for each block of rows, the first and the last block of columns
  holding an id equal to one of the rows' (padding id 0 matches nothing). Blocks outside [first, last] see
  nothing: their id intervals do not overlap, so no id is shared (sound for any ids; for packed documents,
  contiguous runs of increasing ids, it is exactly the blocks that see something). No overlap anywhere:
  first = number of column blocks, last = −1. Kernels clamp the ranges to their causal ones.
  Costs [B, rows/row_block, cols/col_block] compares, not [B, S, S]."""
  row_lo, row_hi = _id_intervals(row_ids, row_block)
  col_lo, col_hi = _id_intervals(col_ids, col_block)
  overlap = (row_lo[:, :, None] <= col_hi[:, None, :]) & (col_lo[:, None, :] <= row_hi[:, :, None])
  num_cols = overlap.shape[-1]
  cols = jnp.arange(num_cols, dtype=jnp.int32)
  first = jnp.where(overlap, cols, num_cols).min(-1)
  last = jnp.where(overlap, cols, -1).max(-1)
  return first.astype(jnp.int32), last.astype(jnp.int32)


def causal_document_ranges(segment_ids: SegmentIds, *, block_q: int, block_k: int):
  """What the kernels' document ranges loop over under the causal mask: (first [B, Sq/block_q], end
  [B, Sk/block_k]) int32 — per q block the first kv block with a key of its rows' documents, at most the q
  block's first causally masked one; per kv block one past the last q block with a query of its keys'
  documents, at least one past the q block holding its last key (and at most the q blocks' count). The clamps
  keep every kernel's causal loop bounds ordered; they only ever add blocks, which the mask then hides."""
  first, _ = segment_block_ranges(segment_ids.q, segment_ids.kv, row_block=block_q, col_block=block_k)
  first = jnp.minimum(first, jnp.arange(first.shape[1], dtype=jnp.int32) * block_q // block_k)
  _, last = segment_block_ranges(segment_ids.kv, segment_ids.q, row_block=block_k, col_block=block_q)
  diagonal_end = ((jnp.arange(last.shape[1], dtype=jnp.int32) + 1) * block_k - 1) // block_q + 1
  end = jnp.minimum(jnp.maximum(last + 1, diagonal_end), segment_ids.q.shape[1] // block_q)
  return first, end
