"""The CLiS math, stated once and shared by every backend: bounds, certificate, thresholds.

Everything here works in base 2: with σ₂ = scale·log2(e), a row's logits are
t_ij = σ₂·q_i·k_j and softmax weights are 2^(t_ij − M_i) for any stabilizer M_i.

Upper bound (before the KV loop). For any centre c, Cauchy–Schwarz gives
    t_ij = σ₂·q_i·c + σ₂·q_i·(k_j − c) ≤ σ₂·q_i·c + σ₂·‖q_i‖·‖k_j − c‖.
Rows whose own key is visible (causal or local, packed or not) take c = a robust mean key: the
coordinate-wise median of the means of up to SAMPLED_BLOCKS key blocks spread evenly over the
sequence (padding keys excluded), so a single huge key (a sink) cannot loosen rows that never see
it, and the centre costs a read of a few blocks, not of K (an error δ in c grows the radius by about
‖δ‖²/2R, second order). Their lower bound is the diagonal logit, which needs no centre, and keys of
other segments in a visible block only widen R (still an upper bound).
Bidirectional rows take a mean of keys they see: their lower bound q·c is a lower bound of the row
max only when c lies in the convex hull of those keys (then q·c ≤ max_j q·k_j). A coordinate-wise
median need not: key blocks in three orthogonal clusters have median 0, outside their hull, and a
query pointing away from all three then gets L above its true max, a certified tile whose weights
all flush to zero (`testing.hull_escaping`). Unpacked rows take the exact mean k̄ of the real keys:
one more read of K; with every row seeing every key a sink moves it by only ‖sink‖/N; and for any
centre c, k̄'s gap ‖q‖·R(k̄) ≤ ‖q‖·(R(c) + ‖c − k̄‖), the gap of c with L corrected down to q·k̄.
Packed rows take their segment's mean, recomputed without outlier keys (a mean of some visible
keys, so still inside the hull).
One pass over K gives, per block u of block_q keys, r_u = max_{j∈u} ‖k_j − c‖; a q tile's radius R is the max of r_u over the blocks it may see
(causal: up to its diagonal block, a prefix max; bidirectional: all), and
U_i = σ₂·(q_i·c + ‖q_i‖·R) ≥ max_j t_ij. `key_bounds` is the pass over K and V; `row_bounds`
is the per-row arithmetic, which the GPU kernel runs in its prologue on the q tile it has
loaded, and the XLA pre-pass (`certify_rows`) runs on whole arrays for the other backends.

Lower bound. Causal (or packed, or local): the diagonal key is always visible, so L_i = t_ii.
Bidirectional: the row sees its whole segment, c is a mean of keys it sees, and max ≥ mean, so
L_i = σ₂·q_i·c. With separate query and key segment ids (cross-attention, decode) a row's own
position need not be visible, so c is then the exact mean of the keys the row sees and
L_i = σ₂·q_i·c (the XLA pre-pass computes it).

Block centres and exceptional keys (`certify_blocks`, attention(bound="blocks")). Pretrained
models defeat one centre: an attention-sink key sets R for every row that sees it, and outlier
channels that RoPE rotates along the sequence put every key far from any fixed c. Instead:
  * exceptional keys E: per (batch, kv head), the `budget` real keys farthest from their block's
    centre; their logits t_ij are computed exactly (any key may be scored instead of bounded, so
    every slot, which the kernel scores anyway, is used: no cut to tune, and a sink just above or
    below a cut cannot flip a whole sequence's bound);
  * every key block u gets its own centre c_u (the mean of its ordinary keys) and radius
    r_u = max_{j∈u∖E} ‖k_j − c_u‖; by Cauchy–Schwarz t_ij ≤ σ₂(q_i·c_u + ‖q_i‖ r_u) for j ∈ u∖E, so
        U_i = max( max_{u visible to i} σ₂(q_i·c_u + ‖q_i‖ r_u),  max_{j∈E visible to i} t_ij ) ≥ max_j t_ij
    (visible blocks: the causal prefix, the window's band, or all; keys of other segments in a
    visible block only loosen the bound);
  * L_i = the largest of: the row's own key (causal, local, packed), or the mean of the keys it sees
    (bidirectional: max ≥ mean), the exact logits of the visible keys of its own block, and the
    exact logits of visible exceptional keys — each a visible logit or a mean of them, so ≤ max.
The rest of the certificate (M = max(L, U − h), pass when U − L ≤ min(τ·log2 e, h + T)) is unchanged.
Slowly rotating components move with the block centres, a sink leaves its block, and the own-block
scores pull L up to the local maximum that RoPE models attend to. The cost is a [S, num_blocks]
product q·cᵀ and a [S, block] one (the row's block) per head: `block_row_bounds` here in XLA, and
on GPUs `pallas_gpu_bounds` on the tensor cores, with each centre rounded to q's dtype (ĉ_u) and its
radius widened to r_u + ‖c_u − ĉ_u‖ + 2^-16‖ĉ_u‖ (the triangle inequality, then f32 accumulation over
D ≤ 256 products), so the kernel's U stays an upper bound of the row max.

Local windows. A row sees keys i − left ≤ j ≤ i + right only, its own among them, so L_i = t_ii,
and a tile's radius R is the max of r_u over the key blocks its rows may see: a band, not the
whole prefix — a sink far behind the window no longer loosens the bound.

Soft-capping. With logits c·tanh(s/c) every logit lies in (−c, c). The map x ↦ c·tanh(x/c) is
monotone and 1-Lipschitz, so capping U and L bounds the capped row max from both sides and the
gap cap(U) − cap(L) ≤ min(U − L, 2c): the certificate only gets easier. Every tile certifies,
whatever q and k, once 2c·log2 e ≤ min(τ·log2 e, h + T), i.e. c ≤ τ/2 (32 at f32's default τ = 64,
64 at bf16's τ = 128, within bf16's h + T): Gemma 2's c = 50 then certifies every bf16 tile.

The cap alone is then a bound: U = c·log2 e, L = −U for every row (widened by CAP_TANH_ERROR·c·log2 e for the
kernels' one-instruction tanh, so c up to τ/2 less that margin), with no pre-pass over q or K (`certify_cap`,
bound="cap"); only h needs max |v|.

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
sum cost bf16 accuracy against the online path, on every backend that tried it: BENCHMARKS.md, "the
certified loop's normaliser"). The saved lse sums the unrounded weights (a second row sum): where M sits below the
row max the dominant weight is not 1 and its rounding would enter lse, and with it every P the backward recomputes
(notes/certificate.md; BENCHMARKS.md, "the accurate lse"). The Mosaic GPU kernel can trade either sum for a little
speed (pallas_mgpu.BlockSizes(exact_sum=False) normalises by the unrounded sum; exact_lse=False saves lse from the
rounded one).

Learned sinks (gpt-oss). A head's sink logit t (base 2) is one more term of every row's softmax, with value 0:
lse' = log2(2^lse + 2^t) and o' = o·2^(lse − lse'), combined by the max as the online softmax combines blocks
(`fold_sinks`; the Mosaic GPU forward does the same on its registers in the epilogue). Exact for any t, so the
certificate of the keys is unchanged: the term adds no value and cannot overflow a sum whose stabilizer it
raises. The backward then runs on (o', lse') as on any softmax; the sink's own gradient is
−Σ_rows 2^(t − lse')·rowsum(dO∘o') (`sink_gradient`).

Certificate. A row passes when U_i − L_i ≤ min(τ·log2 e, h + T), τ being the user's cap in
natural-log units. τ bounds |t − M| for the row's dominant terms (t_max − M ≥ h − (U − L)), and exp2
rounds its input to f32 first, so a dominant weight carries a relative error of about
|t − M|·2^-24·ln 2 (one ulp of the input): at τ = 64 nats (92 in base 2, ulp 2^-17) that is 5e-6, the
level of f32 inputs, so f32 keeps τ = 64; 16-bit inputs round their weights to 2^-9 (bf16) before P·V,
so their τ = 128 nats (185 in base 2, ulp 2^-16, 1e-5: 400x below bf16's rounding) costs them nothing
and certifies the wide gaps of pretrained-like inputs (`default_tau`; BENCHMARKS.md, issue 16). A tile (batch, head, q-block) is certified when all its real rows pass
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
TAU_F32 = 64.0  # nats: the default cap on U − L for f32 (and f64) inputs
TAU_16BIT = 128.0  # nats: for bf16 / f16 inputs (f16 never certifies anyway: its h + T < 0)
CAP_TANH_ERROR = 2.0**-9  # above twice the absolute error of the least exact tanh a kernel caps with (tanh.approx.f32)
NEG = -1e30  # finite "minus infinity" for masked base-2 logits: exp2(NEG - finite) == 0
EMPTY_LSE = 1e30  # saved lse of a row with no visible key: its backward weights are 0
SAMPLED_BLOCKS = 32  # key blocks whose means give the centre (their median)


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


def default_tau(dtype) -> float:
  """τ when the caller passes None: 64 nats for 32/64-bit inputs, 128 for 16-bit ones (see above)."""
  return TAU_16BIT if jnp.dtype(dtype).itemsize <= 2 else TAU_F32


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


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KeyBounds:
  """What one pass over K and V gives, before any query is seen.

  centre:    [B, 1, Hkv, D] f32: the median of sampled block means (causal, local), or the exact
             mean of the real keys (bidirectional); [B, Sq, Hkv, D] when packed and bidirectional:
             each query's (robust) segment mean, or with separate query and key ids the exact mean
             of the keys it sees.
  radius:    [B, Hkv, num_q_blocks] f32 when causal: max ‖k_j − c‖ over the key blocks (of
             block_q keys) up to the tile's diagonal; [B, Hkv, 1] otherwise (all keys).
  headroom:  [B, Hkv] f32, h.
  threshold: [B, Hkv] f32, min(τ·log2 e, h + T), the largest certifiable gap U − L.
  """

  centre: jax.Array
  radius: jax.Array
  headroom: jax.Array
  threshold: jax.Array


def _sampled_median_centre(k, key_valid, block: int):
  """[B, 1, Hkv, D] f32: the coordinate-wise median of the means of up to SAMPLED_BLOCKS blocks
  of `block` keys, evenly strided over the sequence (all blocks when there are fewer); blocks of
  padding only are left out of the median."""
  batch, sk, hkv, d = k.shape
  nb = sk // block
  stride = -(-nb // SAMPLED_BLOCKS)
  blocks = k.reshape(batch, nb, block, hkv, d)[:, ::stride].astype(jnp.float32)
  valid = key_valid.reshape(-1, nb, block)[:, ::stride, :, None, None]
  count = valid.sum(2)
  block_mean = jnp.where(valid, blocks, 0.0).sum(2) / jnp.maximum(count, 1)  # [B, samples, Hkv, D]
  return jnp.nanmedian(jnp.where(count > 0, block_mean, jnp.nan), axis=1, keepdims=True)


def real_key_mean(kf, key_valid):
  """[B, Hkv, D] f32: the mean of the real keys of kf [B, Sk, Hkv, D] (key_valid [B or 1, Sk]), the centre whose
  q·c is a lower bound of every bidirectional unpacked row's max (max ≥ mean)."""
  valid = key_valid[..., None, None]
  return jnp.where(valid, kf, 0.0).sum(1) / jnp.maximum(valid.sum(1), 1)


