"""Blockwise pure-JAX CLiS attention: the same algorithm as the kernels, for CPU and tests.

All query rows are processed at once; the loop runs over KV blocks. A row of a certified
tile keeps its fixed stabilizer M (no max, no rescale); other rows run the online softmax.
Both cases are one formula: m_new = M on fixed rows, max(m, rowmax) elsewhere.
Layout: q [B, S, Hq, D], k/v [B, S, Hkv, D]; lse is base 2, [B, Hq, S].
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from clis_kernels import masks
from clis_kernels.common import dot_precision, varying_like
from clis_kernels.plan import Mode, stabilizer_inputs
from clis_kernels.stabilizer import LOG2E, NEG, Certificate, empty_rows, saved_lse, soft_cap


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tiles of the reference: block_q is the certificate's tile, block_k the loop step."""

  block_q: int = 128
  block_k: int = 128

  def __post_init__(self):
    for name in ("block_q", "block_k"):
      value = getattr(self, name)
      if value < 1 or value & (value - 1):
        raise ValueError(f"{name}={value} must be a power of two")

  @property
  def tile(self) -> int:
    return self.block_q

  @property
  def multiple(self) -> int:
    """Sequence lengths are padded to a multiple of this."""
    return max(self.block_q, self.block_k)

  @property
  def skip_tiles(self) -> tuple[int, int]:
    """(rows, keys) of a temporal-skipping tile: the forward's tiles."""
    return self.block_q, self.block_k


def default_block_sizes(head_dim: int, seq_len: int, dtype) -> BlockSizes:
  del head_dim, dtype
  cap = max(16, 1 << (seq_len - 1).bit_length())
  return BlockSizes(block_q=min(128, cap), block_k=min(128, cap))



