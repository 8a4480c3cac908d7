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
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from clis_kernels import masks, reference
from clis_kernels import stabilizer as certificate


class Backend(NamedTuple):
  forward: Callable
  backward: Callable
  block_sizes_type: type
  default_block_sizes: Callable[[int, int, Any], Any]
  platforms: tuple[str, ...]  # platforms that run it compiled (others need interpret=True)
  certifies_in_kernel: bool  # takes KeyBounds and certifies each tile itself (no pre-pass over q)
  padded_head_dim: Callable[[int], int] = lambda d: d  # head dim it runs at (the API zero-pads up to it)
  window_and_soft_cap: bool = True  # takes local windows and logits soft-capping


def _pallas_gpu() -> Backend:
  from clis_kernels import pallas_gpu, pallas_gpu_vjp
  return Backend(pallas_gpu.forward, pallas_gpu_vjp.backward, pallas_gpu.BlockSizes,
                 pallas_gpu.default_block_sizes, ("gpu",), True, pallas_gpu.padded_head_dim)


def _pallas_mgpu() -> Backend:
  from clis_kernels import pallas_mgpu
  return Backend(pallas_mgpu.forward, pallas_mgpu.backward, pallas_mgpu.BlockSizes,
                 pallas_mgpu.default_block_sizes, ("gpu",), True, pallas_mgpu.padded_head_dim, False)


def _pallas_tpu() -> Backend:
  from clis_kernels import pallas_tpu, pallas_tpu_vjp
  return Backend(pallas_tpu.forward, pallas_tpu_vjp.backward, pallas_tpu.BlockSizes,
                 pallas_tpu.default_block_sizes, ("tpu",), False)


def _reference() -> Backend:
  return Backend(reference.forward, reference.backward, reference.BlockSizes,
                 reference.default_block_sizes, ("cpu", "gpu", "tpu"), False)


BACKENDS: dict[str, Callable[[], Backend]] = {
    "pallas_tpu": _pallas_tpu,
    "pallas_gpu": _pallas_gpu,
    "pallas_mgpu": _pallas_mgpu,
    "reference": _reference,
}
IMPLEMENTATIONS = (*BACKENDS, "xla")
STABILIZERS = ("clis", "online")
GRANULARITIES = ("tile", "head")
BOUNDS = ("radius", "blocks")
_AUTO = {"tpu": "pallas_tpu", "gpu": "pallas_gpu", "cpu": "reference"}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionStats:
  """What the certificate decided.

  certified_tiles: [B, Hq, num_q_blocks] bool, tile ran the fixed stabilizer.
  certified_fraction: scalar, fraction of certified tiles.
  certified_fraction_per_head: [Hq], the same per query head.
  """

  certified_tiles: jax.Array
  certified_fraction: jax.Array
  certified_fraction_per_head: jax.Array


@dataclasses.dataclass(frozen=True)
class _Static:
  """Everything the custom_vjp closes over (hashable)."""

  backend: str
  causal: bool
  scale: float
  kv_len: int | None
  seq_len: int
  block_sizes: Any
  interpret: bool
  window: tuple[int, int] | None = None
  softcap: float | None = None


def _platform() -> str:
  return jax.devices()[0].platform


def _gpu_is_hopper() -> bool:
  return str(getattr(jax.devices()[0], "compute_capability", "")).startswith("9")


def _resolve_implementation(implementation, interpret, q, window_or_cap: bool = False) -> str:
  if implementation is None:
    auto = _AUTO.get(_platform(), "reference")
    if auto == "pallas_gpu" and _gpu_is_hopper() and not window_or_cap:
      from clis_kernels import pallas_mgpu
      if pallas_mgpu.supports(q.dtype, q.shape[-1]):
        return "pallas_mgpu"  # the Mosaic GPU kernels: the fastest forward and backward on an H200
    return auto
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"{implementation=} is not one of {IMPLEMENTATIONS} (or None for automatic)")
  if implementation in BACKENDS and not interpret:
    platforms = BACKENDS[implementation]().platforms
    if _platform() not in platforms:
      raise ValueError(
          f"{implementation=} needs a {'/'.join(platforms).upper()} device but this platform is "
          f"{_platform()!r}: pass interpret=True to run it in Pallas interpret mode, or "
          "implementation='reference'")
  return implementation