def _robust_segment_mean(kf, key_valid, index):
  """Each position's segment mean key [B, Sk, Hkv, D], recomputed without the segment's
  outliers (keys farther than 4x its mean distance)."""
  def mean(x, weight):
    x = jnp.where(weight, x, 0.0)
    w = jnp.broadcast_to(weight, x.shape[:3] + (1,)).astype(jnp.float32)
    return _per_segment(jax.ops.segment_sum, x, index) / jnp.maximum(_per_segment(jax.ops.segment_sum, w, index), 1.0)

  valid = key_valid[..., None, None]
  dist = jnp.linalg.norm(kf - mean(kf, valid), axis=-1, keepdims=True)
  return mean(kf, valid & (dist <= 4.0 * mean(dist, valid)))


def _segment_means(kf, key_valid, segment_ids: masks.SegmentIds):
  """(centre at each key [B, Sk, Hkv, D], centre at each query [B, Sq, Hkv, D]): the exact mean of
  each segment's real keys, so a query's centre is the mean of the keys it sees (0 if it sees none)."""
  sq = segment_ids.q.shape[1]
  index = _segment_index(jnp.concatenate([segment_ids.q, segment_ids.kv], axis=1))
  q_index, k_index = index[:, :sq], index[:, sq:]
  size = index.shape[1]
  valid = key_valid[..., None, None]
  sums = jax.vmap(lambda x, i: jax.ops.segment_sum(x, i, num_segments=size))(jnp.where(valid, kf, 0.0), k_index)
  counts = jax.vmap(lambda x, i: jax.ops.segment_sum(x, i, num_segments=size))(
      jnp.broadcast_to(valid, kf.shape[:3] + (1,)).astype(jnp.float32), k_index)
  means = sums / jnp.maximum(counts, 1.0)  # [B, size, Hkv, D]
  gather = jax.vmap(lambda m, i: m[i])
  return gather(means, k_index), gather(means, q_index)


