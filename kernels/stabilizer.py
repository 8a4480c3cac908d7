"""The CLiS math, stated once and shared by every backend: bounds, certificate, thresholds.

Everything here works in base 2: with σ₂ = scale·log2(e), a row's logits are
t_ij = σ₂·q_i·k_j and softmax weights are 2^(t_ij − M_i) for any stabilizer M_i.

Upper bound (before the KV loop). For any centre c, Cauchy–Schwarz gives
    t_ij = σ₂·q_i·c + σ₂·q_i·(k_j − c) ≤ σ₂·q_i·c + σ₂·‖q_i‖·‖k_j − c‖.
We take c = the mean key of the segment (of the sequence when not packed; padding keys
excluded), recomputed without outlier keys. Rows only see keys of their own segment, so one centre serves both sides of the
inequality. With R_i = max over keys visible to row i of ‖k_j − c‖ (causal: a running max up
to i; bidirectional: the segment's max),  U_i = σ₂·(q_i·c + ‖q_i‖·R_i) ≥ max_j t_ij.

Lower bound. Causal (or packed): the diagonal key is always visible, so L_i = t_ii.
Bidirectional: the row sees its whole segment and max ≥ mean, so L_i = σ₂·q_i·c.

Stabilizer. The kernel uses M_i = max(L_i, U_i − h), so every weight is 2^(t − M) ≤ 2^h,
and the dominant one is ≥ 1 when M_i = L_i. Taking L_i when it is larger keeps the
exponent's argument t − M small for the dominant terms: exp2's input is rounded to f32,
so its absolute error grows with |t − M| (a fixed stabilizer far above the max would cost
f32 inputs accuracy; bf16's rounding hides it).

Headroom h. With N keys
and |v| ≤ V, l ≤ N·2^h and |acc| ≤ N·2^h·V; both stay finite when
    h ≤ (maxexp − 1) − 1 − ⌈log2 N⌉ − max(0, ⌈log2 V⌉)
(one bit of margin; maxexp = 128 for f32/bf16, 16 for f16: the weights are cast to v's
dtype before the P·V product, so v's dtype sets the range).

Floor T. The dominant weight is 2^(max t − M) ≥ 2^(h − (U − L)). Weights below the
smallest normal 2^minexp flush to zero (exp2 is flush-to-zero on GPUs). At most N of them,
each < 2^minexp, must stay below the dtype's rounding of the dominant term, 2^-(nmant+2):
    N·2^minexp ≤ 2^(h − (U − L))·2^-(nmant+2)   ⇔   U − L ≤ h + T,
    T = −minexp − (nmant + 2) − ⌈log2 N⌉
(bf16: 126 − 9 − ⌈log2 N⌉; f32: 126 − 25 − ⌈log2 N⌉; f16: 14 − 12 − ⌈log2 N⌉ < 0, so f16
never certifies and always runs the online path). Relative rounding of l and acc does not
depend on their scale, so a certified row is as accurate as the online path's.

Normalisation. The weights enter P·V rounded to v's dtype. A certified row sums those
rounded weights, so the output is an exact weighted mean of V under slightly perturbed
weights (the online path gets this for free for its dominant weight, 2^0 = 1, which rounds
exactly; a fixed stabilizer puts the dominant weight anywhere, and dividing by the unrounded
sum cost bf16 up to 1.25x the online path's error on short rows). The saved lse uses the
same sum (gradients stay within 1.1x of the online path's error; notes/kernels.md).

Certificate. A row passes when U_i − L_i ≤ min(τ·log2 e, h + T), τ being the user's cap in
natural-log units. A tile (batch, head, q-block) is certified when all its real rows pass
(`granularity="tile"`); `granularity="head"` certifies a (batch, head) only if all its
tiles pass. Uncertified tiles run the online softmax. Rows that see no key (padding,
segment id 0) pass trivially: their output is 0 either way.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from clis_kernels import masks

LOG2E = math.log2(math.e)
NEG = -1e30  # finite "minus infinity" for masked base-2 logits: exp2(NEG - finite) == 0
EMPTY_LSE = 1e30  # saved lse of a row with no visible key: its backward weights are 0


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Certificate:
  """What the pre-pass decided, in the kernels' head-major layout.

  m:         [B, Hq, S] f32, base-2 stabilizer M_i = max(L_i, U_i − h) (used on certified tiles).
  certified: [B, Hq, num_q_blocks] bool, tile runs the fixed-stabilizer path.
  upper, lower: [B, Hq, S] f32, the base-2 bounds U_i, L_i (for stats and tests).
  threshold: [B, Hq] f32, min(τ·log2 e, h + T) per (batch, head).
  """

  m: jax.Array
  certified: jax.Array
  upper: jax.Array
  lower: jax.Array
  threshold: jax.Array


def _segment_index(segment_ids: jax.Array) -> jax.Array:
  """Maps arbitrary int segment ids [B, S] to dense indices in [0, S) per batch row."""
  size = segment_ids.shape[1]
  inverse = jax.vmap(lambda ids: jnp.unique(ids, return_inverse=True, size=size, fill_value=ids[0])[1])
  return inverse(segment_ids).reshape(segment_ids.shape)


def _per_segment(reduce, values: jax.Array, index: jax.Array) -> jax.Array:
  """Reduces values [B, S, ...] within segments and gathers the result back to [B, S, ...]."""
  size = values.shape[1]

  def one(vals, idx):
    return reduce(vals, idx, num_segments=size)[idx]

  return jax.vmap(one)(values, index)


def row_bounds(q, k, segment_ids, *, causal: bool, scale: float, seq_len: int):
  """Base-2 upper and lower bounds on each row's max logit.

  q: [B, Sq, Hq, D]; k: [B, Sk, Hkv, D]; segment_ids: [B, S] int or None (0 = padding);
  seq_len: number of real positions (the rest is block padding).
  Returns (upper, lower), each [B, Hq, Sq] f32.
  """
  q = q.astype(jnp.float32)
  k = k.astype(jnp.float32)
  batch, sq, hq, _ = q.shape
  sk, hkv = k.shape[1], k.shape[2]
  group = hq // hkv
  key_valid = masks.key_is_real(segment_ids, sk, seq_len)  # [B, Sk]
  index = None if segment_ids is None else _segment_index(segment_ids)

  def mean(x, weight):
    """Weighted mean over the sequence (or each key's segment) of x [B, Sk, Hkv, ...]."""
    x = jnp.where(weight, x, 0.0)
    w = jnp.broadcast_to(weight, x.shape[:3] + (1,)).astype(jnp.float32)
    if index is None:
      return x.sum(1, keepdims=True) / jnp.maximum(w.sum(1, keepdims=True), 1.0)
    x_sum = _per_segment(jax.ops.segment_sum, x, index)
    return x_sum / jnp.maximum(_per_segment(jax.ops.segment_sum, w, index), 1.0)

  # The mean key, recomputed without outliers (keys farther than 4x the mean distance): any
  # centre keeps the bound valid, and a robust one stops a single huge key (an attention
  # sink) from loosening the bound of every row that never sees it.
  valid = key_valid[..., None, None]
  first = mean(k, valid)
  dist = jnp.linalg.norm(k - first, axis=-1, keepdims=True)
  inlier = valid & (dist <= 4.0 * mean(dist, valid))
  centre = mean(k, inlier)  # [B, 1 or Sk, Hkv, D]

  dev = jnp.linalg.norm(k - centre, axis=-1)
  dev = jnp.where(key_valid[..., None], dev, 0.0)  # [B, Sk, Hkv]
  if causal:
    radius = jax.lax.cummax(dev, axis=1)
  elif segment_ids is None:
    radius = jnp.broadcast_to(dev.max(1, keepdims=True), (batch, sq, hkv))
  else:
    radius = _per_segment(jax.ops.segment_max, dev, index)

  qg = q.reshape(batch, sq, hkv, group, -1)
  sigma2 = scale * LOG2E
  q_dot_c = jnp.einsum("bshgd,bshd->bshg", qg, jnp.broadcast_to(centre, (batch, sq) + centre.shape[2:]),
                       precision=jax.lax.Precision.HIGHEST)
  q_norm = jnp.linalg.norm(qg, axis=-1)
  upper = sigma2 * (q_dot_c + q_norm * radius[..., None])
  if causal:
    lower = sigma2 * jnp.einsum("bshgd,bshd->bshg", qg, k, precision=jax.lax.Precision.HIGHEST)
  else:
    lower = sigma2 * q_dot_c
  to_heads = lambda x: x.reshape(batch, sq, hq).transpose(0, 2, 1)
  return to_heads(upper), to_heads(lower)


def headroom_and_floor(v, *, segment_ids, seq_len: int):
  """Headroom h [B, Hkv] and floor T (python float) from v's range, dtype and N = seq_len keys."""
  info = jnp.finfo(v.dtype)
  log2_n = math.ceil(math.log2(max(seq_len, 1)))
  key_valid = masks.key_is_real(segment_ids, v.shape[1], seq_len)
  vmax = jnp.where(key_valid[..., None, None], jnp.abs(v.astype(jnp.float32)), 0.0).max(axis=(1, 3))
  log2_v = jnp.maximum(0.0, jnp.ceil(jnp.log2(jnp.maximum(vmax, 1e-30))))
  headroom = jnp.maximum(0.0, (info.maxexp - 2) - log2_n - log2_v)
  floor = float(-info.minexp - (info.nmant + 2) - log2_n)
  return headroom, floor


def certify(q, k, v, segment_ids, *, causal: bool, scale: float, tau: float, granularity: str,
            block_q: int, seq_len: int) -> Certificate:
  """Runs the pre-pass: bounds, headroom, and the per-tile (or per-head) certificate.

  Shapes as in `row_bounds`, with Sq a multiple of block_q. Not differentiated: the
  stabilizer only shifts the softmax, which leaves its value and gradient unchanged.
  """
  q, k, v = jax.lax.stop_gradient((q, k, v))
  batch, sq, hq, _ = q.shape
  hkv = k.shape[2]
  if sq % block_q:
    raise ValueError(f"{block_q=} must divide the padded query length {sq=}")
  upper, lower = row_bounds(q, k, segment_ids, causal=causal, scale=scale, seq_len=seq_len)
  headroom, floor = headroom_and_floor(v, segment_ids=segment_ids, seq_len=seq_len)
  headroom = jnp.repeat(headroom, hq // hkv, axis=1)  # [B, Hq]
  threshold = jnp.minimum(tau * LOG2E, headroom + floor)

  row_real = masks.query_is_real(segment_ids, sq, seq_len)[:, None, :]  # [B, 1, Sq]
  row_ok = (upper - lower <= threshold[..., None]) | ~row_real
  certified = row_ok.reshape(batch, hq, sq // block_q, block_q).all(-1)
  if granularity == "head":
    certified = jnp.broadcast_to(certified.all(-1, keepdims=True), certified.shape)
  elif granularity != "tile":
    raise ValueError(f"{granularity=} must be 'tile' or 'head'")
  m = jnp.where(row_real, jnp.maximum(lower, upper - headroom[..., None]), 0.0)
  return Certificate(m=m, certified=certified, upper=upper, lower=lower, threshold=threshold)