def _validate(q, k, v, segment_ids, causal, stabilizer_name, granularity, tau, local_window_size=None,
              logits_soft_cap=None, bound="radius"):
  for name, x in (("q", q), ("k", k), ("v", v)):
    if x.ndim != 4:
      raise ValueError(f"{name} must be [batch, seq, heads, head_dim]; got {name}.shape={x.shape}")
    if x.dtype not in (jnp.float32, jnp.bfloat16, jnp.float16):
      raise ValueError(f"{name}.dtype={x.dtype} must be float32, bfloat16 or float16")
  if not (q.dtype == k.dtype == v.dtype):
    raise ValueError(f"q, k, v must share a dtype; got {q.dtype=}, {k.dtype=}, {v.dtype=}")
  if k.shape != v.shape:
    raise ValueError(f"k and v must have the same shape; got {k.shape=}, {v.shape=}")
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
  if bound not in BOUNDS:
    raise ValueError(f"{bound=} must be one of {BOUNDS}")
  if not tau > 0:
    raise ValueError(f"{tau=} must be positive (natural-log units; default 64.0)")
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


def _pad_axis(x, axis, multiple=None, *, to=None, value=0):
  """x zero-padded along `axis` to a multiple of `multiple` (or to length `to`)."""
  pad = (to - x.shape[axis]) if to is not None else -x.shape[axis] % multiple
  if not pad:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, pad)
  return jnp.pad(x, widths, constant_values=value)


def _pad_seq(x, multiple, value=0):
  return _pad_axis(x, 1, multiple, value=value)


def _empty_attention(q, return_stats):
  """Zero-length queries or keys: every row sees no key, so the output is 0 (and so is every gradient)."""
  out = jnp.zeros_like(q)
  if not return_stats:
    return out
  none = jnp.zeros((q.shape[0], q.shape[2], 0), bool)
  return out, AttentionStats(none, jnp.zeros(()), jnp.zeros(q.shape[2]))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attend(static: _Static, q, k, v, segment_ids, stab):
  """(out, certified tiles or None). stab: a Certificate, KeyBounds (in-kernel certificate) or None."""
  return _attend_fwd(static, q, k, v, segment_ids, stab)[0]


def _forward(static, q, k, v, segment_ids, stab):
  backend = BACKENDS[static.backend]()
  kw = dict(causal=static.causal, scale=static.scale, kv_len=static.kv_len, block_sizes=static.block_sizes,
            window=static.window, softcap=static.softcap, interpret=static.interpret)
  if isinstance(stab, certificate.KeyBounds):
    return backend.forward(q, k, v, segment_ids, None, keys=stab, seq_len=static.seq_len, **kw)
  return backend.forward(q, k, v, segment_ids, stab, **kw)


def _attend_fwd(static, q, k, v, segment_ids, stab):
  o, lse, tiles = _forward(static, q, k, v, segment_ids, stab)
  return (o, tiles), (q, k, v, segment_ids, stab, o, lse)


def _attend_bwd(static, residuals, cotangents):
  q, k, v, segment_ids, stab, o, lse = residuals
  do, _ = cotangents  # the certified-tile flags carry no gradient
  backend = BACKENDS[static.backend]()
  dq, dk, dv = backend.backward(q, k, v, segment_ids, o, lse, do, causal=static.causal, scale=static.scale,
                                kv_len=static.kv_len, block_sizes=static.block_sizes, window=static.window,
                                softcap=static.softcap, interpret=static.interpret)
  zero_stab = jax.tree.map(lambda x: jnp.zeros_like(x) if jnp.issubdtype(x.dtype, jnp.floating) else None, stab)
  return dq, dk, dv, None, zero_stab


_attend.defvjp(_attend_fwd, _attend_bwd)


