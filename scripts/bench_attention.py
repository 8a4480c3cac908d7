"""Kernel-level attention throughput: our `clis` and `online` against cuDNN, dense XLA, tokamax, splash.

`clis` is the API's default call (the plan picks the backend, online below the certifying length,
and the bound); `clis_radius` / `clis_blocks` / `clis_cap` (with --softcap: the cap alone bounds every logit)
force a bound; `clis_mgpu` names the Mosaic GPU backend
(it certifies at every length). Each certifying variant's certified fraction is recorded.

`clis_prepass` times the pre-pass alone (clis time = pre-pass + kernel): on GPUs the pass over
K and V (`stabilizer.key_bounds`; the kernel certifies its tiles), elsewhere the whole XLA certificate.
Alone it is host-dispatch bound for small inputs; `clis_kernel` (GPU) times the Triton forward with
the pre-pass computed beforehand, so clis − clis_kernel is what the pre-pass costs inside the call.
Cases (--suite): `llm` — causal, Hq=32, Hkv=8, D=128, S in --seq-lens, with and without packed
segments (4 documents per row); `dit` — bidirectional, H in {12, 40}, D=128, S in {16384, 32768,
75600}. Passes: fwd and fwd_bwd. Every variant of a case is timed round-robin (A B C A B C ...),
each sample `--inner` back-to-back calls, median of `--repeats` (clis_train/benchmarking.py).
Implementations that the platform lacks are skipped with a note: cuDNN needs an NVIDIA GPU,
tokamax must be installed, splash attention needs a TPU, dense XLA must fit in --xla-max-gb.
TFLOP/s use 4·B·Hq·S²·D (half when causal; packed cases count the same nominal work), ×3.5
for forward+backward. Writes JSON records, a markdown table and a PNG plot (same file stem).
--value-dim DV gives the llm suite's v (and dO) DV columns where q and k have D (MLA: --llm-heads 16 16 192
--value-dim 128); TFLOP/s then count 2·B·Hq·S²·(D + DV).
--window W / --softcap C give every case jax.nn's local_window_size=W and logits_soft_cap=C (Gemma 2,
Mistral); the implementations in FEATURED take them (cuDNN the window only: with a cap it is skipped).
--sinks MEAN gives our implementations (and `xla`, the dense jnp path MaxText's dot-product attention matches)
learned per-head sink logits (gpt-oss), MEAN plus a standard normal per query head; cuDNN and tokamax take none,
so their rows time the call without the sink term (records say `sinks: null`): less work than ours.

  python scripts/bench_attention.py --suite llm --seq-lens 8192 --out benchmarks/results/x.json
  python scripts/bench_attention.py --quick --out /tmp/quick.json     # tiny, CPU, interpret mode
"""

from __future__ import annotations

import argparse
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from clis_kernels import api, attention, masks, pallas_mgpu, pallas_mgpu_vjp, stabilizer, testing
from clis_kernels import plan as plan_lib
from clis_train import benchmarking


def _inputs(b, s, hq, hkv, d, packed, seed=0, family="gaussian", dtype=jnp.bfloat16, doc_len=None):
  """q, k, v, do, segment ids: Gaussian keys with a shared component, or one of clis_kernels.testing's
  families shaped like a pretrained model's activations (RoPE, sinks, outlier channels). Packed rows hold
  4 documents, or documents of 1 to 2·doc_len tokens (a training batch's) when doc_len is given."""
  if packed and doc_len:
    lengths = np.random.default_rng(seed).integers(1, 2 * doc_len, size=(b, s))
    seg = jnp.asarray(np.stack([np.repeat(np.arange(1, s + 1), n)[:s] for n in lengths]), jnp.int32)
    return (*_inputs(b, s, hq, hkv, d, False, seed, family, dtype)[:4], seg)
  if family != "gaussian":
    q, k, v, do, seg = testing.inputs(family, b, s, hq, hkv, d, seed=seed)
    return q, k, v, do, (seg if seg is not None or not packed else _inputs(b, s, hq, hkv, d, True, seed)[4])
  kq, kk, kv, kd, kc = jax.random.split(jax.random.PRNGKey(seed), 5)
  q = jax.random.normal(kq, (b, s, hq, d), dtype)
  k = (jax.random.normal(kk, (b, s, hkv, d)) + jax.random.normal(kc, (1, 1, hkv, d))).astype(dtype)
  v = jax.random.normal(kv, (b, s, hkv, d), dtype)
  do = jax.random.normal(kd, (b, s, hq, d), dtype)
  seg = None
  if packed:
    cuts = np.sort(np.random.default_rng(seed).choice(np.arange(1, s), 3, replace=False))
    seg = jnp.asarray(np.searchsorted(cuts, np.arange(s), side="right")[None].repeat(b, 0) + 1, jnp.int32)
  return q, k, v, do, seg


