"""`attention(...)`: the public entry point, shaped like `jax.nn.dot_product_attention`.

It validates inputs, pads the sequence to whole blocks, runs the certificate pre-pass
(stabilizer.py), and dispatches forward and backward to one backend through a single
`jax.custom_vjp`. Backends: "pallas_tpu" (Mosaic TPU), "pallas_gpu" (Triton),
"pallas_mgpu" (Mosaic GPU forward and backward for Hopper),
"reference" (blockwise pure JAX), "xla" (dense, for comparison only).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from clis_kernels import masks
from clis_kernels import plan as plan_lib
from clis_kernels import stabilizer as certificate


IMPLEMENTATIONS = plan_lib.IMPLEMENTATIONS
STABILIZERS = ("clis", "online")
GRANULARITIES = ("tile", "head")
BOUNDS = ("radius", "blocks", "cap")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionStats:
  """What the certificate decided.

  certified_tiles: [B, Hq, ceil(Sq / tile)] bool, tile ran the fixed stabilizer.
  certified_fraction: scalar, fraction of certified tiles.
  certified_fraction_per_head: [Hq], the same per query head.
  """

  certified_tiles: jax.Array
  certified_fraction: jax.Array
  certified_fraction_per_head: jax.Array


@dataclasses.dataclass(frozen=True)
class _Static:
  """Everything the custom_vjp closes over (hashable)."""

  plan: plan_lib.Plan
  causal: bool
  scale: float
  kv_len: int | None
  seq_len: int
  window: tuple[int, int] | None = None
  softcap: float | None = None


def check_inputs(q, k, v, segment_ids, causal, stabilizer_name, granularity, tau, local_window_size=None,
                 logits_soft_cap=None, bound=None):
  """One clear ValueError for inputs no backend takes (shapes, dtypes, ids, options)."""
  for name, x in (("q", q), ("k", k), ("v", v)):
    if x.ndim != 4:
      raise ValueError(f"{name} must be [batch, seq, heads, head_dim]; got {name}.shape={x.shape}")
    if x.dtype not in (jnp.float32, jnp.bfloat16, jnp.float16):
      raise ValueError(f"{name}.dtype={x.dtype} must be float32, bfloat16 or float16")
  if not (q.dtype == k.dtype == v.dtype):
    raise ValueError(f"q, k, v must share a dtype; got {q.dtype=}, {k.dtype=}, {v.dtype=}")
  if k.shape[:3] != v.shape[:3]:
    raise ValueError(f"v must have k's batch, length and heads (its head dim may differ: MLA); got {k.shape=}, "
                     f"{v.shape=}")
  if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
    raise ValueError(f"q and k must agree in batch and head_dim; got {q.shape=}, {k.shape=}")
  if q.shape[2] % k.shape[2]:
    raise ValueError(f"query heads Hq={q.shape[2]} must be a multiple of kv heads Hkv={k.shape[2]} (GQA/MQA)")
  separate = isinstance(segment_ids, masks.SegmentIds)
  if (causal or (segment_ids is not None and not separate)) and q.shape[1] != k.shape[1]:
    raise ValueError(f"causal attention, or one segment_ids array for queries and keys, needs equal q and k "
                     f"lengths; got {q.shape[1]=}, {k.shape[1]=} (pass SegmentIds(q=..., kv=...) for "
                     "bidirectional attention with padding)")
  if separate and causal:
    raise ValueError("causal attention takes one segment_ids array for queries and keys; separate "
                     "SegmentIds(q=..., kv=...) are for bidirectional attention (cross-attention, decode)")
  ids = () if segment_ids is None else ((("segment_ids.q", segment_ids.q, q), ("segment_ids.kv", segment_ids.kv, k))
                                        if separate else (("segment_ids", segment_ids, q),))
  for name, x, like in ids:
    if x.shape != like.shape[:2]:
      raise ValueError(f"{name} must be [batch, seq]={like.shape[:2]}; got {name}.shape={x.shape}")
    if not jnp.issubdtype(x.dtype, jnp.integer):
      raise ValueError(f"{name} must be an integer array (0 = padding); got {name}.dtype={x.dtype}")
  if stabilizer_name not in STABILIZERS:
    raise ValueError(f"stabilizer={stabilizer_name!r} must be one of {STABILIZERS}")
  if granularity not in GRANULARITIES:
    raise ValueError(f"{granularity=} must be one of {GRANULARITIES}")
  if bound is not None and bound not in BOUNDS:
    raise ValueError(f"{bound=} must be one of {BOUNDS} or None (the plan's choice)")
  if bound == "cap" and logits_soft_cap is None:
    raise ValueError("bound='cap' bounds logits by the soft cap: pass logits_soft_cap, or bound='radius' / 'blocks'")
  if tau is not None and not tau > 0:
    raise ValueError(f"{tau=} must be positive (natural-log units), or None for the dtype's default")
  if logits_soft_cap is not None and not (isinstance(logits_soft_cap, (int, float)) and logits_soft_cap > 0):
    raise ValueError(f"{logits_soft_cap=} must be a positive number (logits become c·tanh(s / c)) or None")
  if local_window_size is not None:
    pair = (local_window_size,) * 2 if isinstance(local_window_size, int) else tuple(local_window_size)
    if len(pair) != 2 or not all(isinstance(w, int) and w >= 0 for w in pair):
      raise ValueError(f"{local_window_size=} must be an int w >= 0 or a pair (left, right) of them: query i sees "
                       "keys i - left .. i + right")
    if q.shape[1] != k.shape[1] or separate:
      raise ValueError(f"local_window_size needs equal q and k lengths and one segment_ids array; got "
                       f"{q.shape[1]=}, {k.shape[1]=}")


def pad_axis(x, axis, multiple=None, *, to=None, value=0):
  """x zero-padded along `axis` to a multiple of `multiple` (or to length `to`)."""
  pad = (to - x.shape[axis]) if to is not None else -x.shape[axis] % multiple
  if not pad:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, pad)
  return jnp.pad(x, widths, constant_values=value)


def pad_seq(x, multiple, value=0):
  """x [B, S, ...] zero-padded along the sequence to a multiple of `multiple`."""
  return pad_axis(x, 1, multiple, value=value)


def _empty_attention(q, return_stats, value_head_dim):
  """Zero-length queries or keys: every row sees no key, so the output is 0 (and so is every gradient)."""
  out = jnp.zeros(q.shape[:3] + (value_head_dim,), q.dtype)
  if not return_stats:
    return out
  none = jnp.zeros((q.shape[0], q.shape[2], 0), bool)
  return out, AttentionStats(none, jnp.zeros(()), jnp.zeros(q.shape[2]))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attend(static: _Static, q, k, v, segment_ids, stab, sinks):
  """(out, certified tiles or None). stab: a Certificate, KeyBounds (in-kernel certificate) or None; sinks: [Hq]
  f32 learned sink logits or None."""
  return _attend_fwd(static, q, k, v, segment_ids, stab, sinks)[0]


def _forward(static, q, k, v, segment_ids, stab, sinks):
  """(o, lse, certified tiles or None), o and lse with the sinks' terms where sinks are given: the entry's forward
  adds them in its epilogue (Entry.folds_sinks), else stabilizer.fold_sinks does here."""
  plan = static.plan
  kw = dict(causal=static.causal, scale=static.scale, kv_len=static.kv_len, block_sizes=plan.block_sizes,
            window=static.window, softcap=static.softcap, interpret=plan.interpret)
  if plan.mode is plan_lib.Mode.KEYS:  # the kernel certifies its rows: it needs the real query length
    kw["seq_len"] = static.seq_len
  in_kernel = sinks is not None and plan.entry.folds_sinks
  if in_kernel:
    kw["sinks"] = sinks
  o, lse, tiles = plan.backend.forward(q, k, v, segment_ids, stab, mode=plan.mode, **kw)
  if sinks is not None and not in_kernel:
    o, lse = certificate.fold_sinks(o, lse, sinks)
  return o, lse, tiles


def _vary_like(x, like):
  """x made varying over the manual mesh axes that `like` varies over (inside jax.shard_map; elsewhere a no-op),
  so the custom VJP's gradient for x has x's type; JAX then sums it over those axes on the way out (the
  transpose of pcast). Sinks replicated over a data axis meet rows that vary over it."""
  varying = lambda a: getattr(getattr(jax.typeof(a), "manual_axis_type", None), "varying", frozenset())
  missing = tuple(sorted(varying(like) - varying(x)))
  return jax.lax.pcast(x, missing, to="varying") if missing else x


def _attend_fwd(static, q, k, v, segment_ids, stab, sinks):
  o, lse, tiles = _forward(static, q, k, v, segment_ids, stab, sinks)
  return (o, tiles), (q, k, v, segment_ids, stab, o, lse, sinks)


def _attend_bwd(static, residuals, cotangents):
  """The backend's backward on (o, lse), which include the sinks' terms: its P = 2^(t − lse) and rowsum(dO∘o) are
  then the sink-augmented softmax's, so dq, dk, dv need nothing more; dsinks from stabilizer.sink_gradient."""
  q, k, v, segment_ids, stab, o, lse, sinks = residuals
  do, _ = cotangents  # the certified-tile flags carry no gradient
  plan = static.plan
  dq, dk, dv = plan.backend.backward(q, k, v, segment_ids, o, lse, do, causal=static.causal,
                                     scale=static.scale, kv_len=static.kv_len, block_sizes=plan.backward_block_sizes,
                                     window=static.window, softcap=static.softcap, interpret=plan.interpret)
  dsinks = None if sinks is None else certificate.sink_gradient(o, lse, do, sinks)
  zero_stab = jax.tree.map(lambda x: jnp.zeros_like(x) if jnp.issubdtype(x.dtype, jnp.floating) else None, stab)
  return dq, dk, dv, None, zero_stab, dsinks


