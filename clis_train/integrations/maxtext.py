"""`attention=clis` inside MaxText itself, without forking it.

    from clis_train.integrations import maxtext as clis_maxtext
    clis_maxtext.install()   # then run MaxText as usual with attention=clis (or clis_online)

or, with MaxText's own entry points untouched, from the command line:

    python -m clis_train.integrations.maxtext maxtext.trainers.pre_train.train \
        maxtext/configs/base.yml attention=clis ...

`install()` wraps `maxtext.layers.attention_op.AttentionOp.apply_attention` once: for
`attention_kernel` "clis" / "clis_online" it calls `clis_kernels.attention` (the platform's
backend, as clis_kernels/plan.py picks it) and returns what MaxText's flash paths return; every other
value goes to MaxText's own code unchanged. MaxText's decoder segment ids are passed as
packed segments (never a dense [B, 1, S, S] mask), its [batch, length, heads, head_dim]
layout and GQA heads go through as they are, and its query arrives pre-scaled (scale 1,
as MaxText's GPU flash path passes). On a mesh of several devices the kernel runs under
`jax.shard_map` with MaxText's own logical-axis rules for batch and heads. Modes whose
numerics we do not implement fail with one clear error instead of silently changing them.
"""

from __future__ import annotations

import functools
import math
import runpy
import sys

import jax
from jax.sharding import PartitionSpec as P

from clis_kernels import SegmentIds
from clis_kernels import attention as clis_attention
from clis_kernels import context_parallel
from clis_train.config import MAXTEXT_ATTENTIONS

KERNELS = MAXTEXT_ATTENTIONS  # MaxText attention value -> our stabilizer (the vocabulary: clis_train/config.py)
LOG_TAG = "[clis_train]"  # each traced attention call logs one line with it (so a run shows the kernel ran)


def _unsupported(op, key, model_mode, kw) -> str | None:
  """Why this call cannot run on CLiS, or None."""
  from maxtext.common.common_types import MODEL_MODE_AUTOREGRESSIVE, AttentionType
  from maxtext.inference.kvcache import KVTensor

  if model_mode == MODEL_MODE_AUTOREGRESSIVE:
    return "autoregressive decoding (use attention=dot_product for decode; clis serves training and prefill)"
  if op.attention_type not in (AttentionType.GLOBAL, AttentionType.FULL, AttentionType.LOCAL_SLIDING):
    return (f"attention_type={op.attention_type.value} (clis supports global causal, local sliding and full "
            "bidirectional attention)")
  checks = {
      "record_max_logits": bool(kw.get("record_max_logits")),
      "use_ragged_attention": bool(kw.get("use_ragged_attention")),
      "previous_chunk (chunked prefill)": kw.get("previous_chunk") is not None,
      "bidirectional_mask": kw.get("bidirectional_mask") is not None,
      "indexer_mask": kw.get("indexer_mask") is not None,
      "compressed_mask": kw.get("compressed_mask") is not None,
      "decoder_segment_ids_kv with causal attention": (kw.get("decoder_segment_ids_kv") is not None
                                                       and op.attention_type != AttentionType.FULL),
      "quantized KV (KVTensor)": isinstance(key, KVTensor),
      "dropout_rate > 0": getattr(op, "dropout_rate", 0.0) > 0.0,
  }
  bad = [name for name, present in checks.items() if present]
  return None if not bad else ", ".join(bad)


def _attend(op, query, key, value, segment_ids, stabilizer: str, kv_segment_ids=None, sinks=None):
  """clis_kernels.attention on MaxText's [B, S, H, D] tensors, under shard_map on a multi-device mesh.
  LOCAL_SLIDING is MaxText's causal window (key j seen by row i when i − W < j <= i); the soft cap
  applies to the pre-scaled logits, as MaxText's own paths do; `sinks` [Hq] (gpt-oss) are one more logit per
  head, as in MaxText's dot_product; v may have its own head dim (MLA)."""
  from maxtext.common.common_types import BATCH_ATTN, D_KV, HEAD, LENGTH, AttentionType

  causal = op.attention_type != AttentionType.FULL
  window = (op.sliding_window_size - 1, 0) if op.attention_type == AttentionType.LOCAL_SLIDING else None
  if window is not None and window[0] < 0:
    raise ValueError(f"sliding_window_size={op.sliding_window_size} must be at least 1 for attention=clis")
  cap = getattr(op, "attn_logits_soft_cap", None) or None

  def local(q, k, v, seg, kv_seg=None, sinks=sinks):
    ids = seg if kv_seg is None else SegmentIds(seg, kv_seg)
    return clis_attention(q, k, v, ids, causal=causal, scale=1.0, stabilizer=stabilizer, local_window_size=window,
                          logits_soft_cap=cap, sinks=sinks)

  mesh = op.mesh
  if mesh is None or mesh.size == 1:
    return local(query, key, value, segment_ids)
  qkv = P(*op._logical_to_mesh_axes((BATCH_ATTN, LENGTH, HEAD, D_KV)))
  shards = lambda spec: math.prod(mesh.shape[a] for a in (() if spec is None else spec if isinstance(spec, tuple)
                                                           else (spec,)))
  if shards(qkv[1]) > 1:
    return _context_parallel(op, mesh, qkv, query, key, value, segment_ids, stabilizer, causal=causal,
                             window=window, cap=cap, kv_segment_ids=kv_segment_ids, sinks=sinks)
  head_shards = shards(qkv[2])
  if key.shape[2] % head_shards:
    raise ValueError(f"attention=clis shards kv heads over {qkv[2]!r}: num_kv_heads={key.shape[2]} must be a "
                     f"multiple of {head_shards}")
  seg_spec = P(qkv[0], None)
  if sinks is not None:  # per query head: sharded as the heads are
    ids = () if segment_ids is None else (segment_ids,) + (() if kv_segment_ids is None else (kv_segment_ids,))
    with_sinks = lambda q, k, v, s, *ids: local(q, k, v, *(ids or (None,)), sinks=s)
    fn = jax.shard_map(with_sinks, mesh=mesh, in_specs=(qkv, qkv, qkv, P(qkv[2])) + (seg_spec,) * len(ids),
                       out_specs=qkv)
    return fn(query, key, value, sinks, *ids)
  if segment_ids is None:
    fn = jax.shard_map(lambda q, k, v: local(q, k, v, None), mesh=mesh, in_specs=(qkv,) * 3, out_specs=qkv)
    return fn(query, key, value)
  if kv_segment_ids is not None:
    fn = jax.shard_map(local, mesh=mesh, in_specs=(qkv, qkv, qkv, seg_spec, seg_spec), out_specs=qkv)
    return fn(query, key, value, segment_ids, kv_segment_ids)
  fn = jax.shard_map(local, mesh=mesh, in_specs=(qkv, qkv, qkv, seg_spec), out_specs=qkv)
  return fn(query, key, value, segment_ids)