def _grouped(q, num_kv_heads):
  b, s, hq, d = q.shape
  return q.reshape(b, s, num_kv_heads, hq // num_kv_heads, d)


def _kv_blocks(x, block_k):
  b, s, h, d = x.shape
  return x.reshape(b, s // block_k, block_k, h, d).swapaxes(0, 1)  # [nk, B, bk, H, D]


def _block_mask(segment_ids: masks.SegmentIds | None, start_k, block_k, num_q, *, causal, kv_len, window):
  """[B or 1, Sq, bk] visibility of one kv block, or None when every key is visible."""
  q_pos = jnp.arange(num_q)
  k_pos = start_k + jnp.arange(block_k)
  rule = dict(causal=causal, kv_len=kv_len, window=window)
  if segment_ids is None:
    mask = masks.visible(q_pos, k_pos, None, None, **rule)
    return None if mask is None else mask[None]
  k_seg = jax.lax.dynamic_slice_in_dim(segment_ids.kv, start_k, block_k, axis=1)
  return jax.vmap(lambda qs, ks: masks.visible(q_pos, k_pos, qs, ks, **rule))(segment_ids.q, k_seg)


def forward(q, k, v, segment_ids, stab: Certificate | None, *, mode: Mode, causal, scale, kv_len, block_sizes,
            window=None, softcap=None, interpret=False):
  """Returns (o [B, S, Hq, D] in q.dtype, lse [B, Hq, S] f32 base 2, cert.certified or None).
  mode (plan.Mode): CERTIFICATE or BLOCKS, stab the XLA pre-pass's Certificate; ONLINE, None.
  window: local (left, right) or None; softcap: c of c·tanh(s / c) or None."""
  del interpret
  if mode is Mode.KEYS:
    raise ValueError("reference.forward takes no Mode.KEYS: the plan certifies for it in XLA (Mode.CERTIFICATE)")
  _, cert = stabilizer_inputs(stab, mode)
  o, lse, _ = forward_with_tiles(q, k, v, segment_ids, cert, causal=causal, scale=scale, kv_len=kv_len,
                                 block_sizes=block_sizes, window=window, softcap=softcap)
  return o, lse, None if cert is None else cert.certified


def forward_with_tiles(q, k, v, segment_ids, cert, *, causal, scale, kv_len, block_sizes, tile_skip=None,
                       tile_gap=False, window=None, softcap=None):
  """`forward`, plus per-tile control for temporal skipping (kernels/clis_kernels/diffusion).

  tile_skip: [B, Hq, nq, nk] bool, (q tile, kv tile) pairs to leave out, or None.
  tile_gap: also return (gap [B, Hq, S, nk], log2_l [B, Hq, S]): each row's max base-2 logit
    on each kv tile minus the stabilizer after that tile, and log2 of its final sum (else None).
  """
  b, sq, hq, d = q.shape
  hkv = k.shape[2]
  bk = block_sizes.block_k
  prec = dot_precision(q.dtype)
  sigma2 = scale * LOG2E
  cap2 = None if softcap is None else softcap * LOG2E
  qg = _grouped(q, hkv)  # [B, Sq, Hkv, G, D]
  to_rows = lambda x: x.reshape(b, hkv, hq // hkv, sq).transpose(0, 3, 1, 2)  # [B,Hq,S] -> [B,S,Hkv,G]
  if cert is None:
    fixed = jnp.zeros((b, sq, hkv, hq // hkv), bool)
    m0 = jnp.full(fixed.shape, NEG, jnp.float32)
  else:
    fixed = to_rows(jnp.repeat(cert.certified, block_sizes.block_q, axis=-1))
    m0 = jnp.where(fixed, to_rows(cert.m), NEG)

  def step(carry, xs):
    acc, m, l, l_lse = carry  # l_lse: certified rows' unrounded sum for lse (None without a certificate)
    u, k_u, v_u = xs
    s = jnp.einsum("bqhgd,bkhd->bqhgk", qg, k_u, precision=prec, preferred_element_type=jnp.float32) * sigma2
    s = soft_cap(s, cap2)
    mask = _block_mask(segment_ids, u * bk, bk, sq, causal=causal, kv_len=kv_len, window=window)
    if mask is not None:
      s = jnp.where(mask[:, :, None, None, :], s, NEG)
    if tile_skip is not None:
      s = jnp.where(skip_rows[u][..., None], NEG, s)
    m_new = jnp.where(fixed, m, jnp.maximum(m, s.max(-1)))
    alpha = jnp.exp2(m - m_new)
    p = jnp.exp2(s - m_new[..., None])
    p_lo = p.astype(v.dtype)
    pv = jnp.einsum("bqhgk,bkhd->bqhgd", p_lo, v_u, precision=prec, preferred_element_type=jnp.float32)
    # Fixed rows normalise by the weights that multiplied V and save lse from the unrounded ones (stabilizer.py).
    row_sum = jnp.where(fixed, p_lo.astype(jnp.float32).sum(-1), p.sum(-1))
    l_lse = None if l_lse is None else l_lse * alpha + p.sum(-1)
    return (acc * alpha[..., None] + pv, m_new, l * alpha + row_sum, l_lse), (s.max(-1) - m_new if tile_gap else None)

  init = jax.tree.map(lambda x: varying_like(x, q), (jnp.zeros(qg.shape, jnp.float32), m0, jnp.zeros(m0.shape),
                                                     None if cert is None else jnp.zeros(m0.shape)))
  nk = k.shape[1] // bk
  if tile_skip is not None:  # [B, Hq, nq, nk] -> per kv tile, per row: [nk, B, S, Hkv, G]
    skip_rows = jax.vmap(to_rows, in_axes=-1)(jnp.repeat(tile_skip, block_sizes.block_q, axis=2))
  (acc, m, l, l_lse), maxima = jax.lax.scan(step, init, (jnp.arange(nk), _kv_blocks(k, bk), _kv_blocks(v, bk)))
  empty = empty_rows(l, m)
  l_safe = jnp.where(empty, 1.0, l)
  o = jnp.where(empty[..., None], 0.0, acc / l_safe[..., None])
  lse = saved_lse(m, l_safe, empty, l_lse)
  heads_first = lambda x: x.reshape(b, sq, hq).transpose(0, 2, 1)
  gap = None
  if tile_gap:  # [nk, B, S, Hkv, G] -> [B, Hq, S, nk]
    gap = (maxima.reshape(nk, b, sq, hq).transpose(1, 3, 2, 0), heads_first(jnp.log2(l_safe)))
  return o.reshape(q.shape).astype(q.dtype), heads_first(lse), gap


def backward(q, k, v, segment_ids, o, lse, do, *, causal, scale, kv_len, block_sizes, window=None, softcap=None,
             interpret=False):
  """FlashAttention-2 backward from the saved base-2 lse. Returns (dq, dk, dv). With a soft cap,
  dS is taken through the cap: d(c·tanh(s/c))/ds = 1 − tanh²(s/c)."""
  del interpret
  cap2 = None if softcap is None else softcap * LOG2E
  b, sq, hq, d = q.shape
  hkv = k.shape[2]
  bk = block_sizes.block_k
  prec = dot_precision(q.dtype)
  sigma2 = scale * LOG2E
  qg = _grouped(q, hkv)
  dog = _grouped(do, hkv)
  delta = jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32), -1).reshape(b, sq, hkv, hq // hkv)
  lse_rows = lse.transpose(0, 2, 1).reshape(delta.shape)

  def step(dq, xs):
    u, k_u, v_u = xs
    s = jnp.einsum("bqhgd,bkhd->bqhgk", qg, k_u, precision=prec, preferred_element_type=jnp.float32) * sigma2
    capped = soft_cap(s, cap2)
    mask = _block_mask(segment_ids, u * bk, bk, sq, causal=causal, kv_len=kv_len, window=window)
    if mask is not None:
      capped = jnp.where(mask[:, :, None, None, :], capped, NEG)
    p = jnp.exp2(capped - lse_rows[..., None])
    dp = jnp.einsum("bqhgd,bkhd->bqhgk", dog, v_u, precision=prec, preferred_element_type=jnp.float32)
    ds = p * (dp - delta[..., None])
    if cap2 is not None:
      ds = ds * (1.0 - jnp.square(jnp.tanh(s / cap2)))
    dq = dq + scale * jnp.einsum("bqhgk,bkhd->bqhgd", ds.astype(k.dtype), k_u, precision=prec,
                                 preferred_element_type=jnp.float32)
    dk_u = scale * jnp.einsum("bqhgk,bqhgd->bkhd", ds.astype(q.dtype), qg, precision=prec,
                              preferred_element_type=jnp.float32)
    dv_u = jnp.einsum("bqhgk,bqhgd->bkhd", p.astype(do.dtype), dog, precision=prec,
                      preferred_element_type=jnp.float32)
    return dq, (dk_u, dv_u)

  nk = k.shape[1] // bk
  dq, (dk, dv) = jax.lax.scan(step, varying_like(jnp.zeros(qg.shape, jnp.float32), q),
                              (jnp.arange(nk), _kv_blocks(k, bk), _kv_blocks(v, bk)))
  unblock = lambda x: x.swapaxes(0, 1).reshape(k.shape)
  return dq.reshape(q.shape).astype(q.dtype), unblock(dk).astype(k.dtype), unblock(dv).astype(v.dtype)