_attend.defvjp(_attend_fwd, _attend_bwd)


def _xla_attention(q, k, v, segment_ids: masks.SegmentIds | None, *, causal, scale, window, softcap, sinks=None):
  """Dense attention under the same mask convention (rows that see no key return 0): jax.nn's, or
  with a soft cap or sinks the same in plain jnp (jax.nn has neither)."""
  q_pos, k_pos = jnp.arange(q.shape[1]), jnp.arange(k.shape[1])
  if segment_ids is None:
    mask = masks.visible(q_pos, k_pos, None, None, causal=causal, kv_len=None, window=window)
    mask = None if mask is None else mask[None, None]
  else:
    mask = jax.vmap(lambda qs, ks: masks.visible(q_pos, k_pos, qs, ks, causal=causal, kv_len=None, window=window))(
        segment_ids.q, segment_ids.kv)[:, None]
  if softcap is None and sinks is None:
    out = jax.nn.dot_product_attention(q, k, v, mask=mask, scale=scale, implementation="xla")
  else:
    group = q.shape[2] // k.shape[2]
    s = jnp.einsum("bqhd,bkhd->bhqk", q, jnp.repeat(k, group, axis=2), preferred_element_type=jnp.float32) * scale
    if softcap is not None:
      s = softcap * jnp.tanh(s / softcap)
    s = s if mask is None else jnp.where(mask, s, -jnp.inf)
    if sinks is not None:  # one more column per row, the head's sink logit, whose value is 0
      sink = jnp.broadcast_to(sinks.astype(jnp.float32)[None, :, None, None], s.shape[:3] + (1,))
      s = jnp.concatenate([s, sink], axis=-1)
    p = jax.nn.softmax(s, axis=-1)[..., :k.shape[1]]
    out = jnp.einsum("bhqk,bkhd->bqhd", p.astype(v.dtype), jnp.repeat(v, group, axis=2),
                     preferred_element_type=jnp.float32).astype(q.dtype)
  if mask is not None:
    out = jnp.where(jnp.moveaxis(mask.any(-1), 1, 2)[..., None], out, 0)
  return out