def key_bounds(k, v, segment_ids: masks.SegmentIds | None, *, causal: bool, tau: float, block_q: int, seq_len: int,
               separate_ids: bool = False, window=None) -> KeyBounds:
  """The pre-pass over K and V (a few fused reductions, no cumulative scans).

  k, v: [B, Sk, Hkv, D] with Sk a multiple of block_q; segment_ids: SegmentIds, one [B, S] array
  for both, or None;
  seq_len: number of real keys (the rest is block padding). separate_ids (bidirectional only):
  query and key ids differ, so no row's own key need be visible; the centre is then each query
  segment's exact key mean [B, Sq, Hkv, D], which makes q·c a lower bound (max >= mean).
  window: (left, right) of local attention, or None: a tile's radius then spans only the key blocks
  its rows may see.
  """
  k, v = jax.lax.stop_gradient((k, v))
  segment_ids = masks.segment_ids_of(segment_ids)
  kf = k.astype(jnp.float32)
  batch, sk, hkv, _ = k.shape
  if sk % block_q:
    raise ValueError(f"{block_q=} must divide the padded key length {sk=}")
  key_valid = masks.key_is_real(segment_ids, sk, seq_len)  # [B or 1, Sk]

  nb = sk // block_q
  if segment_ids is None and not causal and window is None:  # L = q·c: c must be a mean of the keys rows see
    centre = key_centre = real_key_mean(kf, key_valid)[:, None]
  elif causal or segment_ids is None:  # L is the row's own key: any centre serves U
    centre = key_centre = _sampled_median_centre(k, key_valid, block_q)
  elif separate_ids:
    key_centre, centre = _segment_means(kf, key_valid, segment_ids)
  else:
    centre = key_centre = _robust_segment_mean(kf, key_valid, _segment_index(segment_ids.kv))
  dev = jnp.where(key_valid[..., None], jnp.linalg.norm(kf - key_centre, axis=-1), 0.0)  # [B, Sk, Hkv]
  per_block = dev.reshape(batch, nb, block_q, hkv).max(2).transpose(0, 2, 1)  # [B, Hkv, nb]
  if causal or window is not None:  # max over the blocks each tile sees, one masked reduction (nb is small)
    tile, block = jnp.arange(nb)[:, None], jnp.arange(nb)[None, :]
    if window is None:
      sees = block <= tile  # [tile, block]: a prefix
    else:
      first, end = masks.window_kv_blocks(tile, window=window, block_q=block_q, block_k=block_q, num_kv_blocks=nb,
                                          div=jnp.floor_divide)
      sees = (block >= first) & (block < end)
    radius = jnp.where(sees, per_block[:, :, None, :], 0.0).max(-1)
  else:  # every tile sees every block
    radius = per_block.max(-1, keepdims=True)

  headroom, threshold = headroom_and_threshold(v, segment_ids=segment_ids, seq_len=seq_len, tau=tau)
  return KeyBounds(centre=centre, radius=radius, headroom=headroom, threshold=threshold)


