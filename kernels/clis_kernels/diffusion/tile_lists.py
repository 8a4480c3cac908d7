"""The kept-tile lists the skip kernels walk, and the reference's skip forward under the same contract."""

from __future__ import annotations

import jax.numpy as jnp

from clis_kernels import masks, reference
from clis_kernels.plan import Mode, stabilizer_inputs
from clis_kernels.stabilizer import NEG


PAIRWISE_MAX = 64  # rows of at most this many tiles are ordered by pairwise comparison (one fused XLA kernel)


def stable_rank(x):
  """x [..., n] -> the rank of each entry in a stable ascending sort of its row, int32 (argsort(argsort(x))).
  Short rows compare every pair — O(n²) work that XLA fuses into one kernel, where two sorts are two launches
  apiece (suspected, not yet timed, of a small DiT's per-call skip overhead); longer rows sort."""
  n = x.shape[-1]
  if n > PAIRWISE_MAX:
    return jnp.argsort(jnp.argsort(x, axis=-1, stable=True), axis=-1, stable=True).astype(jnp.int32)
  xu, xt = x[..., None, :], x[..., :, None]  # [..., t, u]
  earlier = jnp.arange(n)[None, :] < jnp.arange(n)[:, None]  # u < t
  return ((xu < xt) | ((xu == xt) & earlier)).sum(-1).astype(jnp.int32)


def kept_tiles(skip, *, width: int | None = None):
  """skip [B, H, nq, nk] bool -> (visit [B, H, nq, width or nk] int32: the kept kv tiles first, in order, then
  the skipped ones and zero padding; count [B, H, nq] int32: how many are kept). visit is the stable argsort of
  skip: tile t goes to position stable_rank(skip)[t]."""
  nk = skip.shape[-1]
  if nk > PAIRWISE_MAX:
    visit = jnp.argsort(skip, axis=-1, stable=True).astype(jnp.int32)
  else:  # invert the rank permutation by comparison: visit[p] = the t with rank p
    rank = stable_rank(skip.astype(jnp.int32))
    tiles = jnp.arange(nk, dtype=jnp.int32)
    visit = jnp.where(rank[..., None, :] == tiles[:, None], tiles, 0).sum(-1).astype(jnp.int32)
  count = (~skip).sum(-1).astype(jnp.int32)
  if width is not None:
    visit = jnp.pad(visit, [(0, 0)] * 3 + [(0, width - skip.shape[-1])])
  return visit, count


def reference_forward(q, k, v, skip, stab, *, mode: Mode, scale: float, kv_len: int | None, seq_len: int,
                      block_sizes: reference.BlockSizes, track: bool, interpret: bool = False):
  """The skip-forward contract (see pallas_gpu_skip.forward) on the pure-JAX reference: its per-row gaps
  reduced to the q tile's (max over real rows) and its sums to their min. track and interpret change nothing."""
  del track, interpret
  if mode is Mode.KEYS:
    raise ValueError(f"the reference takes the XLA certificate: {mode=} must not be Mode.KEYS")
  _, cert = stabilizer_inputs(stab, mode)
  bq = block_sizes.block_q
  out, _, (gap_rows, log2_l_rows) = reference.forward_with_tiles(
      q, k, v, None, cert, causal=False, scale=scale, kv_len=kv_len, block_sizes=block_sizes, tile_skip=skip,
      tile_gap=True)
  real = masks.query_is_real(None, q.shape[1], seq_len)[0][None, None, :]
  per_tile = lambda x: x.reshape(x.shape[0], x.shape[1], q.shape[1] // bq, bq, *x.shape[3:])
  gap = per_tile(jnp.where(real[..., None], gap_rows, NEG)).max(axis=3)
  log2_l = per_tile(jnp.where(real, log2_l_rows, jnp.inf)).min(axis=3)
  return out, gap, log2_l