def stabilizer_input(plan: plan_lib.Plan, qp, kp, vp, segp, *, causal, scale, tau, granularity, seq_len, kv_seq_len,
                      window, separate_ids, softcap):
  """What the plan's mode hands the kernel: KeyBounds (the kernel certifies), a Certificate (an XLA
  pre-pass certified), or None (online). qp, kp, vp, segp: padded to plan.multiple, segp a SegmentIds
  or None (public for the benchmarks, which time this pre-pass alone)."""
  if plan.mode is plan_lib.Mode.ONLINE:
    return None
  if plan.mode is plan_lib.Mode.CAP:
    return certificate.certify_cap(vp, segp, num_heads=qp.shape[2], q_len=qp.shape[1], softcap=softcap, tau=tau,
                                   granularity=granularity, block_q=plan.tile, seq_len=seq_len, kv_seq_len=kv_seq_len)
  if plan.mode is plan_lib.Mode.BLOCKS:
    kernel = plan.row_bounds_kernel(causal=causal, packed=segp is not None, window=window, separate_ids=separate_ids,
                                    same_length=qp.shape[1] == kp.shape[1])
    return certificate.certify_blocks(qp, kp, vp, segp, causal=causal, scale=scale, tau=tau, granularity=granularity,
                                      block_q=plan.tile, seq_len=seq_len, kv_seq_len=kv_seq_len, window=window,
                                      separate_ids=separate_ids, softcap=softcap, row_bounds_kernel=kernel)
  keys = certificate.key_bounds(kp, vp, segp, causal=causal, tau=tau, block_q=plan.tile, seq_len=kv_seq_len,
                                separate_ids=separate_ids, window=window)
  if plan.mode is plan_lib.Mode.KEYS:
    return keys
  return certificate.certify_rows(qp, kp, segp, keys, causal=causal, scale=scale, granularity=granularity,
                                  block_q=plan.tile, seq_len=seq_len, separate_ids=separate_ids, window=window,
                                  softcap=softcap)