def soft_cap(t, cap2: float | None):
  """Base-2 logits t soft-capped at cap2 = c·log2 e: cap2·tanh(t / cap2) (tokamax's, Gemma 2's
  c·tanh(s / c) in natural units), or t when cap2 is None."""
  return t if cap2 is None else cap2 * jnp.tanh(t / cap2)


def empty_rows(l, m):
  """Rows that saw no key: l == 0, or the running max never left NEG (the online loop then summed
  2^0 for each masked key). A NaN logit makes l NaN: that row is not empty and its NaN reaches the
  output, as in dense attention (a max that drops NaN, as XLA's CPU max may, keeps m at NEG)."""
  return (l == 0.0) | ((m == NEG) & ~jnp.isnan(l))


def saved_lse(m, l_safe, empty, unrounded=None):
  """Rows' base-2 lse: M + log2 of the weights' sum, `unrounded` (a certified row's second sum, "Normalisation")
  where given, else l_safe (l with 1 on empty rows); EMPTY_LSE on rows that saw no key."""
  total = l_safe if unrounded is None else jnp.where(empty, 1.0, unrounded)
  return jnp.where(empty, EMPTY_LSE, m + jnp.log2(total))


def fold_sinks(o, lse, sinks):
  """(o', lse'): o [B, S, Hq, Dv] and lse [B, Hq, S] (base 2) of rows without their head's sink, with it: sinks [Hq]
  natural-log logits. Rows with no visible key keep o = 0 and lse = EMPTY_LSE."""
  t = (sinks.astype(jnp.float32) * LOG2E)[None, :, None]
  folded = jnp.logaddexp2(lse, t)
  factor = jnp.exp2(lse - folded)  # 2^lse / (2^lse + 2^t), 1 for rows with no key
  return (o.astype(jnp.float32) * jnp.swapaxes(factor, 1, 2)[..., None]).astype(o.dtype), folded


def sink_gradient(o, lse, do, sinks):
  """[Hq] dL/dsinks from o' [B, S, Hq, Dv], lse' [B, Hq, S] (both with the sinks) and dO: each row's sink weight
  2^(t − lse') times −rowsum(dO∘o'), summed over batch and rows (0 for rows with no key: lse' = EMPTY_LSE)."""
  t = (sinks.astype(jnp.float32) * LOG2E)[None, :, None]
  delta = jnp.einsum("bshd,bshd->bhs", o.astype(jnp.float32), do.astype(jnp.float32))
  return -jnp.sum(jnp.exp2(jnp.minimum(t - lse, 0.0)) * delta, axis=(0, 2)).astype(sinks.dtype)


def row_bounds(q, centre, radius, k_diag, *, sigma2: float, cap2: float | None = None):
  """Base-2 bounds (U, L) of rows q [..., D] f32, shared by the XLA pre-pass and the kernels.

  centre: [..., D] (broadcastable); radius: [...] the visible blocks' max ‖k − c‖;
  k_diag: [..., D] f32, each row's own key (causal, packed or local), or None (bidirectional).
  cap2: the base-2 soft cap, or None; capping is monotone, so the capped bounds bound the capped max.
  """
  q_dot_c = jnp.sum(q * centre, axis=-1)
  upper = sigma2 * (q_dot_c + jnp.sqrt(jnp.sum(q * q, axis=-1)) * radius)
  lower = sigma2 * (q_dot_c if k_diag is None else jnp.sum(q * k_diag, axis=-1))
  return soft_cap(upper, cap2), soft_cap(lower, cap2)


def stabilize(upper, lower, headroom, threshold, row_real=None):
  """(M, row passes): M = max(L, U − h) (0 on padding rows), pass when U − L ≤ threshold.
  row_real None: every row is real (or, as in the Mosaic GPU kernel, padding rows are zero, so
  U = L = 0 there, they pass and M = max(0, −h) = 0 without a mask)."""
  m, row_ok = jnp.maximum(lower, upper - headroom), upper - lower <= threshold
  if row_real is None:
    return m, row_ok
  return jnp.where(row_real, m, 0.0), row_ok | ~row_real


def headroom_and_floor(v, *, segment_ids, seq_len: int):
  """Headroom h [B, Hkv] and floor T (python float) from v's range, dtype and N = seq_len keys."""
  segment_ids = masks.segment_ids_of(segment_ids)
  key_valid = masks.key_is_real(segment_ids, v.shape[1], seq_len)
  vmax = jnp.where(key_valid[..., None, None], jnp.abs(v.astype(jnp.float32)), 0.0).max(axis=(1, 3))
  return headroom_from(vmax, v.dtype, seq_len=seq_len)


