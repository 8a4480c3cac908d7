"""Which keys a query may see, and which blocks of the (q, k) grid need a mask at all.

Segment-id convention (MaxText's): ids are ints per position; a query sees a key only
when both have the same id, and id 0 marks padding, which sees nothing and is seen by
nothing (such rows return 0). Without segment ids every position is real. Positions at
or past `seq_len` are block padding added by the API and are never visible.
These functions are plain jnp so that every backend, Pallas kernels included, uses them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def visible(q_pos, k_pos, q_seg, k_seg, *, causal: bool, kv_len: int | None):
  """[Bq, Bk] bool for query positions q_pos [Bq] and key positions k_pos [Bk].

  q_seg/k_seg: segment ids of those positions, or None. kv_len: keys at or past it are
  hidden (None when nothing needs hiding by position).
  """
  mask = None

  def both(a, b):
    return b if a is None else jnp.logical_and(a, b)

  if causal:
    mask = both(mask, q_pos[:, None] >= k_pos[None, :])
  if q_seg is not None:
    mask = both(mask, jnp.logical_and(q_seg[:, None] == k_seg[None, :], k_seg[None, :] != 0))
  if kv_len is not None:
    mask = both(mask, k_pos[None, :] < kv_len)
  return mask


def key_is_real(segment_ids, num_keys: int, seq_len: int) -> jax.Array:
  """[B, Sk] (or [1, Sk]) bool: the key is neither block padding nor segment padding."""
  real = (jnp.arange(num_keys) < seq_len)[None, :]
  if segment_ids is not None:
    real = jnp.logical_and(real, segment_ids != 0)
  return real


query_is_real = key_is_real


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