def attention(q, k, v, segment_ids=None, *, causal=True, scale=None, local_window_size=None, logits_soft_cap=None,
              stabilizer="clis", granularity="tile", tau=None, bound=None, implementation=None, block_sizes=None,
              backward_block_sizes=None, interpret=False, return_stats=False, platform=None, sinks=None):
  """CLiS attention. q [B, S, Hq, D]; k [B, S, Hkv, D], v [B, S, Hkv, Dv] with Hq a multiple of Hkv; Dv may differ
  from D (MLA: q·k 192, v 128), and the output is [B, S, Hq, Dv].

  segment_ids: [B, S] int for packed sequences; a query sees keys of its own id only, and
    id 0 marks padding (such rows return 0). Or `SegmentIds(q=[B, Sq], kv=[B, Sk])` when queries
    and keys are padded differently (bidirectional only: cross-attention, decode).
  local_window_size: jax.nn's: an int w (query i sees keys i − w .. i + w) or (left, right); with
    causal=True the right side is 0. Needs equal q and k lengths.
  logits_soft_cap: c, logits become c·tanh(s / c) (Gemma 2, tokamax); the certificate then holds
    for every tile whenever c <= tau / 2 and within the dtype's h + T (stabilizer.py).
  stabilizer: "clis" (fixed certified stabilizer, online fallback per tile or head) or
    "online" (the same kernel's online softmax: the speed baseline).
  granularity: "tile" (batch, head, q-block) or "head" (batch, head) certification.
  tau: cap on the certified gap U − L between a row's bound and its lower bound, in
    natural-log units (the dtype's own limit h + T from stabilizer.py applies too); None:
    stabilizer.default_tau(q.dtype), 64 for f32, 128 for bf16/f16.
  bound: "radius" (one centre and per-tile radius from a K/V pre-pass; kernels certify in their
    prologue), "blocks" (per-block centres, exceptional keys scored exactly, the row's own block
    scored exactly: holds on sinks and RoPE-rotated outlier channels; a pre-pass over q and K,
    stabilizer.certify_blocks, with a Triton kernel for the rows' bounds on GPUs), "cap" (with
    logits_soft_cap: ±c bounds every logit, no pre-pass; stabilizer.certify_cap), or None: the
    plan's choice (plan.automatic_bound: "cap" where the cap alone certifies, c <= tau / 2; else "blocks" on
    Hopper from plan.BLOCKS_FROM_MGPU keys on).
  implementation: None (TPU → "pallas_tpu"; NVIDIA Hopper with bf16/f16 and D up to 128, or MLA's q·k 192 with
    v 128, or D up to 256 (padded to 256) → "pallas_mgpu", the fastest forward and backward on an H200; other NVIDIA
    GPUs or inputs →
    "pallas_gpu"; CPU → "reference"; on Hopper the online softmax runs, where certifying does not pay:
    plan.CERTIFY_ON_HOPPER), or one of "pallas_tpu", "pallas_gpu",
    "pallas_mgpu", "reference", "xla" (a named backend certifies at every length).
  block_sizes: the forward's BlockSizes dataclass; backward_block_sizes: the backward's (default:
    their heuristics). "pallas_mgpu_triton_bwd" is the Mosaic GPU forward with the Triton backward.
  interpret: run a Pallas backend in Pallas interpret mode (on the CPU); for "pallas_tpu" also a
    `pltpu.InterpretParams`, the TPU interpreter that simulates VMEM, SMEM and DMAs and checks them (slower).
  platform: a plan.Platform to plan for (default: the first device's); tracing and lowering for
    another platform (an H200 on a CPU) need it.
  sinks: [Hq] learned sink logits (gpt-oss; natural-log units, next to the scaled logits), or None: each head's
    softmax gets one more term e^sink in its denominator, with no value. Differentiable. Every backend runs it:
    the Mosaic GPU forward adds the term in its epilogue, the others' output and lse take it in XLA
    (stabilizer.fold_sinks); the backward runs on that output and lse, exact for any sink, so the certificate is
    the same as without sinks.
  Returns the output shaped like q, and with return_stats=True also an AttentionStats.
  """
  check_inputs(q, k, v, segment_ids, causal, stabilizer, granularity, tau, local_window_size, logits_soft_cap, bound)
  if sinks is not None:
    sinks = jnp.asarray(sinks)
    if sinks.shape != (q.shape[2],) or not jnp.issubdtype(sinks.dtype, jnp.floating):
      raise ValueError(f"sinks must be [Hq]=[{q.shape[2]}] logits (float), one per query head; got "
                       f"shape {sinks.shape}, dtype {sinks.dtype}")
  separate_ids = isinstance(segment_ids, masks.SegmentIds)
  segment_ids = masks.segment_ids_of(segment_ids)
  window = masks.as_window(local_window_size, causal=causal)
  softcap = None if logits_soft_cap is None else float(logits_soft_cap)
  scale = float(scale) if scale is not None else 1.0 / math.sqrt(q.shape[-1])
  if implementation == "xla":
    if block_sizes is not None or backward_block_sizes is not None:
      raise ValueError("block_sizes has no meaning for implementation='xla'; leave it None")
    if 0 in q.shape or 0 in k.shape:
      return _empty_attention(q, return_stats, v.shape[-1])
    width = max(q.shape[-1], v.shape[-1])  # MLA: zero columns change no logit and no kept output column
    out = _xla_attention(*(pad_axis(x, 3, to=width) for x in (q, k, v)), segment_ids, causal=causal, scale=scale,
                         window=window, softcap=softcap, sinks=sinks)[..., :v.shape[-1]]
    if not return_stats:
      return out
    none = jnp.zeros((q.shape[0], q.shape[2], 1), bool)
    return out, AttentionStats(none, jnp.zeros(()), jnp.zeros(q.shape[2]))
  seq_len, kv_seq_len = q.shape[1], k.shape[1]
  tau = certificate.default_tau(q.dtype) if tau is None else float(tau)
  plan = plan_lib.make_plan(dtype=q.dtype, head_dim=q.shape[-1], value_head_dim=v.shape[-1],
                            seq_len=max(seq_len, kv_seq_len), stabilizer=stabilizer, bound=bound, causal=bool(causal), packed=segment_ids is not None, granularity=granularity, separate_ids=separate_ids,
                            window_or_cap=window is not None or softcap is not None,
                            implementation=implementation,
                            block_sizes=block_sizes, backward_block_sizes=backward_block_sizes, interpret=interpret,
                            platform=platform, softcap=softcap, tau=tau)
  if 0 in q.shape or 0 in k.shape:
    return _empty_attention(q, return_stats, v.shape[-1])
  # Zero columns change no logit and no kept output column: q, k pad to the plan's q·k head dim, v to its v head
  # dim (the same one unless the backend takes MLA's pair as it is).
  qp, kp = (pad_seq(pad_axis(x, 3, to=plan.head_dim), plan.multiple) for x in (q, k))
  vp = pad_seq(pad_axis(v, 3, to=plan.value_head_dim), plan.multiple)
  segp = None if segment_ids is None else jax.tree.map(lambda x: pad_seq(x.astype(jnp.int32), plan.multiple),
                                                       segment_ids)
  needs_kv_mask = kp.shape[1] != kv_seq_len and not causal and segment_ids is None
  static = _Static(plan, bool(causal), scale, kv_seq_len if needs_kv_mask else None, seq_len, window, softcap)
  stab = stabilizer_input(plan, qp, kp, vp, segp, causal=causal, scale=scale, tau=tau, granularity=granularity,
                           seq_len=seq_len, kv_seq_len=kv_seq_len, window=window, separate_ids=separate_ids,
                           softcap=softcap)
  out, tiles = _attend(static, qp, kp, vp, segp, stab,
                       None if sinks is None else _vary_like(sinks.astype(jnp.float32), qp))
  out = out[:, :seq_len, :, :v.shape[-1]]
  if not return_stats:
    return out
  real_tiles = -(-seq_len // plan.tile)  # tiles of padding rows only are not reported
  tiles = jnp.zeros((q.shape[0], q.shape[2], real_tiles), bool) if tiles is None else tiles[..., :real_tiles]
  frac = tiles.astype(jnp.float32)
  return out, AttentionStats(tiles, frac.mean(), frac.mean(axis=(0, 2)))