def _tokamax(implementation):
  import tokamax  # optional
  return lambda q, k, v, seg, causal, **kw: tokamax.dot_product_attention(q, k, v, is_causal=causal,
                                                                           implementation=implementation, **kw)


def _tokamax_grid(persistent: bool):
  """tokamax's Mosaic GPU forward with its grid chosen: persistent (one CTA per SM walking (head, q tile) pairs, what
  its heuristics pick for masks other than plain causal, windows included) or one CTA per q tile. The other tunables
  are its heuristics' (block_q 64, 128 keys a block below head dim 256 and 64 at 256, two stages): which part of its
  lead at windowed head dim 256 the persistent grid gives (notes/kernels.md, "Next device runs")."""
  from tokamax._src.ops.attention import pallas_mosaic_gpu as tk  # optional
  def run(q, k, v, seg, causal, **kw):
    config = tk.ConfigSM90(block_q=64, block_kv=128 if q.shape[-1] < 256 else 64, num_stages=2, persistent=persistent)
    return _tokamax((tk.PallasMosaicGpuFlashAttention(config=config),))(q, k, v, seg, causal, **kw)
  return run


def _splash(q, k, v, seg, causal):
  """Splash attention (TPU only): [B, S, H, D] in, kernels built per call shape."""
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm
  b, s, hq, d = q.shape
  mask = sm.CausalMask((s, s)) if causal else sm.FullMask((s, s))
  kernel = sk.make_splash_mqa_single_device(mask=sm.MultiHeadMask([mask] * hq)) if k.shape[2] == 1 else \
      sk.make_splash_mha_single_device(mask=sm.MultiHeadMask([mask] * hq))
  qh = q.transpose(0, 2, 1, 3) * (d ** -0.5)
  kh = jnp.repeat(k, hq // k.shape[2], axis=2).transpose(0, 2, 1, 3)
  vh = jnp.repeat(v, hq // v.shape[2], axis=2).transpose(0, 2, 1, 3)
  ids = None if seg is None else sk.SegmentIds(q=seg, kv=seg)
  return jax.vmap(lambda a, b_, c, i: kernel(a, b_, c, segment_ids=i), in_axes=(0, 0, 0, None if ids is None else 0))(
      qh, kh, vh, ids).transpose(0, 2, 1, 3)


def _plan(q, quick, implementation=None, bound="radius"):
  """The plan `attention` makes for these inputs (quick: the Triton kernel, interpreted)."""
  return plan_lib.make_plan(dtype=q.dtype, head_dim=q.shape[-1], seq_len=q.shape[1], bound=bound,
                            implementation="pallas_gpu" if quick else implementation, interpret=quick)


def _prepass(q, k, v, seg, causal, quick, implementation=None, bound="radius"):
  """The pre-pass of the `clis` call exactly as `attention` runs it (api.stabilizer_input): K/V only
  where the kernel certifies its tiles (Mode.KEYS), else the whole certificate, at the plan's tile
  and padding."""
  plan = _plan(q, quick, implementation, bound)
  pad = lambda x: api.pad_seq(x, plan.multiple)
  segp = None if seg is None else masks.SegmentIds(pad(seg), pad(seg))
  return api.stabilizer_input(plan, pad(q), pad(k), pad(v), segp, causal=causal, scale=q.shape[-1] ** -0.5,
                              tau=stabilizer.default_tau(q.dtype), granularity="tile", seq_len=q.shape[1],
                              kv_seq_len=k.shape[1], window=None, separate_ids=False, softcap=None)


def _clis_kernel(q, k, v, seg, causal, quick):
  """The Triton clis forward alone: inputs padded and K/V pre-pass computed here, outside the timed call."""
  plan = _plan(q, quick, "pallas_gpu")
  bs = plan.block_sizes
  pad = lambda x: api.pad_seq(x, plan.multiple)
  qp, kp, vp = pad(q), pad(k), pad(v)
  segp = None if seg is None else masks.SegmentIds(pad(seg), pad(seg))
  kv_len = k.shape[1] if kp.shape[1] != k.shape[1] and not causal and seg is None else None
  keys = jax.jit(lambda k, v, s: stabilizer.key_bounds(k, v, s, causal=causal, tau=64.0, block_q=bs.tile,
                                                       seq_len=k.shape[1]))(kp, vp, segp)
  run = jax.jit(lambda q, k, v, s, keys: plan.backend.forward(
      q, k, v, s, keys, mode=plan_lib.Mode.KEYS, causal=causal, scale=q.shape[-1] ** -0.5, kv_len=kv_len, block_sizes=bs,
      seq_len=q.shape[1], interpret=quick)[0])
  return lambda: run(qp, kp, vp, segp, keys)


# What takes --window / --softcap (as jax.nn's local_window_size / logits_soft_cap keywords)
FEATURED = ("clis", "online", "clis_blocks", "clis_radius", "clis_cap", "clis_mgpu_cap", "clis_cap_tc_sum",
            "clis_cap_unrounded", "xla",
            "cudnn", "clis_triton", "online_triton", "clis_mgpu",
            "online_mgpu", "clis_mgpu_triton_bwd", "online_mgpu_triton_bwd", "clis_exp2_tanh", "online_exp2_tanh",
            "online_heads1", "online_heads2", "online_heads4", "online_heads8", "tokamax_mosaic", "tokamax_triton",
            "online_four_warps", "clis_mgpu_four_warps", "online_named", "clis_mgpu_named", "clis_cap_named",
            "online_mbarriers", "clis_cap_mbarriers", "clis_mgpu_mbarriers", "online_overlap_bwd", "online_serial_bwd",
            "online_dq_overlap_bwd", "online_twin", "tokamax_persistent", "tokamax_streamed")


SINKLESS = ("cudnn", "tokamax_mosaic", "tokamax_triton", "tokamax_k_start", "tokamax_persistent", "tokamax_streamed",
            "splash")  # entry points with no sinks


def sink_logits(mean: float, heads: int):
  """Learned-sink-like logits [heads] f32 (gpt-oss's per query head): mean plus a standard normal each."""
  return mean + jax.random.normal(jax.random.PRNGKey(7), (heads,), jnp.float32)


def feature_kwargs(window, softcap) -> dict:
  """The keywords a FEATURED implementation takes for the case's window and cap (none when neither is set)."""
  return {**({} if window is None else dict(local_window_size=window)),
          **({} if softcap is None else dict(logits_soft_cap=softcap))}


CERTIFYING = {"clis": {}, "clis_blocks": dict(bound="blocks"), "clis_radius": dict(bound="radius"),
              "clis_cap": dict(bound="cap"), "clis_mgpu_cap": dict(bound="cap", implementation="pallas_mgpu"),
              "clis_cap_tc_sum": dict(bound="cap", implementation="pallas_mgpu"),
              "clis_mgpu": dict(implementation="pallas_mgpu"),
              "clis_triton": dict(implementation="pallas_gpu")}


def _certified_fraction(q, k, v, seg, causal, name, quick, **features):
  """The fraction of tiles a certifying variant ran certified on these inputs."""
  kw = dict(CERTIFYING[name], **features, **(dict(implementation="pallas_gpu", interpret=True) if quick else {}))
  _, stats = jax.jit(lambda q, k, v, seg: attention(q, k, v, seg, causal=causal, return_stats=True, **kw))(q, k, v, seg)
  return float(stats.certified_fraction)


def _named(q, k, v, seg, causal, *, stabilizer, implementation, **kw):
  """Our attention on a named backend."""
  return attention(q, k, v, seg, causal=causal, stabilizer=stabilizer, implementation=implementation, **kw)


def _backward_choice(q, k, v, seg, causal, stabilizer, fused, split=False):
  """The Mosaic GPU backward forced to one kernel (fused; split: each warpgroup half of dQ's head dim) or two,
  whatever the head dim's default, in the serial step order."""
  return attention(q, k, v, seg, causal=causal, stabilizer=stabilizer, backward_block_sizes=pallas_mgpu_vjp.BlockSizes(
      fused_dq=fused, split_dq=split))


def _exp2_tanh(q, k, v, seg, causal, stabilizer, **kw):
  """The Mosaic GPU kernels with the soft cap's float32-accurate tanh (BlockSizes(soft_cap_tanh="exp2"))."""
  return attention(q, k, v, seg, causal=causal, stabilizer=stabilizer, implementation="pallas_mgpu",
                   block_sizes=pallas_mgpu.BlockSizes(soft_cap_tanh="exp2"),
                   backward_block_sizes=pallas_mgpu_vjp.BlockSizes(
                       fused_dq=q.shape[-1] <= pallas_mgpu_vjp.FUSED_MAX_HEAD_DIM, soft_cap_tanh="exp2"), **kw)


def _all_blocks(q, k, v, seg, causal, stabilizer):
  """The Mosaic GPU kernels visiting every causal block of a packed call (BlockSizes(document_ranges=False)),
  as before document ranges were the default."""
  return attention(q, k, v, seg, causal=causal, stabilizer=stabilizer, implementation="pallas_mgpu",
                   block_sizes=pallas_mgpu.BlockSizes(document_ranges=False),
                   backward_block_sizes=pallas_mgpu_vjp.BlockSizes(
                       fused_dq=q.shape[-1] <= pallas_mgpu_vjp.FUSED_MAX_HEAD_DIM, document_ranges=False))


def _kv64(q, k, v, seg, causal, stabilizer):
  """The Mosaic GPU forward at 64-key blocks (the default at head dims padded to 256; MLA's 192 takes 128)."""
  return attention(q, k, v, seg, causal=causal, stabilizer=stabilizer, implementation="pallas_mgpu",
                   block_sizes=pallas_mgpu.BlockSizes(block_kv=64))


def _heads_per_cta(q, k, v, seg, causal, stabilizer, heads, **kw):
  """The Mosaic GPU forward with each CTA walking `heads` query heads of a GQA group (BlockSizes(heads_per_cta)), at
  the head dim's default tiles otherwise."""
  tiles = pallas_mgpu.default_block_sizes(q.shape[-1], q.shape[1], q.dtype)
  return attention(q, k, v, seg, causal=causal, stabilizer=stabilizer, implementation="pallas_mgpu",
                   block_sizes=dataclasses.replace(tiles, heads_per_cta=heads), **kw)


def _forward_tiles(q, k, v, seg, causal, stabilizer, changes: dict, **kw):
  """The Mosaic GPU forward at the head dim's default tiles with `changes` made to them: one_memory_warp=False (the
  whole memory warpgroup streaming blocks, the default before 2026-12-04) or named_barriers True (the default at head dim
  256 since 2026-12-08) or False (mbarriers, the default elsewhere)."""
  tiles = dataclasses.replace(pallas_mgpu.default_block_sizes(q.shape[-1], q.shape[1], q.dtype), **changes)
  return attention(q, k, v, seg, causal=causal, stabilizer=stabilizer, implementation="pallas_mgpu",
                   block_sizes=tiles, **kw)


def _bwd_order(q, k, v, seg, causal, stabilizer, overlap_dq: bool, overlap_dkv: bool, **kw):
  """The default forward with the Mosaic GPU backward at the head dim's default tiles but the given step orders
  (BlockSizes.overlap_dq, overlap_dkv: dP's wgmma issued behind S's in that kernel; dv_with_dp off: dV with dK)."""
  tiles = pallas_mgpu_vjp.default_block_sizes(q.shape[-1], q.shape[1], q.dtype)
  return attention(q, k, v, seg, causal=causal, stabilizer=stabilizer, **kw, backward_block_sizes=dataclasses.replace(
      tiles, overlap_dq=overlap_dq, overlap_dkv=overlap_dkv, dv_with_dp=False))


def _rounded_lse(q, k, v, seg, causal, stabilizer):
  """The Mosaic GPU forward saving lse from the rounded weights' sum (BlockSizes(exact_lse=False)), as before the
  unrounded second sum."""
  return attention(q, k, v, seg, causal=causal, stabilizer=stabilizer, implementation="pallas_mgpu",
                   block_sizes=pallas_mgpu.BlockSizes(exact_lse=False))


def _cap_unrounded(q, k, v, seg, causal, **kw):
  """The soft cap's bound (bound="cap") on the Mosaic GPU forward summing the unrounded weights
  (BlockSizes(exact_sum=False)): tokamax's arithmetic for a capped call (no running max, one unrounded sum), less
  accurate than the default on real activations (BENCHMARKS.md, "the certified loop's normaliser"); for timing only."""
  tiles = pallas_mgpu.default_block_sizes(q.shape[-1], q.shape[1], q.dtype)
  return attention(q, k, v, seg, causal=causal, bound="cap", implementation="pallas_mgpu",
                   block_sizes=dataclasses.replace(tiles, exact_sum=False), **kw)


def _cap_tc_sum(q, k, v, seg, causal, **kw):
  """The soft cap's bound (bound="cap") on the Mosaic GPU forward with the rounded weights' sum on the tensor cores
  (BlockSizes(sum_on_tensor_cores=True))."""
  tiles = pallas_mgpu.default_block_sizes(q.shape[-1], q.shape[1], q.dtype)
  return attention(q, k, v, seg, causal=causal, bound="cap", implementation="pallas_mgpu",
                   block_sizes=dataclasses.replace(tiles, sum_on_tensor_cores=True), **kw)


def _tokamax_k_start(q, k, v, seg, causal):
  """tokamax's Mosaic GPU flash attention with packed documents as per-row first keys (the trainer's
  attention=tokamax; causal only)."""
  from clis_train.attention import tokamax_documents
  if not causal:
    raise ValueError("tokamax_k_start is causal only")
  seg = jnp.ones(q.shape[:2], jnp.int32) if seg is None else seg
  return tokamax_documents(q, k, v, seg, on_gpu=True)


def implementations(names, platform, quick):
  """{name: f(q, k, v, seg, causal)} for the names this platform can run, and notes on the rest."""
  ours = dict(implementation="pallas_gpu", interpret=True) if quick else {}
  table = {  # FEATURED entries take **kw: the case's window and cap
      "clis": lambda q, k, v, seg, causal, **kw: attention(q, k, v, seg, causal=causal, stabilizer="clis", **ours, **kw),
      "online": lambda q, k, v, seg, causal, **kw: attention(q, k, v, seg, causal=causal, stabilizer="online", **ours,
                                                             **kw),
      "clis_blocks": lambda q, k, v, seg, causal, **kw: attention(q, k, v, seg, causal=causal, bound="blocks", **ours,
                                                                  **kw),
      "clis_radius": lambda q, k, v, seg, causal, **kw: attention(q, k, v, seg, causal=causal, bound="radius", **ours,
                                                                  **kw),
      "clis_cap": lambda q, k, v, seg, causal, **kw: attention(q, k, v, seg, causal=causal, bound="cap", **ours, **kw),
      "xla": lambda q, k, v, seg, causal, **kw: attention(q, k, v, seg, causal=causal, implementation="xla", **kw),
      "cudnn": lambda q, k, v, seg, causal, **kw: jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                                                               implementation="cudnn", **kw),
  }
  table["online_twin"] = table["online"]  # the default timed twice: the spread between identical versions (METHOD.md)
  table["clis_prepass"] = functools.partial(_prepass, quick=quick)
  table["clis_blocks_prepass"] = functools.partial(_prepass, quick=quick, bound="blocks")
  if quick or platform == "gpu":
    table["clis_kernel"] = functools.partial(_clis_kernel, quick=quick)
  if platform == "gpu":  # clis / online above are the default (Mosaic GPU on Hopper); these name the kernels
    for stab in ("clis", "online"):
      for name, impl in (("triton", "pallas_gpu"), ("mgpu", "pallas_mgpu")):
        table[f"{stab}_{name}"] = functools.partial(_named, stabilizer=stab, implementation=impl)
    table["clis_mgpu_prepass"] = functools.partial(_prepass, quick=False, implementation="pallas_mgpu")
    table["clis_mgpu_blocks_prepass"] = functools.partial(_prepass, quick=False, implementation="pallas_mgpu",
                                                          bound="blocks")
    for stab in ("clis", "online"):  # the Mosaic GPU forward with the Triton backward
      table[f"{stab}_mgpu_triton_bwd"] = functools.partial(_named, stabilizer=stab,
                                                           implementation="pallas_mgpu_triton_bwd")
    for stab in ("clis", "online"):  # the API's default forward with the one-kernel Mosaic GPU backward
      table[f"{stab}_fused_bwd"] = functools.partial(_backward_choice, stabilizer=stab, fused=True)
      table[f"{stab}_two_kernel_bwd"] = functools.partial(_backward_choice, stabilizer=stab, fused=False)
      table[f"{stab}_split_bwd"] = functools.partial(_backward_choice, stabilizer=stab, fused=True, split=True)
      table[f"{stab}_all_blocks"] = functools.partial(_all_blocks, stabilizer=stab)
      table[f"{stab}_exp2_tanh"] = functools.partial(_exp2_tanh, stabilizer=stab)
      table[f"{stab}_kv64"] = functools.partial(_kv64, stabilizer=stab)
      table[f"{stab}_rounded_lse"] = functools.partial(_rounded_lse, stabilizer=stab)
    table["clis_mgpu_cap"] = functools.partial(_named, stabilizer="clis", implementation="pallas_mgpu", bound="cap")
    table["clis_cap_tc_sum"] = _cap_tc_sum
    table["clis_cap_unrounded"] = _cap_unrounded
    table["online_overlap_bwd"] = functools.partial(_bwd_order, stabilizer="online", overlap_dq=True, overlap_dkv=True)
    table["online_serial_bwd"] = functools.partial(_bwd_order, stabilizer="online", overlap_dq=False, overlap_dkv=False)
    table["online_dq_overlap_bwd"] = functools.partial(_bwd_order, stabilizer="online", overlap_dq=True,
                                                       overlap_dkv=False)
    four_warps, named = dict(one_memory_warp=False), dict(named_barriers=True)
    table["online_four_warps"] = functools.partial(_forward_tiles, stabilizer="online", changes=four_warps)
    table["clis_mgpu_four_warps"] = functools.partial(_forward_tiles, stabilizer="clis", changes=four_warps)
    table["online_named"] = functools.partial(_forward_tiles, stabilizer="online", changes=named)
    table["clis_mgpu_named"] = functools.partial(_forward_tiles, stabilizer="clis", changes=named)
    table["clis_cap_named"] = functools.partial(_forward_tiles, stabilizer="clis", changes=named, bound="cap")
    mbarriers = dict(named_barriers=False)
    table["online_mbarriers"] = functools.partial(_forward_tiles, stabilizer="online", changes=mbarriers)
    table["clis_cap_mbarriers"] = functools.partial(_forward_tiles, stabilizer="clis", changes=mbarriers, bound="cap")
    table["clis_mgpu_mbarriers"] = functools.partial(_forward_tiles, stabilizer="clis", changes=mbarriers)
    for heads in (1, 2, 4, 8):
      table[f"online_heads{heads}"] = functools.partial(_heads_per_cta, stabilizer="online", heads=heads)
    table["tokamax_k_start"] = _tokamax_k_start
    for name, persistent in (("tokamax_persistent", True), ("tokamax_streamed", False)):
      try:
        table[name] = _tokamax_grid(persistent)
      except ImportError:  # noted below as not installed
        pass
  fns, notes = {}, []
  for name in names:
    if name == "cudnn" and platform != "gpu":
      notes.append("cudnn skipped: needs an NVIDIA GPU")
    elif name.startswith("tokamax_") and name not in table:
      try:
        fns[name] = _tokamax(name.removeprefix("tokamax_"))
      except ImportError:
        notes.append(f"{name} skipped: tokamax is not installed")
    elif name == "splash":
      if platform == "tpu":
        fns[name] = _splash
      else:
        notes.append("splash skipped: needs a TPU")
    elif name in table:
      fns[name] = table[name]
    elif "_mgpu" in name:
      notes.append(f"{name} skipped: the Mosaic GPU kernel needs an NVIDIA Hopper GPU")
    else:
      raise SystemExit(f"--impls: unknown implementation {name!r}")
  return fns, notes


QUICK_CASES = 2  # --quick: the first rows of the tests' case table (causal, packed GQA), plus a bidirectional one


def cases(args):
  if args.quick:
    shared = [dict(case=name, b=b, s=s, hq=hq, hkv=hkv, d=d, dtype=dtype, causal=causal, packed=packed,
                   inputs="gaussian") for name, b, s, hq, hkv, d, dtype, causal, packed in testing.CASES[:QUICK_CASES]]
    return shared + [dict(case="quick_bidir_outlier_channels", b=1, s=128, hq=4, hkv=2, d=64, causal=False,
                          packed=False, inputs="outlier_channels")]
  out = []
  both = {"no": [False], "yes": [True], "both": [False, True]}
  batch = lambda s: max(1, args.tokens // s) if args.tokens else args.batch
  if args.suite in ("llm", "all"):
    for family in args.inputs:
      for s in args.seq_lens:
        for causal in both[args.causal]:
          for packed in both[args.packed]:
            hq, hkv, d = args.llm_heads
            heads = "" if (hq, hkv, d) == tuple(testing.LLM_HEADS) else f"_H{hq}-{hkv}_D{d}"
            heads += "" if args.value_dim is None else f"_Dv{args.value_dim}"
            docs = f"_docs{args.doc_len}" if packed and args.doc_len else ""
            feats = (f"_W{args.window}" if args.window is not None else "") + (
                f"_cap{args.softcap:g}" if args.softcap is not None else "") + (
                f"_sinks{args.sinks:g}" if args.sinks is not None else "")
            name = f"llm_{'causal' if causal else 'bidir'}{'_packed' if packed else ''}{docs}{heads}{feats}_S{s}"
            out.append(dict(case=name if family == "gaussian" else f"{name}_{family}", b=batch(s), s=s, hq=hq, hkv=hkv,
                            d=d, dv=args.value_dim or d, causal=causal, packed=packed, inputs=family))
  if args.suite in ("dit", "all"):
    for h in args.dit_heads:
      for s in args.dit_seq_lens:
        out.append(dict(case=f"dit_bidir_H{h}_S{s}", b=batch(s), s=s, hq=h, hkv=h, d=testing.DIT_HEAD_DIM,
                        dv=testing.DIT_HEAD_DIM, causal=False, packed=False, inputs="gaussian"))
  return out


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--suite", choices=["llm", "dit", "all"], default="llm")
  parser.add_argument("--seq-lens", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
  parser.add_argument("--packed", choices=["no", "yes", "both"], default="both")
  parser.add_argument("--doc-len", type=int, default=None,
                      help="packed rows of documents 1 to 2·N tokens long (a training batch's), not 4 per row")
  parser.add_argument("--llm-heads", type=int, nargs=3, default=list(testing.LLM_HEADS), metavar=("HQ", "HKV", "D"),
                      help="llm suite: query heads, kv heads, head dim")
  parser.add_argument("--value-dim", type=int, default=None, metavar="DV",
                      help="llm suite: v's head dim where it differs from q·k's (MLA's 128 with D 192)")
  parser.add_argument("--dit-heads", type=int, nargs="+", default=[12, 40])
  parser.add_argument("--dit-seq-lens", type=int, nargs="+", default=[16384, 32768, 75600])
  parser.add_argument("--batch", type=int, default=1)
  parser.add_argument("--tokens", type=int, default=0, help="batch = tokens // S (B x S fixed), instead of --batch")
  parser.add_argument("--causal", choices=["no", "yes", "both"], default="yes", help="llm suite: causal, bidirectional")
  parser.add_argument("--inputs", nargs="+", default=["gaussian"], choices=["gaussian", *testing.FAMILIES],
                      help="llm suite: Gaussian, or clis_kernels.testing's pretrained-like families")
  parser.add_argument("--passes", nargs="+", default=["fwd", "fwd_bwd"], choices=["fwd", "bwd", "fwd_bwd"])
  parser.add_argument("--impls", nargs="+",
                      default=["clis", "clis_prepass", "clis_kernel", "online", "clis_blocks", "clis_blocks_prepass",
                               "clis_mgpu", "clis_mgpu_prepass", "online_mgpu", "cudnn", "xla", "tokamax_mosaic",
                               "tokamax_triton", "splash"])
  parser.add_argument("--window", type=int, default=None, help="llm suite: local_window_size (jax.nn's)")
  parser.add_argument("--softcap", type=float, default=None, help="llm suite: logits_soft_cap (Gemma 2's 50)")
  parser.add_argument("--sinks", type=float, default=None, metavar="MEAN",
                      help="llm suite: learned sink logits per query head, MEAN plus a standard normal (gpt-oss)")
  parser.add_argument("--xla-max-gb", type=float, default=16.0, help="skip dense XLA when its logits exceed this")
  parser.add_argument("--repeats", type=int, default=25)
  parser.add_argument("--inner", type=int, default=10)
  parser.add_argument("--quick", action="store_true", help="tiny cases on the CPU, Pallas in interpret mode")
  parser.add_argument("--out", default=None)
  args = parser.parse_args()
  if args.quick:
    args.repeats, args.inner, args.impls = min(args.repeats, 2), 1, ["clis", "clis_prepass", "clis_kernel", "online",
                                                                      "clis_blocks", "clis_blocks_prepass",
                                                                      "xla", "cudnn"]
  platform = jax.devices()[0].platform
  features = feature_kwargs(args.window, args.softcap)
  if (features or args.sinks is not None) and args.quick:
    args.impls = [name for name in args.impls if name in FEATURED]
  if features or args.sinks is not None:
    wrong = [name for name in args.impls if name not in FEATURED]
    if wrong or args.suite != "llm":
      raise SystemExit(f"--window / --softcap / --sinks: the llm suite and --impls among {FEATURED}; got "
                       f"{wrong or args.suite}")
    if args.softcap is not None and "cudnn" in args.impls:
      args.impls = [name for name in args.impls if name != "cudnn"]
      print("cudnn skipped: jax.nn's cuDNN attention takes no logits_soft_cap")
  fns, notes = implementations(args.impls, platform, args.quick)
  fns = {name: functools.partial(f, **features) if features else f for name, f in fns.items()}
  takes_sinks = lambda name: args.sinks is not None and name not in SINKLESS
  if args.sinks is not None and any(name in SINKLESS for name in fns):
    print(f"{sorted(set(fns) & set(SINKLESS))} take no learned sinks: timed without the sink term")
  for note in notes:
    print(note)
  meta = benchmarking.device_meta()
  records = []
  for c in cases(args):
    q, k, v, do, seg = _inputs(c["b"], c["s"], c["hq"], c["hkv"], c["d"], c["packed"], family=c["inputs"],
                               dtype=c.get("dtype", jnp.bfloat16), doc_len=args.doc_len)
    dv = c.get("dv", c["d"])
    v, do = v[..., :dv], do[..., :dv]
    sinks = {} if args.sinks is None else dict(sinks=sink_logits(args.sinks, c["hq"]))
    variants = {}
    for name, f in fns.items():
      f = functools.partial(f, **sinks) if takes_sinks(name) else f
      if name == "xla" and c["b"] * c["hq"] * c["s"] ** 2 * 4 / 2**30 > args.xla_max_gb:
        continue
      if c["packed"] and (name == "cudnn" or name.startswith("tokamax_")) and name != "tokamax_k_start":
        continue  # these entry points take no segment ids here
      if name.endswith("prepass"):  # the certificate alone, to split clis time into pre-pass and kernel
        variants[(name, "fwd")] = functools.partial(jax.jit(functools.partial(f, causal=c["causal"])), q, k, v, seg)
        continue
      if name == "clis_kernel":  # forward only: the kernel with its pre-pass done beforehand
        variants[(name, "fwd")] = f(q, k, v, seg, c["causal"])
        continue
      fwd = jax.jit(functools.partial(f, causal=c["causal"]))
      if "fwd" in args.passes:
        variants[(name, "fwd")] = functools.partial(fwd, q, k, v, seg)
      if "fwd_bwd" in args.passes:
        def fwd_bwd(q, k, v, do, seg, f=f, causal=c["causal"]):
          return jax.vjp(lambda a, b, c_: f(a, b, c_, seg, causal), q, k, v)[1](do)
        variants[(name, "fwd_bwd")] = functools.partial(jax.jit(fwd_bwd), q, k, v, do, seg)
      if "bwd" in args.passes:  # the backward alone: the forward's residuals made once, outside the timing
        vjp_fn = jax.jit(lambda q, k, v, seg, f=f, causal=c["causal"]: jax.vjp(
            lambda a, b, c_: f(a, b, c_, seg, causal), q, k, v)[1])(q, k, v, seg)
        variants[(name, "bwd")] = functools.partial(jax.jit(lambda fn, do: fn(do)), vjp_fn, do)
    for key in list(variants):  # an implementation that fails on this case is reported and left out
      try:
        jax.block_until_ready(variants[key]())
      except Exception as e:  # noqa: BLE001 — third-party kernels fail in many ways
        print(f"{c['case']} {key[0]} {key[1]} skipped: {type(e).__name__}: {str(e)[:300]}")
        del variants[key]
    certified = {name: _certified_fraction(q, k, v, seg, c["causal"], name, args.quick, **features, **sinks)
                 for name, _ in variants if name in CERTIFYING}
    samples = benchmarking.interleaved_samples({f"{n}|{p}": fn for (n, p), fn in variants.items()},
                                               repeats=args.repeats, inner=args.inner)
    flops = 2 * c["b"] * c["hq"] * c["s"] ** 2 * (c["d"] + dv) * (0.5 if c["causal"] else 1.0)
    for key, ms in samples.items():
      name, pass_ = key.split("|")
      med, lo, hi = benchmarking.spread(ms)
      work = flops * {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}[pass_]
      records.append(dict(case=c["case"], impl=name, **{"pass": pass_}, ms=med, ms_min=lo, ms_max=hi,
                          tflops=None if name.endswith("prepass") else work / med / 1e9, B=c["b"], S=c["s"], Hq=c["hq"], Hkv=c["hkv"], D=c["d"], Dv=dv,
                          causal=c["causal"], packed=c["packed"], inputs=c["inputs"], window=args.window,
                          softcap=args.softcap, sinks=args.sinks if takes_sinks(name) else None,
                          certified=certified.get(name), repeat=args.repeats, inner=args.inner, samples_ms=ms, **meta))
      print(f"{c['case']} {pass_} {name}: {med:.3f} ms [{lo:.3f}, {hi:.3f}] certified {certified.get(name)}",
            flush=True)  # as each case ends, so a run cut by its time limit still reports what it measured
  out = args.out or benchmarking.default_output(f"attention_{'quick' if args.quick else args.suite}")
  benchmarking.write_report(records, out)
  print(benchmarking.markdown_table(records))
  print("wrote", out)


if __name__ == "__main__":
  main()