def _context_parallel(op, mesh, qkv, query, key, value, segment_ids, stabilizer, *, causal, window, cap,
                      kv_segment_ids, sinks):
  """MaxText's context parallelism (the length sharded over one mesh axis) through
  clis_kernels.context_parallel: its dual-chunk-swap order when the input pipeline reordered the batch for this
  many shards (`context_parallel_load_balance`), else the natural order; its ring or all_gather strategy."""
  from maxtext.common.common_types import ReorderStrategy
  from maxtext.utils import max_utils

  config = op.config
  axes = [a for a in ((qkv[1],) if isinstance(qkv[1], str) else qkv[1]) if mesh.shape[a] > 1]
  axis = axes[0]
  strategy = str(config.context_parallel_strategy).lower()
  refused = {f"the length sharded over several mesh axes {axes}": len(axes) != 1,
             f"context_parallel_strategy={strategy!r} (clis takes ring and all_gather)":
                 strategy not in context_parallel.STRATEGIES,
             "the striped reorder strategy": config.context_parallel_reorder_strategy == ReorderStrategy.STRIPED,
             "a sliding window": window is not None, "learned sinks": sinks is not None,
             "separate key segment ids": kv_segment_ids is not None}
  bad = [name for name, present in refused.items() if present]
  if bad:
    raise NotImplementedError(f"attention={op.attention_kernel} with context parallelism does not support "
                              f"{', '.join(bad)}")
  shards = mesh.shape[axis]
  layout = "zigzag" if max_utils.reordered_cp_size(config, mesh) == shards else "contiguous"
  run = lambda q, k, v, seg=None: context_parallel.context_parallel_attention(
      q, k, v, seg, axis_name=axis, causal=causal, scale=1.0, logits_soft_cap=cap, stabilizer=stabilizer,
      strategy=strategy, layout=layout)
  if segment_ids is None:
    return jax.shard_map(run, mesh=mesh, in_specs=(qkv,) * 3, out_specs=qkv)(query, key, value)
  return jax.shard_map(run, mesh=mesh, in_specs=(qkv,) * 3 + (P(qkv[0], qkv[1]),), out_specs=qkv)(
      query, key, value, segment_ids)


def install() -> None:
  """Makes MaxText's AttentionOp dispatch attention=clis|clis_online to clis_kernels (idempotent)."""
  from maxtext.layers import attention_op

  cls = attention_op.AttentionOp
  if getattr(cls.apply_attention, "_clis_installed", False):
    return
  original = cls.apply_attention

  @functools.wraps(original)
  def apply_attention(self, query, key, value, decoder_segment_ids, segment_positions, lengths, model_mode,
                      *args, **kwargs):
    if self.attention_kernel not in KERNELS:
      return original(self, query, key, value, decoder_segment_ids, segment_positions, lengths, model_mode, *args,
                      **kwargs)
    if args:
      raise TypeError("clis_train.integrations.maxtext: pass apply_attention's optional arguments by keyword, as "
                      "MaxText's AttentionOp.__call__ does")
    reason = _unsupported(self, key, model_mode, kwargs)
    if reason is not None:
      raise NotImplementedError(f"attention={self.attention_kernel} does not support {reason}")
    self.check_attention_inputs(query, key, value)
    from absl import logging  # MaxText's logger: the line shows in its console output
    logging.info("%s attention=%s: clis_kernels.attention, q %s, kv heads %d", LOG_TAG, self.attention_kernel,
                 tuple(query.shape), key.shape[-2])
    out = _attend(self, query, key, value, decoder_segment_ids, KERNELS[self.attention_kernel],
                  kwargs.get("decoder_segment_ids_kv"), kwargs.get("sinks"))
    return out, None, None  # normalised output, as MaxText's flash paths return

  apply_attention._clis_installed = True
  cls.apply_attention = apply_attention


def main(argv: list[str] | None = None) -> None:
  """`python -m clis_train.integrations.maxtext MODULE ARGS...`: install(), then run MODULE as
  __main__ with sys.argv = [MODULE, ARGS...] (MaxText's train scripts read their config from it)."""
  argv = sys.argv[1:] if argv is None else argv
  if not argv or argv[0].startswith("-"):
    raise SystemExit("usage: python -m clis_train.integrations.maxtext MODULE [ARGS...], e.g. "
                     "maxtext.trainers.pre_train.train maxtext/configs/base.yml attention=clis")
  install()
  sys.argv = list(argv)
  runpy.run_module(argv[0], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
  main()