def _xla_attention(q, k, v, segment_ids: masks.SegmentIds | None, *, causal, scale, window, softcap):
  """Dense attention under the same mask convention (rows that see no key return 0): jax.nn's, or
  with a soft cap the same in plain jnp (jax.nn has no soft cap)."""
  q_pos, k_pos = jnp.arange(q.shape[1]), jnp.arange(k.shape[1])
  if segment_ids is None:
    mask = masks.visible(q_pos, k_pos, None, None, causal=causal, kv_len=None, window=window)
    mask = None if mask is None else mask[None, None]
  else:
    mask = jax.vmap(lambda qs, ks: masks.visible(q_pos, k_pos, qs, ks, causal=causal, kv_len=None, window=window))(
        segment_ids.q, segment_ids.kv)[:, None]
  if softcap is None:
    out = jax.nn.dot_product_attention(q, k, v, mask=mask, scale=scale, implementation="xla")
  else:
    group = q.shape[2] // k.shape[2]
    s = jnp.einsum("bqhd,bkhd->bhqk", q, jnp.repeat(k, group, axis=2), preferred_element_type=jnp.float32)
    s = softcap * jnp.tanh(s * scale / softcap)
    p = jax.nn.softmax(s if mask is None else jnp.where(mask, s, -jnp.inf), axis=-1)
    out = jnp.einsum("bhqk,bkhd->bqhd", p.astype(v.dtype), jnp.repeat(v, group, axis=2),
                     preferred_element_type=jnp.float32).astype(q.dtype)
  if mask is not None:
    out = jnp.where(jnp.moveaxis(mask.any(-1), 1, 2)[..., None], out, 0)
  return out