def headroom_and_threshold(v, *, segment_ids, seq_len: int, tau: float):
  """(h, min(τ·log2 e, h + T)) [B, Hkv] each: the headroom and the largest certifiable gap U − L, from v and τ."""
  headroom, floor = headroom_and_floor(v, segment_ids=segment_ids, seq_len=seq_len)
  return headroom, jnp.minimum(tau * LOG2E, headroom + floor)


def headroom_from(vmax, dtype, *, seq_len: int):
  """`headroom_and_floor` from max |v| over the real keys, vmax [B, Hkv] (context parallelism takes its max over
  every device's keys), v's dtype and the key count N."""
  info = jnp.finfo(dtype)
  log2_n = math.ceil(math.log2(max(seq_len, 1)))
  log2_v = jnp.maximum(0.0, jnp.ceil(jnp.log2(jnp.maximum(vmax, 1e-30))))
  headroom = jnp.maximum(0.0, (info.maxexp - 2) - log2_n - log2_v)
  floor = float(-info.minexp - (info.nmant + 2) - log2_n)
  return headroom, floor


def certify(q, k, v, segment_ids, *, causal: bool, scale: float, tau: float, granularity: str,
            block_q: int, seq_len: int, kv_seq_len: int | None = None, separate_ids: bool = False, window=None,
            softcap: float | None = None) -> Certificate:
  """The whole pre-pass in XLA: `key_bounds`, then each row's bounds and the certificate."""
  keys = key_bounds(k, v, segment_ids, causal=causal, tau=tau, block_q=block_q,
                    seq_len=seq_len if kv_seq_len is None else kv_seq_len, separate_ids=separate_ids, window=window)
  return certify_rows(q, k, segment_ids, keys, causal=causal, scale=scale, granularity=granularity,
                      block_q=block_q, seq_len=seq_len, separate_ids=separate_ids, window=window, softcap=softcap)


def certify_rows(q, k, segment_ids, keys: KeyBounds, *, causal: bool, scale: float, granularity: str,
                 block_q: int, seq_len: int, separate_ids: bool = False, window=None,
                 softcap: float | None = None) -> Certificate:
  """Row bounds and the per-tile (or per-head) certificate, in XLA, from `key_bounds`.

  q: [B, Sq, Hq, D] with Sq a multiple of block_q; k: [B, Sk, Hkv, D]; seq_len: the real query
  length. The lower bound is the row's own key when it is visible (causal, local, or packed with one
  set of ids), else q·c with c the mean of the keys it sees. softcap: c of c·tanh(s / c), or None.
  Not differentiated: the stabilizer only shifts the softmax, which leaves its value and gradient
  unchanged.
  """
  q, k = jax.lax.stop_gradient((q, k))
  segment_ids = masks.segment_ids_of(segment_ids)
  batch, sq, hq, d = q.shape
  hkv = k.shape[2]
  group = hq // hkv
  if sq % block_q:
    raise ValueError(f"{block_q=} must divide the padded query length {sq=}")
  if granularity not in ("tile", "head"):
    raise ValueError(f"{granularity=} must be 'tile' or 'head'")
  qg = q.astype(jnp.float32).reshape(batch, sq, hkv, group, d)
  centre = jnp.broadcast_to(keys.centre, (batch, sq, hkv, d))[:, :, :, None]
  per_tile = keys.radius.shape[-1] > 1  # causal or local: each tile's own radius
  radius = jnp.broadcast_to(jnp.repeat(keys.radius, block_q, axis=-1) if per_tile else keys.radius,
                            (batch, hkv, sq)).transpose(0, 2, 1)[..., None]  # [B, Sq, Hkv, 1]
  own_key = own_key_visible(causal=causal, window=window, segment_ids=segment_ids, separate_ids=separate_ids)
  k_diag = k.astype(jnp.float32)[:, :, :, None] if own_key else None
  upper, lower = row_bounds(qg, centre, radius, k_diag, sigma2=scale * LOG2E,
                            cap2=None if softcap is None else softcap * LOG2E)
  to_heads = lambda x: x.reshape(batch, sq, hq).transpose(0, 2, 1)
  return certificate_of(to_heads(upper), to_heads(lower), keys.headroom, keys.threshold, segment_ids,
                      block_q=block_q, seq_len=seq_len, granularity=granularity)


def own_key_visible(*, causal: bool, window, segment_ids, separate_ids: bool) -> bool:
  """Whether each row's own key (same position) is always visible, so its logit is a lower bound."""
  return causal or window is not None or (segment_ids is not None and not separate_ids)


