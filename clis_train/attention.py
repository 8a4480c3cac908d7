"""The one place where `attention:` becomes a function the model calls.

clis / online → clis_kernels.attention (the platform's kernel: Mosaic GPU on Hopper for bf16/f16,
Triton on other NVIDIA GPUs, Mosaic TPU on TPUs, the reference on CPU);
clis_mgpu / online_mgpu → the Mosaic GPU kernels by name (Hopper only; an error elsewhere);
dot_product → dense XLA under the same segment convention; cudnn → jax.nn's cuDNN
kernel (NVIDIA only); tokamax → tokamax's Mosaic GPU flash attention (its XLA op off GPUs).
On a mesh of more than one device the kernel runs under `jax.shard_map`, batch over (data, fsdp) and heads over
tensor: Pallas kernels are not partitioned by XLA. With a `context` axis of more than one device each sequence is
split over it (zig-zag order) and clis / online run clis_kernels.context_parallel; otherwise every call sees whole
sequences.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from clis_kernels import attention as clis_attention
from clis_kernels import context_parallel
from clis_kernels import masks
from clis_train.config import ATTENTIONS

BATCH_AXES = ("data", "fsdp")


def _cudnn(q, k, v, segment_ids, window=None, *, implementation="cudnn"):
  """jax.nn.dot_product_attention under the trainer's convention: causal within packed documents, `window` keys
  before each query (None: all), padding (id 0) zeroed. The mask is [B, 1, S, S] booleans: jax.nn takes packed
  documents and a window together only as a mask. implementation=None runs XLA (for tests off GPUs)."""
  local = None if window is None else (window, 0)
  seg = jax.vmap(lambda s: masks.visible(jnp.arange(s.shape[0]), jnp.arange(s.shape[0]), s, s, causal=True,
                                         kv_len=None, window=local))(segment_ids)
  out = jax.nn.dot_product_attention(q, k, v, mask=seg[:, None], implementation=implementation)
  return jnp.where((segment_ids != 0)[:, :, None, None], out, 0).astype(q.dtype)


def _document_starts(segment_ids):
  """[B, S] segment ids -> [B, S] int32: the position of the first token of each token's document (packed
  documents are contiguous runs of one id)."""
  pos = jnp.arange(segment_ids.shape[1], dtype=jnp.int32)
  new = jnp.concatenate([jnp.ones_like(segment_ids[:, :1], bool), segment_ids[:, 1:] != segment_ids[:, :-1]], 1)
  return jax.lax.cummax(jnp.where(new, pos, 0), axis=1)


def tokamax_documents(q, k, v, segment_ids, *, on_gpu: bool, window=None, softcap=None):
  """Causal attention within packed documents through tokamax: its ops take a mask whose rows each see keys
  [k_start, row] (tokamax's own example of independent causal sequences), so no [S, S] array is built; a sliding
  window raises k_start to row − window. Padding tokens (id 0) form one more document whose outputs are zeroed,
  as every other backend does."""
  try:  # tokamax 0.0.17 exports neither Mask (the ops' mask type) nor, without jax_triton, the op via tokamax.ops.gpu
    from tokamax._src.ops.attention import base, pallas_mosaic_gpu
  except ImportError as e:
    raise ValueError("attention='tokamax' needs tokamax (`pip install tokamax`, or the maxtext extra): "
                     f"{e}") from e
  op = pallas_mosaic_gpu.PallasMosaicGpuFlashAttention() if on_gpu else base.DotProductAttention()
  k_start = _document_starts(segment_ids)
  if window is not None:
    k_start = jnp.maximum(k_start, jnp.arange(segment_ids.shape[1], dtype=jnp.int32) - window)
  out = op(q, k, v, mask=base.Mask(k_start=k_start[:, None, :], is_causal=True), logits_soft_cap=softcap)
  return jnp.where((segment_ids != 0)[:, :, None, None], out, 0).astype(q.dtype)


UNSUPPORTED = {  # attention -> the model options it does not take (sliding window, soft cap, learned sinks)
    "cudnn": ("soft cap", "sinks"),  # jax.nn.dot_product_attention takes neither
    "tokamax": ("sinks",),
}
COMBINING = ("clis", "online", "clis_mgpu", "online_mgpu")  # what context parallelism runs


def unsupported(name: str, *, window=None, softcap=None, sinks=False, context: int = 1) -> str | None:
  """Why `attention=name` cannot run these options (a sentence naming them and what to use), or None."""
  asked = {"sliding window": window is not None, "soft cap": softcap is not None, "sinks": bool(sinks)}
  missing = [o for o in UNSUPPORTED.get(name, ()) if asked[o]]
  if context > 1:
    missing += [o for o in ("sliding window", "sinks") if asked[o] and o not in missing]
  if not missing:
    return None
  where = f"attention={name!r}" + (f" with mesh.context={context}" if context > 1 else "")
  return (f"{where} takes no {' or '.join(missing)}; use attention=clis, online or dot_product"
          + (" on a mesh without a context axis" if context > 1 else ""))


def make_attention(name: str, mesh: jax.sharding.Mesh | None, *, granularity: str = "tile", platform=None,
                   context_strategy: str = "ring"):
  """Returns attend(q, k, v, segment_ids, sinks=None, *, window=None, softcap=None) -> (out [B,S,Hq,Dv],
  certified_fraction scalar). One jitted function per (window, softcap, sinks or not): every layer of one kind
  then calls one traced and lowered function, so the step's module holds each kernel once instead of once per
  layer (compile time: notes/kernels.md, round 7). window: keys before each query a sliding window keeps (None:
  all); softcap: logits become c·tanh(s / c); sinks: [Hq] learned sink logits. platform: a
  clis_kernels.plan.Platform to plan the kernels for (default: this machine's). context_strategy: "ring" or
  "all_gather", where the mesh has a context axis of more than one device."""
  context = 1 if mesh is None else dict(mesh.shape).get("context", 1)
  if name not in ATTENTIONS:
    raise ValueError(f"attention={name!r} must be one of {', '.join(ATTENTIONS)}")
  if name == "cudnn" and jax.devices()[0].platform != "gpu":
    raise ValueError(f"attention='cudnn' needs an NVIDIA GPU; this platform is {jax.devices()[0].platform!r}: "
                     "use attention=clis, online or dot_product")
  if context > 1 and name not in COMBINING:
    raise ValueError(f"attention={name!r} sees whole sequences; a mesh with context={context} needs clis or online")
  on_gpu = (platform.name if platform is not None else jax.devices()[0].platform) == "gpu"

  def kernel(q, k, v, seg, sinks, *, window, softcap):
    local = None if window is None else (window, 0)
    if name in COMBINING:
      stabilizer, _, backend = name.partition("_")
      implementation = "pallas_mgpu" if backend else None  # *_mgpu: the Mosaic GPU kernels (Hopper)
      if context > 1:
        out, stats = context_parallel.context_parallel_attention(
            q, k, v, seg, axis_name="context", causal=True, logits_soft_cap=softcap, stabilizer=stabilizer,
            strategy=context_strategy, implementation=implementation, return_stats=True, platform=platform)
      else:
        out, stats = clis_attention(q, k, v, seg, causal=True, local_window_size=local, logits_soft_cap=softcap,
                                    sinks=sinks, stabilizer=stabilizer, granularity=granularity,
                                    implementation=implementation, return_stats=True, platform=platform)
      return out, stats.certified_fraction
    none = jnp.zeros((), jnp.float32)
    if name == "dot_product":
      return clis_attention(q, k, v, seg, causal=True, local_window_size=local, logits_soft_cap=softcap,
                            sinks=sinks, implementation="xla"), none
    if name == "cudnn":
      return _cudnn(q, k, v, seg, window), none
    return tokamax_documents(q, k, v, seg, on_gpu=on_gpu, window=window, softcap=softcap), none

  @functools.cache
  def compiled(window, softcap, with_sinks):
    problem = unsupported(name, window=window, softcap=softcap, sinks=with_sinks, context=context)
    if problem:
      raise ValueError(problem)
    run = functools.partial(kernel, window=window, softcap=softcap)
    if mesh is None or mesh.size == 1:
      return jax.jit(run)
    sequence = "context" if context > 1 else None
    heads = P(BATCH_AXES, sequence, "tensor", None)
    axes = tuple(a for a in mesh.axis_names if a != "context" or context > 1)

    @functools.partial(jax.shard_map, mesh=mesh, in_specs=(heads, heads, heads, P(BATCH_AXES, sequence),
                                                           P("tensor") if with_sinks else None),
                       out_specs=(heads, P()))
    def sharded(q, k, v, seg, sinks):
      out, certified = run(q, k, v, seg, sinks)
      return out, jax.lax.pmean(certified, axes)

    return jax.jit(sharded)

  def attend(q, k, v, segment_ids, sinks=None, *, window=None, softcap=None):
    return compiled(window, softcap, sinks is not None)(q, k, v, segment_ids, sinks)

  return attend