def attention(q, k, v, segment_ids=None, *, causal=True, scale=None, local_window_size=None, logits_soft_cap=None,
              stabilizer="clis", granularity="tile", tau=64.0, bound="radius", implementation=None, block_sizes=None,
              interpret=False, return_stats=False):
  """CLiS attention. q [B, S, Hq, D]; k, v [B, S, Hkv, D] with Hq a multiple of Hkv.

  segment_ids: [B, S] int for packed sequences; a query sees keys of its own id only, and
    id 0 marks padding (such rows return 0). Or `SegmentIds(q=[B, Sq], kv=[B, Sk])` when queries
    and keys are padded differently (bidirectional only: cross-attention, decode).
  local_window_size: jax.nn's: an int w (query i sees keys i − w .. i + w) or (left, right); with
    causal=True the right side is 0. Needs equal q and k lengths.
  logits_soft_cap: c, logits become c·tanh(s / c) (Gemma 2, tokamax); the certificate then holds
    for every tile whenever c <= tau / 2 (stabilizer.py).
  stabilizer: "clis" (fixed certified stabilizer, online fallback per tile or head) or
    "online" (the same kernel's online softmax: the speed baseline).
  granularity: "tile" (batch, head, q-block) or "head" (batch, head) certification.
  tau: cap on the certified gap U − L between a row's bound and its lower bound, in
    natural-log units (the dtype's own limit h + T from stabilizer.py applies too).
  bound: "radius" (one centre and per-tile radius from a K/V pre-pass; kernels certify in their
    prologue) or "blocks" (per-block centres, exceptional keys scored exactly, the row's own block
    scored exactly: holds on sinks and RoPE-rotated outlier channels; an XLA pre-pass over q and K,
    stabilizer.certify_blocks).
  implementation: None (TPU → "pallas_tpu"; NVIDIA Hopper with bf16/f16 and D 64 or 128 →
    "pallas_mgpu", the fastest forward and backward on an H200; other NVIDIA GPUs or inputs →
    "pallas_gpu"; CPU → "reference"), or one of "pallas_tpu", "pallas_gpu", "pallas_mgpu",
    "reference", "xla".
  block_sizes: the backend's BlockSizes dataclass (default: its heuristics).
  interpret: run a Pallas backend in Pallas interpret mode (on the CPU).
  Returns the output shaped like q, and with return_stats=True also an AttentionStats.
  """
  _validate(q, k, v, segment_ids, causal, stabilizer, granularity, tau, local_window_size, logits_soft_cap, bound)
  separate_ids = isinstance(segment_ids, masks.SegmentIds)
  segment_ids = masks.segment_ids_of(segment_ids)
  window = masks.as_window(local_window_size, causal=causal)
  softcap = None if logits_soft_cap is None else float(logits_soft_cap)
  impl = _resolve_implementation(implementation, interpret, q, window is not None or softcap is not None)
  scale = float(scale) if scale is not None else 1.0 / math.sqrt(q.shape[-1])
  if 0 in q.shape or 0 in k.shape:
    return _empty_attention(q, return_stats)
  if impl == "xla":
    if block_sizes is not None:
      raise ValueError("block_sizes has no meaning for implementation='xla'; leave it None")
    out = _xla_attention(q, k, v, segment_ids, causal=causal, scale=scale, window=window, softcap=softcap)
    if not return_stats:
      return out
    none = jnp.zeros((q.shape[0], q.shape[2], 1), bool)
    return out, AttentionStats(none, jnp.zeros(()), jnp.zeros(q.shape[2]))

  backend = BACKENDS[impl]()
  if (window is not None or softcap is not None) and not backend.window_and_soft_cap:
    raise ValueError(f"implementation={impl!r} has no local window or logits soft cap; use 'pallas_gpu' "
                     "(or implementation=None, which picks it)")
  seq_len, kv_seq_len = q.shape[1], k.shape[1]
  if block_sizes is None:
    block_sizes = backend.default_block_sizes(q.shape[-1], max(seq_len, kv_seq_len), q.dtype)
  elif not isinstance(block_sizes, backend.block_sizes_type):
    raise ValueError(f"block_sizes for implementation={impl!r} must be "
                     f"{backend.block_sizes_type.__module__}.BlockSizes; got {type(block_sizes).__name__}")
  multiple, head_dim = block_sizes.multiple, backend.padded_head_dim(q.shape[-1])
  qp, kp, vp = (_pad_seq(_pad_axis(x, 3, to=head_dim), multiple) for x in (q, k, v))
  segp = None if segment_ids is None else jax.tree.map(lambda x: _pad_seq(x.astype(jnp.int32), multiple), segment_ids)
  needs_kv_mask = kp.shape[1] != kv_seq_len and not causal and segment_ids is None
  static = _Static(impl, bool(causal), scale, kv_seq_len if needs_kv_mask else None, seq_len, block_sizes,
                   bool(interpret), window, softcap)

  stab = None
  if stabilizer == "clis" and bound == "blocks":
    stab = certificate.certify_blocks(qp, kp, vp, segp, causal=causal, scale=scale, tau=float(tau),
                                      granularity=granularity, block_q=block_sizes.tile, seq_len=seq_len,
                                      kv_seq_len=kv_seq_len, window=window, separate_ids=separate_ids, softcap=softcap)
  elif stabilizer == "clis":
    stab = certificate.key_bounds(kp, vp, segp, causal=causal, tau=float(tau), block_q=block_sizes.tile,
                                  seq_len=kv_seq_len, separate_ids=separate_ids, window=window)
    # Kernels certify in their prologue with the row's own key as lower bound; separate ids need the
    # XLA certificate's segment-mean lower bound instead.
    if granularity == "head" or not backend.certifies_in_kernel or separate_ids:
      stab = certificate.certify_rows(qp, kp, segp, stab, causal=causal, scale=scale, granularity=granularity,
                                      block_q=block_sizes.tile, seq_len=seq_len, separate_ids=separate_ids,
                                      window=window, softcap=softcap)
  out, tiles = _attend(static, qp, kp, vp, segp, stab)
  out = out[:, :seq_len, :, :q.shape[-1]]
  if not return_stats:
    return out
  if tiles is None:
    tiles = jnp.zeros((q.shape[0], q.shape[2], qp.shape[1] // block_sizes.tile), bool)
  frac = tiles.astype(jnp.float32)
  return out, AttentionStats(tiles, frac.mean(), frac.mean(axis=(0, 2)))