def certificate_of(upper, lower, headroom, threshold, segment_ids, *, block_q: int, seq_len: int,
                 granularity: str) -> Certificate:
  """The certificate from base-2 row bounds [B, Hq, Sq] and the per-(batch, kv head) headroom and
  threshold [B, Hkv]: M and the per-tile (or per-head) pass."""
  batch, hq, sq = upper.shape
  group = hq // headroom.shape[1]
  per_head = lambda x: jnp.repeat(x, group, axis=1)[..., None]  # [B, Hkv] -> [B, Hq, 1]
  row_real = masks.query_is_real(segment_ids, sq, seq_len)[:, None, :]  # [B, 1, Sq]
  m, row_ok = stabilize(upper, lower, per_head(headroom), per_head(threshold), row_real)
  certified = row_ok.reshape(batch, hq, sq // block_q, block_q).all(-1)
  if granularity == "head":
    certified = jnp.broadcast_to(certified.all(-1, keepdims=True), certified.shape)
  return Certificate(m=m, certified=certified, upper=upper, lower=lower, threshold=jnp.repeat(threshold, group, axis=1))


# ----------------------------------------------------------------------------- exceptional keys, block centres
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BlockBounds:
  """Per key block u (of `block` keys): centre c_u (the mean of its ordinary keys) and radius r_u =
  max ‖k_j − c_u‖ over them; and a few exceptional keys E scored exactly instead.

  centres: [B, nb, Hkv, D] f32; radii: [B, Hkv, nb] f32 (0 for blocks with no ordinary key);
  exceptional: [B, Hkv, E] int32 key positions; is_exceptional: [B, Hkv, E] bool (padding slots False).
  """

  centres: jax.Array
  radii: jax.Array
  exceptional: jax.Array
  is_exceptional: jax.Array


def block_bounds(k, segment_ids, *, block: int, seq_len: int, budget: int = 32) -> BlockBounds:
  """Bounds that survive sinks and RoPE-rotated outlier channels.

  Each block gets its own centre, so a component that RoPE rotates slowly along the sequence (an
  outlier channel's offset) moves with the centres instead of inflating one global radius. The
  `budget` keys farthest from their block's centre per (batch, kv head) (attention sinks,
  delimiters) leave the blocks and are scored exactly, so one sink no longer sets the bound of
  every row that sees its block. They leave their blocks' sums by subtraction (a scatter of
  `budget` rows), not by a second masked sum over every key; the radii are measured from the
  centres so obtained, so U holds whatever their rounding.
  """
  k = jax.lax.stop_gradient(k).astype(jnp.float32)
  batch, sk, hkv, d = k.shape
  nb = sk // block
  valid = masks.key_is_real(masks.segment_ids_of(segment_ids), sk, seq_len)  # [B or 1, Sk]
  valid = jnp.broadcast_to(valid, (batch, sk)).reshape(batch, nb, block)[..., None]  # [B, nb, block, 1]
  blocks = k.reshape(batch, nb, block, hkv, d)
  total = jnp.where(valid[..., None], blocks, 0.0).sum(2)  # [B, nb, Hkv, D]
  count = jnp.broadcast_to(valid.sum(2).astype(jnp.float32), (batch, nb, hkv))  # [B, nb, Hkv]
  deviation = lambda total, count: jnp.linalg.norm(  # [B, nb, block, Hkv]: each key from its block's centre
      blocks - (total / jnp.maximum(count, 1.0)[..., None])[:, :, None], axis=-1)
  score = jnp.where(valid, deviation(total, count), -1.0).reshape(batch, sk, hkv).transpose(0, 2, 1)  # [B, Hkv, Sk]
  top, where = jax.lax.top_k(score, max(0, min(budget, sk)))
  is_exceptional = top >= 0.0  # real keys (padding scores -1)
  b, h = jnp.arange(batch)[:, None, None], jnp.arange(hkv)[None, :, None]
  k_e = jnp.take_along_axis(k, where.transpose(0, 2, 1)[..., None], axis=1).transpose(0, 2, 1, 3)  # [B, Hkv, E, D]
  weight = is_exceptional.astype(jnp.float32)
  total = total.at[b, where // block, h].add(-weight[..., None] * k_e)
  count = count.at[b, where // block, h].add(-weight)
  drop = jnp.zeros((batch, hkv, sk), bool).at[b, h, where].max(is_exceptional)
  keep = valid & ~drop.transpose(0, 2, 1).reshape(batch, nb, block, hkv)  # [B, nb, block, Hkv]
  radii = jnp.where(keep, deviation(total, count), 0.0).max(2).transpose(0, 2, 1)  # [B, Hkv, nb]
  return BlockBounds(centres=total / jnp.maximum(count, 1.0)[..., None], radii=radii,
                     exceptional=where.astype(jnp.int32), is_exceptional=is_exceptional)


ACCUMULATION = 2.0 ** -16  # relative error of an f32-accumulated dot over D <= 256 products (D·2^-24)


def rounded_centres(centres, radii, dtype):
  """Centres rounded to the queries' dtype, so q·c runs on the matrix units (exact products, f32 sums), and radii
  widened to stay sound: q·c ≤ q·ĉ + ‖q‖·‖c − ĉ‖ (Cauchy–Schwarz), and the f32 sum of D products is within
  ACCUMULATION·‖q‖·‖ĉ‖ of the exact one. centres [B, nb, Hkv, D] f32, radii [B, Hkv, nb] → (ĉ in dtype, radii)."""
  rounded = centres.astype(dtype)
  r32 = rounded.astype(jnp.float32)
  widen = jnp.linalg.norm(centres - r32, axis=-1) + ACCUMULATION * jnp.linalg.norm(r32, axis=-1)  # [B, nb, Hkv]
  return rounded, radii + widen.transpose(0, 2, 1)


def block_row_bounds(q, k, segment_ids, bounds: BlockBounds, *, causal: bool, scale: float, block: int,
                     kv_len: int | None = None, window=None, separate_ids: bool = False, cap2: float | None = None,
                     own_block: int | None = None):
  """Base-2 (U, L) [B, Hq, Sq] of every row from BlockBounds:

  U_i = max( max_{u visible} σ₂(q_i·c_u + ‖q_i‖ r_u),  max_{j ∈ E visible} σ₂ q_i·k_j ),
  where "visible" is the causal prefix (u up to i's block), the window's band, or every block; keys
  of other segments in a visible block only loosen it. Every visible ordinary key lies in a visible
  block within r_u of c_u (Cauchy–Schwarz), and exceptional keys are scored exactly, so U_i ≥ max_j s_ij.
  L_i = the row's own logit where it is visible (causal, local, packed), else σ₂ q_i·k̄ with k̄ the
  exact mean of the keys it sees (max ≥ mean); raised to the visible keys of the row's own block
  and any visible exceptional key, scored exactly. kv_len: the real key count (block padding past it
  is invisible); cap2: the base-2 soft cap, applied to both bounds (monotone); own_block: the keys
  per "own block" scored for L (default `block`; the kernel's tile, which it scores anyway).
  """
  q, k = jax.lax.stop_gradient((q, k))
  segment_ids = masks.segment_ids_of(segment_ids)
  batch, sq, hq, d = q.shape
  sk, hkv = k.shape[1], k.shape[2]
  kv_len = sk if kv_len is None else kv_len
  group = hq // hkv
  sigma2 = scale * LOG2E
  qg = q.astype(jnp.float32).reshape(batch, sq, hkv, group, d)
  kf = k.astype(jnp.float32)
  q_norm = jnp.linalg.norm(qg, axis=-1)  # [B, Sq, Hkv, G]
  blocks = jnp.arange(bounds.centres.shape[1])[None, :]

  def blocks_upper(chunk):  # one chunk of rows: the [rows, num_blocks] bound stays small at 32k
    rows, q_chunk, norm = chunk
    per_block = (jnp.einsum("bihgd,buhd->bihgu", q_chunk, bounds.centres)
                 + norm[..., None] * bounds.radii[:, None, :, None, :])
    sees = jnp.ones((rows.shape[0], blocks.shape[1]), bool)
    if causal:
      sees = blocks * block <= rows[:, None]
    if window is not None:
      first_key, last_key = blocks * block, (blocks + 1) * block - 1
      sees = sees & (last_key >= rows[:, None] - window[0]) & (first_key <= rows[:, None] + window[1])
    return jnp.where(sees[None, :, None, None, :], per_block, -jnp.inf).max(-1)

  rows = next(c for c in (2048, 1024, 512, 256, 128, 64, 32, 16, 8, 4, 2, 1) if sq % c == 0)
  split = lambda x: jnp.moveaxis(x.reshape(batch, sq // rows, rows, *x.shape[2:]), 1, 0)
  upper = jax.lax.map(blocks_upper, (jnp.arange(sq).reshape(-1, rows), split(qg), split(q_norm)))
  upper = jnp.moveaxis(upper, 0, 1).reshape(batch, sq, hkv, group) * sigma2  # [B, Sq, Hkv, G]

  positions = bounds.exceptional  # [B, Hkv, E]
  k_e = jnp.take_along_axis(kf, positions.transpose(0, 2, 1)[..., None], axis=1)  # [B, E, Hkv, D]
  s_e = jnp.einsum("bihgd,behd->bihge", qg, k_e) * sigma2
  q_ids = None if segment_ids is None else segment_ids.q[:, :, None, None, None]
  kv_ids = None if segment_ids is None else jnp.take_along_axis(segment_ids.kv[:, None, :], positions, axis=2)
  seen = masks.visible_pairs(jnp.arange(sq)[None, :, None, None, None], positions[:, None, :, None, :], q_ids,
                             None if kv_ids is None else kv_ids[:, None, :, None, :], causal=causal, kv_len=None,
                             window=window)  # [B, Sq, Hkv, 1, E]
  seen = bounds.is_exceptional[:, None, :, None, :] & (True if seen is None else seen)
  exact = jnp.where(seen, s_e, -jnp.inf).max(-1, initial=-jnp.inf)  # [B, Sq, Hkv, G]
  upper = jnp.maximum(upper, exact)

  if own_key_visible(causal=causal, window=window, segment_ids=segment_ids, separate_ids=separate_ids):
    lower = jnp.einsum("bihgd,bihd->bihg", qg, kf[:, :sq]) * sigma2
  else:
    key_valid = masks.key_is_real(segment_ids, sk, kv_len)[..., None, None]
    if segment_ids is None:
      lower = jnp.einsum("bihgd,bhd->bihg", qg, real_key_mean(kf, key_valid[..., 0, 0])) * sigma2
    else:
      _, centre = _segment_means(kf, key_valid[..., 0, 0], segment_ids)  # [B, Sq, Hkv, D]
      lower = jnp.einsum("bihgd,bihd->bihg", qg, centre) * sigma2
  own_block = block if own_block is None else own_block
  if sq == sk:  # the row's own key block, scored exactly (the kernel computes it anyway): its visible max
    own = kf.reshape(batch, sk // own_block, own_block, hkv, d)[:, jnp.arange(sq) // own_block]
    s_own = jnp.einsum("bihgd,bijhd->bihgj", qg, own) * sigma2
    i = jnp.arange(sq)[:, None]
    j = (i // own_block) * own_block + jnp.arange(own_block)[None, :]  # [Sq, own_block]: i's block's keys
    ok = masks.visible_pairs(i[None], j[None], None if segment_ids is None else segment_ids.q[:, :, None],
                             None if segment_ids is None else segment_ids.kv[:, j], causal=causal, kv_len=kv_len,
                             window=window)[:, :, None, None, :]  # [B or 1, Sq, 1, 1, own_block]
    lower = jnp.maximum(lower, jnp.where(ok, s_own, -jnp.inf).max(-1))
  lower = jnp.maximum(lower, exact)
  to_heads = lambda x: soft_cap(x.reshape(batch, sq, hq).transpose(0, 2, 1), cap2)
  return to_heads(upper), to_heads(lower)


# Keys per block centre of the block bound. Smaller blocks track rotating components (RoPE'd outlier channels)
# more closely; larger ones cost fewer centre products per row (BENCHMARKS.md, issue 16, has both measured).
KEY_BLOCK = 16


def certify_blocks(q, k, v, segment_ids, *, causal: bool, scale: float, tau: float, granularity: str, block_q: int,
                   seq_len: int, kv_seq_len: int | None = None, window=None, separate_ids: bool = False,
                   softcap: float | None = None, budget: int = 32, key_block: int | None = None,
                   row_bounds_kernel=None) -> Certificate:
  """The certificate from block centres and exceptional keys (`block_bounds`, `block_row_bounds`);
  the same Certificate as `certify`, so every kernel's "cert" mode takes it. key_block: keys per
  centre (default KEY_BLOCK, at most block_q). row_bounds_kernel: a kernel computing block_row_bounds's (U, L)
  without a cap (pallas_gpu_bounds.row_bounds), or None for the XLA statement here."""
  segment_ids = masks.segment_ids_of(segment_ids)
  kv_seq_len = seq_len if kv_seq_len is None else kv_seq_len
  key_block = min(KEY_BLOCK, block_q) if key_block is None else key_block
  bounds = block_bounds(k, segment_ids, block=key_block, seq_len=kv_seq_len, budget=budget)
  cap2 = None if softcap is None else softcap * LOG2E
  if row_bounds_kernel is None:
    upper, lower = block_row_bounds(q, k, segment_ids, bounds, causal=causal, scale=scale, block=key_block,
                                    kv_len=kv_seq_len, window=window, separate_ids=separate_ids, cap2=cap2,
                                    own_block=block_q)
  else:
    upper, lower = (soft_cap(x, cap2) for x in row_bounds_kernel(q, k, segment_ids, bounds, causal=causal, scale=scale,
                                                                 block=key_block, kv_len=kv_seq_len))
  headroom, threshold = headroom_and_threshold(v, segment_ids=segment_ids, seq_len=kv_seq_len, tau=tau)
  return certificate_of(upper, lower, headroom, threshold, segment_ids, block_q=block_q, seq_len=seq_len,
                        granularity=granularity)


def cap_certifies(softcap: float | None, tau: float) -> bool:
  """Whether a soft cap c alone can certify: the gap 2c (widened for the kernels' tanh) is within τ (nats). The
  dtype's h + T, which depends on max |v|, is checked per call by `certify_cap`."""
  return softcap is not None and 2.0 * softcap * (1.0 + CAP_TANH_ERROR) <= tau


def certify_cap(v, segment_ids, *, num_heads: int, q_len: int, softcap: float, tau: float, granularity: str,
                block_q: int, seq_len: int, kv_seq_len: int | None = None) -> Certificate:
  """The certificate from the soft cap alone (bound="cap"): every capped logit lies in (−U, U) with U = c·log2 e
  (plus CAP_TANH_ERROR·U for an inexact tanh), so each row's bounds are ±U and M = max(−U, U − h) is one number per
  (batch, kv head); no pass over q or K, only max |v| for h. Every tile passes when 2U <= min(τ·log2 e, h + T).

  v: [B, Sk, Hkv, Dv] padded; num_heads: Hq; q_len: the padded query length Sq; seq_len: the real query length."""
  segment_ids = masks.segment_ids_of(segment_ids)
  kv_seq_len = seq_len if kv_seq_len is None else kv_seq_len
  bound = softcap * LOG2E * (1.0 + CAP_TANH_ERROR)
  upper = jnp.full((v.shape[0], num_heads, q_len), bound, jnp.float32)
  headroom, threshold = headroom_and_threshold(jax.lax.stop_gradient(v), segment_ids=segment_ids, seq_len=kv_seq_len,
                                               tau=tau)
  return certificate_of(upper, -upper, headroom, threshold, segment_ids, block_q=block_q, seq_len=seq_len,
                        granularity=granularity)
