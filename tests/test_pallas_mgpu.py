"""The Mosaic GPU forward (pallas_mgpu): lowering and input checks on the CPU, numerics on a Hopper GPU.

Mosaic GPU has no interpret mode, so on the CPU the kernel is traced and lowered for an H200
(which catches layout, barrier and shape errors); the float64 comparisons run where a GPU is
present (`pytest tests/test_pallas_mgpu.py` on the device machine; BENCHMARKS.md has the run).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from clis_kernels import reference_f64 as ref
from attention_base import CLIS_VS_ONLINE, TOLERANCE, AttentionTests, lower_for_h200, packed_segments, random_inputs
from clis_kernels import (SegmentIds, attention, masks, mgpu_pipeline, pallas_gpu, pallas_mgpu, pallas_mgpu_vjp, plan,
                          testing)
from clis_kernels.plan import HOPPER

ON_GPU = jax.devices()[0].platform == "gpu"
def needs_gpu(test):
  """Marks a test `gpu` and skips it without one."""
  return pytest.mark.gpu(pytest.mark.skipif(not ON_GPU, reason="Mosaic GPU kernels run on an NVIDIA Hopper GPU only")(
      test))
BACKWARDS = {"mosaic": ("pallas_mgpu", None), "triton": ("pallas_mgpu_triton_bwd", None),  # the forward with
             "fused": ("pallas_mgpu", pallas_mgpu_vjp.BlockSizes(fused_dq=True)),  # each backward
             "split": ("pallas_mgpu", pallas_mgpu_vjp.BlockSizes(fused_dq=True, split_dq=True))}  # (head dim 128)


@pytest.mark.skipif(ON_GPU, reason="lowering check for machines without a GPU")
@pytest.mark.parametrize("causal,seq,d,packed", [(True, 256, 128, False), (False, 200, 64, False),
                                                 (True, 256, 64, True), (False, 256, 128, True)])
def test_fused_backward_lowers_as_one_kernel(causal, seq, d, packed):
  """BlockSizes(fused_dq=True): the backward is one Mosaic GPU kernel (dK, dV and dQ's parts added into an f32
  ref by TMA), GQA, odd lengths, packed; the forward is the other custom call."""
  q = jax.ShapeDtypeStruct((1, seq, 8, d), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((1, seq, 2, d), jnp.bfloat16)
  seg = jax.ShapeDtypeStruct((1, seq), jnp.int32) if packed else None

  def loss(q, k, v, seg):
    return attention(q, k, v, seg, causal=causal, implementation="pallas_mgpu", platform=HOPPER,
                     backward_block_sizes=pallas_mgpu_vjp.BlockSizes(fused_dq=True)).astype(jnp.float32).sum()

  text = lower_for_h200(jax.grad(loss, argnums=(0, 1, 2)), q, k, k, seg)
  assert text.count("custom_call @mosaic_gpu") == 2


@pytest.mark.skipif(ON_GPU, reason="lowering check for machines without a GPU")
@pytest.mark.parametrize("causal,packed", [(True, False), (False, False), (True, True)])
def test_split_dq_backward_lowers_as_one_kernel(causal, packed):
  """BlockSizes(fused_dq=True, split_dq=True) at head dim 128: each warpgroup's half of dQ from both warpgroups'
  dSᵀ, GQA, an odd length, packed; and a clear error at head dim 64."""
  seq = 200
  q = jax.ShapeDtypeStruct((1, seq, 8, 128), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((1, seq, 2, 128), jnp.bfloat16)
  seg = jax.ShapeDtypeStruct((1, seq), jnp.int32) if packed else None
  split = pallas_mgpu_vjp.BlockSizes(fused_dq=True, split_dq=True)

  def loss(q, k, v, seg):
    return attention(q, k, v, seg, causal=causal, implementation="pallas_mgpu", platform=HOPPER,
                     backward_block_sizes=split).astype(jnp.float32).sum()

  assert lower_for_h200(jax.grad(loss, argnums=(0, 1, 2)), q, k, k, seg).count("custom_call @mosaic_gpu") == 2
  q64 = jax.ShapeDtypeStruct((1, seq, 8, 64), jnp.bfloat16)
  with pytest.raises(ValueError, match="split_dq=True needs head_dim 128"):
    lower_for_h200(jax.grad(loss, argnums=(0, 1, 2)), q64, q64, q64, seg)
  with pytest.raises(ValueError, match="needs fused_dq=True"):
    pallas_mgpu_vjp.BlockSizes(split_dq=True)
  with pytest.raises(ValueError, match="split_dq=True runs in the serial step order only"):
    pallas_mgpu_vjp.BlockSizes(fused_dq=True, split_dq=True, overlap_dkv=True)


@pytest.mark.skipif(ON_GPU, reason="lowering check for machines without a GPU")
@pytest.mark.parametrize("causal,seq,d,stabilizer,granularity", [
    (True, 256, 128, "clis", "tile"), (True, 256, 64, "online", "tile"), (False, 200, 128, "clis", "tile"),
    (False, 256, 64, "online", "tile"), (True, 256, 128, "clis", "head"), (False, 200, 64, "clis", "head")])
@pytest.mark.parametrize("packed", [False, True])
def test_kernel_lowers_for_the_gpu(causal, seq, d, stabilizer, granularity, packed):
  """Forward (in-kernel certificate for tiles, XLA certificate for heads) and the default backward
  lower for an H200, odd lengths padded and masked: three Mosaic GPU kernels at head dim 128 (two-kernel
  backward), two at 64 (the fused backward is the default there)."""
  q = jax.ShapeDtypeStruct((1, seq, 8, d), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((1, seq, 2, d), jnp.bfloat16)

  seg = jax.ShapeDtypeStruct((1, seq), jnp.int32) if packed else None

  def loss(q, k, v, seg):
    out = attention(q, k, v, seg, causal=causal, stabilizer=stabilizer, granularity=granularity,
                    implementation="pallas_mgpu", platform=HOPPER)
    return out.astype(jnp.float32).sum()

  text = lower_for_h200(jax.grad(loss, argnums=(0, 1, 2)), q, k, k, seg)
  kernels = 2 if d <= pallas_mgpu_vjp.FUSED_MAX_HEAD_DIM else 3
  assert text.count("custom_call @mosaic_gpu") == kernels and "clis_bwd" not in text


# causal, seq, head dim, packed, attention keywords, backward tiles, stabilizer
WINDOW_CAP_LOWERINGS = [
    (True, 256, 128, False, dict(local_window_size=100), None, "clis"),
    (False, 200, 64, False, dict(local_window_size=(40, 70)), None, "clis"),
    (True, 256, 64, True, dict(logits_soft_cap=20.0), None, "clis"),  # the cap's bound (Mode.CAP)
    (True, 256, 128, False, dict(logits_soft_cap=20.0, bound="radius"), None, "clis"),  # in-kernel (Mode.KEYS)
    (False, 256, 128, False, dict(logits_soft_cap=20.0, local_window_size=64),
     pallas_mgpu_vjp.BlockSizes(fused_dq=True, split_dq=True), "online"),
    (True, 256, 128, True, dict(local_window_size=64), pallas_mgpu_vjp.BlockSizes(fused_dq=True), "clis"),
]


@pytest.mark.skipif(ON_GPU, reason="lowering check for machines without a GPU")
@pytest.mark.parametrize("causal,seq,d,packed,kw,backward_tiles,stabilizer", WINDOW_CAP_LOWERINGS)
def test_window_and_soft_cap_lower_for_the_gpu(causal, seq, d, packed, kw, backward_tiles, stabilizer):
  """Local windows (the band's blocks only) and soft caps on the Mosaic GPU forward (the cap's bound, or the in-kernel
  certificate) and
  each Mosaic GPU backward (two kernels, fused, fused with split dQ): no Triton kernel left."""
  q = jax.ShapeDtypeStruct((1, seq, 8, d), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((1, seq, 2, d), jnp.bfloat16)
  seg = jax.ShapeDtypeStruct((1, seq), jnp.int32) if packed else None

  def loss(q, k, v, seg):
    return attention(q, k, v, seg, causal=causal, implementation="pallas_mgpu", platform=HOPPER, stabilizer=stabilizer,
                     backward_block_sizes=backward_tiles, **kw).astype(jnp.float32).sum()

  text = lower_for_h200(jax.grad(loss, argnums=(0, 1, 2)), q, k, k, seg)
  two_kernels = backward_tiles is None and d > pallas_mgpu_vjp.FUSED_MAX_HEAD_DIM
  assert text.count("custom_call @mosaic_gpu") == (3 if two_kernels else 2) and "clis_bwd" not in text


# causal, seq, head dim, packed, attention keywords, heads per CTA (GQA 8/2: up to 4), block_kv (None: the default).
# Causal with 64-key blocks: the first warpgroup's range ends a block before the second's, so it drains that block
# before its next head (the case that hung before _drain waited for it).
HEADS_PER_CTA_CASES = [
    (True, 256, 64, False, dict(local_window_size=128), 4, None),
    (True, 200, 128, True, {}, 2, None),
    (False, 256, 64, True, dict(local_window_size=(40, 70), logits_soft_cap=20.0), 4, None),
    (True, 256, 128, True, dict(local_window_size=64), 2, None),
    (True, 256, 128, False, {}, 2, 64),
    (True, 200, 64, True, {}, 4, 64),
]


def _heads_tiles(d: int, heads: int, block_kv: int | None = None):
  """The head dim's default forward tiles (with block_kv where given) with a CTA walking `heads` heads."""
  tiles = pallas_mgpu.default_block_sizes(d, 0, jnp.bfloat16)
  return dataclasses.replace(tiles, heads_per_cta=heads, block_kv=block_kv or tiles.block_kv)


@pytest.mark.skipif(ON_GPU, reason="lowering check for machines without a GPU")
@pytest.mark.parametrize("causal,seq,d,packed,kw,heads,block_kv", HEADS_PER_CTA_CASES)
def test_heads_per_cta_lowers_for_the_gpu(causal, seq, d, packed, kw, heads, block_kv):
  """BlockSizes(heads_per_cta=n): the forward's CTA walks n heads of a GQA group (window band, causal with document
  ranges, bidirectional packed with a cap) and lowers for an H200 as one kernel."""
  q = jax.ShapeDtypeStruct((1, seq, 8, d), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((1, seq, 2, d), jnp.bfloat16)
  seg = jax.ShapeDtypeStruct((1, seq), jnp.int32) if packed else None
  fwd = lambda q, k, v, seg: attention(q, k, v, seg, causal=causal, implementation="pallas_mgpu", platform=HOPPER,
                                       stabilizer="online", block_sizes=_heads_tiles(d, heads, block_kv), **kw)
  assert lower_for_h200(fwd, q, k, k, seg).count("custom_call @mosaic_gpu") == 1


def test_auto_heads_per_cta_walks_the_group_for_narrow_online_windows():
  """The default (BlockSizes(heads_per_cta=None)): the largest divisor of the group up to 8 for online calls with a
  window at most 1024 keys wide; one head per CTA for wider windows, no window, certified loops, kept-tile lists,
  MLA's split head dims and head dims above 128."""
  auto = lambda **kw: pallas_mgpu.auto_heads_per_cta(**{**dict(mode="online", group=8, window=(127, 0), listed=False,
                                                                split_dims=False, head_dim=64), **kw})
  assert auto() == 8 and auto(group=4) == 4 and auto(group=6) == 6 and auto(group=16) == 8 and auto(group=1) == 1
  assert auto(window=(511, 512)) == 8 and auto(window=(1023, 1)) == 1 and auto(window=(4095, 0)) == 1
  assert auto(window=None) == 1 and auto(mode="keys") == 1 and auto(mode="cert") == 1
  assert auto(listed=True) == 1 and auto(split_dims=True) == 1 and auto(head_dim=128) == 8 and auto(head_dim=256) == 1


@pytest.mark.parametrize("heads,kw,message", [
    (3, dict(stabilizer="online"), "must divide the query heads per kv head"),
    (2, dict(stabilizer="clis"), "runs the online loop only"),
    (0, dict(stabilizer="online"), "must be at least 1"),
    (2, dict(stabilizer="online", d=256), "takes head dims up to 128 \\(got 256"),
])
def test_heads_per_cta_gives_clear_errors(heads, kw, message):
  """heads_per_cta must divide the GQA group, runs the online loop only and head dims up to 128; each refusal names
  what to do."""
  kw = dict(kw)
  d = kw.pop("d", 64)
  q = jax.ShapeDtypeStruct((1, 256, 8, d), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((1, 256, 2, d), jnp.bfloat16)
  with pytest.raises(ValueError, match=message):
    fwd = lambda q, k, v: attention(q, k, v, causal=True, implementation="pallas_mgpu", platform=HOPPER,
                                    block_sizes=_heads_tiles(d, heads), **kw)
    jax.eval_shape(fwd, q, k, k)


@pytest.mark.skipif(ON_GPU, reason="lowering check for machines without a GPU")
@pytest.mark.parametrize("packed", [False, True])
def test_triton_backward_lowers_for_the_gpu(packed):
  """implementation="pallas_mgpu_triton_bwd": the Mosaic forward with pallas_gpu's Triton backward."""
  q = jax.ShapeDtypeStruct((1, 256, 8, 128), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((1, 256, 2, 128), jnp.bfloat16)
  seg = jax.ShapeDtypeStruct((1, 256), jnp.int32) if packed else None

  def loss(q, k, v, seg):
    return attention(q, k, v, seg, causal=True, implementation="pallas_mgpu_triton_bwd",
                     platform=HOPPER).astype(jnp.float32).sum()

  text = lower_for_h200(jax.grad(loss, argnums=(0, 1, 2)), q, k, k, seg)
  assert text.count("custom_call @mosaic_gpu") == 1
  for name in ("clis_bwd_dq", "clis_bwd_dkv"):
    assert name in text



@pytest.mark.skipif(ON_GPU, reason="lowering check for machines without a GPU")
@pytest.mark.parametrize("causal,seq,d,hkv,packed", [
    (True, 256, 128, 2, False), (False, 200, 64, 8, False), (True, 256, 64, 2, True), (False, 256, 128, 8, True)])
def test_mosaic_backward_lowers_for_the_gpu(causal, seq, d, hkv, packed):
  """With implementation="pallas_mgpu" and the two-kernel backward, forward, dQ and dK/dV are three Mosaic GPU
  kernels (no Triton kernel left), GQA and MHA, odd lengths padded, packed segments."""
  q = jax.ShapeDtypeStruct((1, seq, 8, d), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((1, seq, hkv, d), jnp.bfloat16)
  seg = jax.ShapeDtypeStruct((1, seq), jnp.int32) if packed else None

  def loss(q, k, v, seg):
    return attention(q, k, v, seg, causal=causal, implementation="pallas_mgpu",
                     backward_block_sizes=pallas_mgpu_vjp.BlockSizes(), platform=HOPPER).astype(jnp.float32).sum()

  text = lower_for_h200(jax.grad(loss, argnums=(0, 1, 2)), q, k, k, seg)
  assert text.count("custom_call @mosaic_gpu") == 3 and "clis_bwd" not in text


@pytest.mark.skipif(ON_GPU, reason="lowering check for machines without a GPU")
@pytest.mark.parametrize("causal,packed,bound", [(True, False, "radius"), (False, False, "radius"),
                                                 (True, True, "radius"), (True, False, "blocks")])
def test_tensor_core_sum_lowers_for_the_gpu(causal, packed, bound):
  """BlockSizes(sum_on_tensor_cores=True): l as a second wgmma against a ones tile, in both certified modes."""
  q = jax.ShapeDtypeStruct((1, 256, 4, 128), jnp.bfloat16)
  seg = jax.ShapeDtypeStruct((1, 256), jnp.int32) if packed else None
  fn = lambda q, k, v, seg: attention(q, k, v, seg, causal=causal, implementation="pallas_mgpu", platform=HOPPER,
                                      bound=bound, block_sizes=pallas_mgpu.BlockSizes(sum_on_tensor_cores=True))
  assert "mosaic_gpu" in lower_for_h200(fn, q, q, q, seg)


@pytest.mark.skipif(ON_GPU, reason="lowering check for machines without a GPU")
@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("causal,packed", [(True, False), (False, False), (True, True)])
def test_forward_without_pingpong_lowers_for_the_gpu(causal, packed, overlap):
  q = jax.ShapeDtypeStruct((1, 384, 4, 128), jnp.bfloat16)
  seg = jax.ShapeDtypeStruct((1, 384), jnp.int32) if packed else None
  fn = lambda q, k, v, seg: attention(q, k, v, seg, causal=causal, implementation="pallas_mgpu", platform=HOPPER,
                                      block_sizes=pallas_mgpu.BlockSizes(pingpong=False, overlap=overlap))
  assert "mosaic_gpu" in lower_for_h200(fn, q, q, q, seg)


@pytest.mark.skipif(ON_GPU, reason="lowering check for machines without a GPU")
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d,kernels", [(64, 2), (128, 3)])  # fused backward at 64, two kernels at 128
def test_lowers_with_x64_enabled(causal, d, kernels):
  """Under jax_enable_x64 the loops keep int32 indices (the H200 run of the shared base found int64 ones)."""
  q = jax.ShapeDtypeStruct((1, 48, 4, d), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((1, 48, 2, d), jnp.bfloat16)
  loss = lambda q, k, v: attention(q, k, v, causal=causal, implementation="pallas_mgpu",
                                   platform=HOPPER).astype(jnp.float32).sum()
  with jax.enable_x64(True):
    assert lower_for_h200(jax.grad(loss, argnums=(0, 1, 2)), q, k, k).count("custom_call @mosaic_gpu") == kernels


def test_mosaic_backward_block_sizes_are_validated():
  with pytest.raises(ValueError, match="slots=1 must be at least 2"):
    pallas_mgpu_vjp.BlockSizes(slots=1)
  assert pallas_mgpu_vjp.BlockSizes().multiple == 128


# (q·k head dim, v head dim, rows, soft cap): (fused_dq, overlap_dq, overlap_dkv, dv_with_dp)
BACKWARD_ORDERS = [
    ((128, 128, 8192, None), (False, True, False, False)), ((128, 128, 32768, None), (False, True, False, False)),
    ((128, 128, 8192, 50.0), (False, False, True, False)), ((128, 128, 32768, 50.0), (False, True, True, False)),
    ((192, 128, 16384, None), (False, True, True, False)), ((192, 128, 32768, None), (False, True, False, False)),
    ((256, 256, 8192, None), (False, True, True, False)), ((256, 256, 32768, None), (False, True, True, False)),
    ((256, 256, 8192, 50.0), (False, True, True, False)), ((256, 256, 32768, 50.0), (False, True, True, False)),
    ((64, 64, 32768, None), (True, False, False, False)), ((64, 64, 8192, 30.0), (True, False, False, False))]


@pytest.mark.parametrize("call,want", BACKWARD_ORDERS, ids=[f"d{c[0]}_v{c[1]}_s{c[2]}_cap{c[3]}" for c, _ in BACKWARD_ORDERS])
def test_plan_orders_each_backward_kernel_as_it_measured_fastest(call, want):
  """The Hopper plan's backward tiles (BENCHMARKS.md §1, "Each backward kernel's step order"): overlap_dq above head dim
  64 except with a cap at D 128 below 32k rows; overlap_dkv with a cap at D 128, at MLA's dims below 32k rows and at
  D 256 everywhere; dV behind dP nowhere; the fused kernel, in its one order, up to 64."""
  d, dv, seq, cap = call
  tiles = plan.make_plan(dtype=jnp.bfloat16, head_dim=d, value_head_dim=dv, seq_len=seq, stabilizer="online",
                         causal=True, packed=False, platform=HOPPER, softcap=cap,
                         window_or_cap=cap is not None).backward_block_sizes
  assert (tiles.fused_dq, tiles.overlap_dq, tiles.overlap_dkv, tiles.dv_with_dp) == want


@pytest.mark.parametrize("kwargs,message", [
    (dict(dtype=jnp.float32), "needs bfloat16 or float16"),
    (dict(d=320), "takes head dims up to 128, \\(256,\\) .*; got head_dim=320 with v.s 320"),
    (dict(interpret=True), "has no interpret mode"),
    (dict(scale=-1.0), "must be positive"),
])
def test_unsupported_inputs_get_one_clear_error(kwargs, message):
  d, dtype = kwargs.pop("d", 64), kwargs.pop("dtype", jnp.bfloat16)
  q = jnp.zeros((1, 128, 2, d), dtype)
  with pytest.raises(ValueError, match=message):
    jax.eval_shape(lambda q: attention(q, q, q, implementation="pallas_mgpu", platform=HOPPER, **kwargs), q)


@pytest.mark.parametrize("kwargs,message", [(dict(block_q=128), "block_q=128 must be 64"),
                                            (dict(block_kv=256), "block_kv=256 must be 64 or 128"),
                                            (dict(slots=1), "slots=1 must be at least 2"),
                                            (dict(overlap=True), "overlap=True needs pingpong=False"),
                                            (dict(sum_on_tensor_cores=True, exact_sum=False),
                                             "sum_on_tensor_cores=True sums the rounded weights"),
                                            (dict(named_barriers=True, pingpong=False), "named_barriers=True needs"),
                                            (dict(named_barriers=True, one_memory_warp=False),
                                             "named_barriers=True needs"),
                                            (dict(named_barriers=True, heads_per_cta=2), "named_barriers=True needs"),
                                            (dict(named_barriers=True, slots=6), "slots=6 must be at most 5")])
def test_block_sizes_are_validated(kwargs, message):
  with pytest.raises(ValueError, match=message):
    pallas_mgpu.BlockSizes(**kwargs)


def test_padding_multiple_covers_both_warpgroups_and_the_backward():
  kw = dict(dtype=jnp.bfloat16, head_dim=64, seq_len=1024, platform=HOPPER)
  p = plan.make_plan(implementation="pallas_mgpu_triton_bwd", block_sizes=pallas_mgpu.BlockSizes(block_kv=64),
                     backward_block_sizes=pallas_gpu.BlockSizes(block_q=256, block_k=128), **kw)
  assert p.tile == 64 and p.multiple == 256
  assert pallas_mgpu.BlockSizes(block_kv=64).multiple == 128  # two warpgroups of 64 rows


# name, batch, seq, q heads, kv heads, head dim, causal, packed
GPU_CASES = [
    ("causal_gqa4_d128", 2, 1024, 8, 2, 128, True, False),
    ("causal_mha_d64_odd", 1, 1000, 4, 4, 64, True, False),
    ("bidir_mha_d128_odd", 1, 1000, 4, 4, 128, False, False),
    ("bidir_gqa2_d64", 1, 768, 4, 2, 64, False, False),
    ("causal_packed_gqa4_d128", 2, 1000, 8, 2, 128, True, True),
    ("bidir_packed_mha_d64", 1, 640, 4, 4, 64, False, True),
]


@needs_gpu
class TestPallasMgpu(AttentionTests):
  """The shared test base on the Mosaic GPU kernels at their default tiles: bfloat16 (the widest dtype they
  take); float32 cases and head dims over 256 each get one clear error."""
  implementation = "pallas_mgpu"
  interpret = False
  block_sizes = pallas_mgpu.BlockSizes()

  def tiles_for(self, head_dim: int):
    """The plan's default tiles at every head dim: BlockSizes() up to 128, 64-key blocks above (a 128-key block
    overflows shared memory there and is refused)."""
    del head_dim
    return None

  @pytest.mark.parametrize("case", GPU_CASES, ids=[c[0] for c in GPU_CASES])
  def test_default_tiles_match_float64(self, case):
    """Lengths of many 64-row tiles and 128-key blocks (the base's CASES fit in one or two)."""
    name, batch, seq, hq, hkv, d, causal, packed = case
    self.check_case((name, batch, seq, hq, hkv, d, jnp.bfloat16, causal, packed))


@needs_gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=[c[0] for c in GPU_CASES])
def test_mosaic_backward_matches_float64_on_gpu(case):
  """The Mosaic GPU backwards (two kernels, fused, and fused with split dQ at head dim 128): gradients against
  float64, as accurate as the Triton backward's."""
  name, batch, seq, hq, hkv, d, causal, packed = case
  q, k, v, do = random_inputs(len(name), batch, seq, hq, hkv, d, jnp.bfloat16)
  seg = packed_segments(len(name), batch, seq) if packed else None
  want = ref.attention(q, k, v, do, seg, causal=causal)[1:]
  errors = {}
  for label, (implementation, backward_tiles) in BACKWARDS.items():
    if label == "split" and d != 128:
      continue
    f = lambda q, k, v: attention(q, k, v, seg, causal=causal, implementation=implementation,
                                  backward_block_sizes=backward_tiles)
    grads = jax.vjp(f, q, k, v)[1](do)
    assert all(bool(jnp.isfinite(g.astype(jnp.float32)).all()) for g in grads), label
    errors[label] = [ref.rel_err(g, w) for g, w in zip(grads, want)]
  for label in ("mosaic", "fused", "split")[:3 if d == 128 else 2]:
    assert max(errors[label]) < TOLERANCE[jnp.bfloat16][1], (label, errors)
    for mosaic, triton in zip(errors[label], errors["triton"]):
      assert mosaic <= CLIS_VS_ONLINE * triton, (label, errors)


@pytest.mark.skipif(ON_GPU, reason="lowering check for machines without a GPU")
@pytest.mark.parametrize("d,causal,packed,kw", [
    (256, True, False, {}), (256, False, True, {}), (200, True, True, {}),
    (256, True, False, dict(logits_soft_cap=50.0, local_window_size=100))],
    ids=["causal_d256", "bidir_packed_d256", "causal_packed_d200", "d256_cap_window"])
@pytest.mark.parametrize("bound", ["blocks", "radius"])
def test_wide_heads_lower_as_mosaic_kernels(d, causal, packed, kw, bound):
  """Head dims above 128 (Gemma's 256) on Hopper by default: the Mosaic GPU forward at 64-key blocks taking a
  pre-pass's certificate, and pallas_mgpu_vjp_wide's two backward kernels (no Triton kernel)."""
  q = jax.ShapeDtypeStruct((1, 1000, 8, d), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((1, 1000, 4, d), jnp.bfloat16)
  seg = jax.ShapeDtypeStruct((1, 1000), jnp.int32) if packed else None

  def loss(q, k, v, seg):
    return attention(q, k, v, seg, causal=causal, bound=bound, platform=HOPPER, **kw).astype(jnp.float32).sum()

  text = lower_for_h200(jax.grad(loss, argnums=(0, 1, 2)), q, k, k, seg)
  assert text.count("custom_call @mosaic_gpu") == 3 and text.count("clis_bwd") == 0
  assert d < 256 or "bar.sync $0, 288;" in text, "head dim 256's forward releases K/V slots on named barriers"
  assert "clis_mgpu_fwd" in text and "clis_mgpu_bwd_dq_wide" in text and "clis_mgpu_bwd_dkv_wide" in text  # for ncu


def test_wide_backward_launches_one_cta_per_64_rows():
  """At head dim 256 both compute warpgroups share a CTA's 64 rows (pallas_mgpu_vjp_wide), so the grids have twice
  the CTAs of the two-kernel backward's, which gives each warpgroup 64 rows of its own, and document ranges per 64
  rows."""
  q = jnp.zeros((2, 512, 4, 256), jnp.bfloat16)
  k = jnp.zeros((2, 512, 2, 256), jnp.bfloat16)
  lse = jnp.zeros((2, 4, 512), jnp.float32)
  seg = SegmentIds(jnp.ones((2, 512), jnp.int32), jnp.ones((2, 512), jnp.int32))
  launch = pallas_mgpu_vjp.Launches(q, k, k, seg, q, lse, q, causal=True, scale=0.1, kv_len=512,
                                    block_sizes=pallas_mgpu_vjp.BlockSizes())
  assert launch.wide and (launch.dq_grid, launch.dkv_grid) == ((4, 8, 2), (2, 8, 2))
  assert launch.common["doc_ranges"] and launch.dq_args[-1].shape[:2] == launch.dkv_args[-1].shape[:2] == (2, 8)
  narrow = pallas_mgpu_vjp.Launches(q[..., :128], k[..., :128], k[..., :128], seg, q[..., :128], lse, q[..., :128],
                                    causal=True, scale=0.1, kv_len=512, block_sizes=pallas_mgpu_vjp.BlockSizes())
  assert not narrow.wide and (narrow.dq_grid, narrow.dkv_grid) == ((4, 4, 2), (2, 4, 2))
  assert narrow.dq_args[-1].shape[:2] == narrow.dkv_args[-1].shape[:2] == (2, 4)


@pytest.mark.skipif(ON_GPU, reason="lowering check for machines without a GPU")
@pytest.mark.parametrize("d,causal,packed", [(192, True, False), (160, False, True), (192, True, True)],
                         ids=["causal_192", "bidir_packed_160", "causal_packed_192"])
@pytest.mark.parametrize("bound", ["blocks", "radius"])
def test_mla_lowers_as_mosaic_kernels_with_v_unpadded(d, causal, packed, bound):
  """MLA's q·k 192 / v 128 (DeepSeek V3) on Hopper by default: the Mosaic GPU forward and both backward kernels at
  (192, 128) — v, dO, the output and dV are not padded to q's width — with a pre-pass's certificate."""
  seq = 1000
  q = jax.ShapeDtypeStruct((1, seq, 8, d), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((1, seq, 4, d), jnp.bfloat16)
  v = jax.ShapeDtypeStruct((1, seq, 4, 128), jnp.bfloat16)
  seg = jax.ShapeDtypeStruct((1, seq), jnp.int32) if packed else None

  def loss(q, k, v, seg):
    return attention(q, k, v, seg, causal=causal, bound=bound, platform=HOPPER).astype(jnp.float32).sum()

  text = lower_for_h200(jax.grad(loss, argnums=(0, 1, 2)), q, k, v, seg)
  assert text.count("custom_call @mosaic_gpu") == 3 and text.count("clis_bwd") == 0
  assert "tensor<1x1024x4x128xbf16>" in text and "tensor<1x1024x4x192xbf16>" in text  # v at 128, k at 192
  assert "tensor<1x1024x4x256xbf16>" not in text and "tensor<1x1024x8x256xbf16>" not in text
  assert "clis_mgpu_bwd_dq" in text and "clis_mgpu_bwd_dkv" in text and "bwd_dq_wide" not in text  # named for ncu


def test_wide_heads_give_clear_errors():
  q = jnp.zeros((1, 128, 2, 256), jnp.bfloat16)
  lse = jnp.zeros((1, 2, 128), jnp.float32)
  q192, v128, v64 = q[..., :192], q[..., :128], q[..., :64]
  with pytest.raises(ValueError, match=r"v's head dim 64 equal to it or a \(q·k, v\) pair of \(\(192, 128\),\)"):
    pallas_mgpu.forward(q192, q192, v64, None, None, mode=plan.Mode.ONLINE, causal=True, scale=0.1, kv_len=128,
                        block_sizes=pallas_mgpu.BlockSizes(block_kv=64))
  with pytest.raises(ValueError, match="fused_dq=True needs v's head dim equal to q's; got 192 and 128"):
    pallas_mgpu_vjp.backward(q192, q192, v128, None, v128, lse, v128, causal=True, scale=0.1, kv_len=128,
                             block_sizes=pallas_mgpu_vjp.BlockSizes(fused_dq=True))
  with pytest.raises(ValueError, match="block_kv=128 must be at most 64 at head_dim=256"):
    pallas_mgpu.forward(q, q, q, None, None, mode=plan.Mode.ONLINE, causal=True, scale=0.1, kv_len=128,
                        block_sizes=pallas_mgpu.BlockSizes(block_kv=128))
  with pytest.raises(ValueError, match=r"head_dim=256 runs pallas_mgpu_vjp_wide's two kernels: use BlockSizes\(fused"):
    pallas_mgpu_vjp.backward(q, q, q, None, q, lse, q, causal=True, scale=0.1, kv_len=128,
                             block_sizes=pallas_mgpu_vjp.BlockSizes(fused_dq=True))
  q320 = jnp.zeros((1, 128, 2, 320), jnp.bfloat16)
  with pytest.raises(ValueError, match="head_dim=320 must be at most 128 or one of \\(256,\\) for the Mosaic GPU"):
    pallas_mgpu_vjp.backward(q320, q320, q320, None, q320, lse, q320, causal=True, scale=0.1, kv_len=128,
                             block_sizes=pallas_mgpu_vjp.BlockSizes())


# name, seq, q heads, kv heads, q·k head dim, v head dim, causal, packed, attention keywords
WIDE_CASES = [
    ("causal_gqa2_d256_odd", 1000, 8, 4, 256, 256, True, False, {}),
    ("bidir_packed_d256", 1024, 4, 4, 256, 256, False, True, {}),
    ("gemma2_cap50_window512_d256", 2048, 8, 4, 256, 256, True, False, dict(logits_soft_cap=50.0,
                                                                             local_window_size=512)),
    ("mla_d192_v128", 1024, 8, 8, 192, 128, True, False, {}),
]


def _float64_case(name, seq, hq, hkv, d, dv, causal, packed, kw):
  """(q, k, v, do, segment ids or None, float64's (out, dq, dk, dv)) for one GPU case: bf16 inputs from the case's
  name, v and dO cut to dv columns, q and k scaled ×4 where a soft cap is asked (so that capped logits saturate)."""
  q, k, v, do = random_inputs(len(name), 1, seq, hq, hkv, d, jnp.bfloat16)
  v, do = v[..., :dv], do[..., :dv]
  if "logits_soft_cap" in kw:
    q, k = q * 4.0, k * 4.0
  seg = packed_segments(len(name), 1, seq) if packed else None
  window = masks.as_window(kw.get("local_window_size"), causal=causal)
  return q, k, v, do, seg, ref.attention(q, k, v, do, seg, causal=causal, window=window,
                                         softcap=kw.get("logits_soft_cap"))


def _errors_against_float64(want, q, k, v, do, seg, *, causal, implementation, **kw):
  """(errors [out, dq, dk, dv] relative to float64's `want`, outputs, stats, vjp) of one attention call, each finite
  and within TOLERANCE."""
  run = lambda q, k, v: attention(q, k, v, seg, causal=causal, implementation=implementation, return_stats=True, **kw)
  (out, stats), vjp = jax.vjp(run, q, k, v)
  got = (out, *vjp((do, jax.tree.map(jnp.zeros_like, stats))))
  assert all(bool(jnp.isfinite(g.astype(jnp.float32)).all()) for g in got), (implementation, kw)
  errors = [ref.rel_err(g, w) for g, w in zip(got, want)]
  assert errors[0] < TOLERANCE[jnp.bfloat16][0] and max(errors[1:]) < TOLERANCE[jnp.bfloat16][1], (kw, errors)
  return errors, got, stats, vjp


# name, seq, q heads, kv heads, head dim, causal, packed, attention keywords
WIDE_MOSAIC_CASES = [
    ("causal_gqa2_d256_odd", 1000, 8, 4, 256, True, False, {}),
    ("bidir_packed_d256", 1024, 4, 4, 256, False, True, {}),
    ("causal_packed_gqa2_d256", 1024, 8, 4, 256, True, True, {}),
    ("bidir_odd_d200", 900, 4, 2, 200, False, False, {}),
    ("gemma2_cap50_window512_d256", 2048, 8, 4, 256, True, False, dict(logits_soft_cap=50.0, local_window_size=512)),
]


@needs_gpu
@pytest.mark.parametrize("case", WIDE_MOSAIC_CASES, ids=[c[0] for c in WIDE_MOSAIC_CASES])
def test_wide_mosaic_backward_matches_float64_on_gpu(case):
  """pallas_mgpu_vjp_wide's backward (head dims above 128) against float64: within CLIS_VS_ONLINE of the Triton
  backward's error under the same forward (pallas_mgpu_triton_bwd), online and certified, and bit-identical run to
  run (each dQ, dK and dV element is summed by one warpgroup in a fixed order)."""
  name, seq, hq, hkv, d, causal, packed, kw = case
  q, k, v, do, seg, want = _float64_case(name, seq, hq, hkv, d, d, causal, packed, kw)
  errors = {}
  for label, implementation, extra in [("mosaic", "pallas_mgpu", dict(stabilizer="online")),
                                       ("certified", "pallas_mgpu", dict(bound="blocks")),
                                       ("triton", "pallas_mgpu_triton_bwd", dict(stabilizer="online"))]:
    errors[label], got, stats, vjp = _errors_against_float64(want, q, k, v, do, seg, causal=causal,
                                                             implementation=implementation, **extra, **kw)
    if label == "certified":
      assert float(stats.certified_fraction) == 1.0, float(stats.certified_fraction)
    if label == "mosaic":
      again = (got[0], *vjp((do, jax.tree.map(jnp.zeros_like, stats))))
      assert all(bool((a == b).all()) for a, b in zip(got, again)), "the wide backward is deterministic"
  for label in ("mosaic", "certified"):
    for i in range(1, 4):
      assert errors[label][i] <= CLIS_VS_ONLINE * errors["triton"][i], (label, errors)


# name, seq, q heads, kv heads, q·k head dim, causal, packed
MLA_CASES = [
    ("causal_gqa2_odd_d192", 1000, 8, 4, 192, True, False),
    ("bidir_d192", 1024, 4, 4, 192, False, False),
    ("causal_packed_d192", 1024, 8, 8, 192, True, True),
    ("bidir_packed_odd_d160", 900, 4, 2, 160, False, True),
]


@needs_gpu
@pytest.mark.parametrize("case", MLA_CASES, ids=[c[0] for c in MLA_CASES])
def test_mla_matches_float64_on_gpu(case):
  """MLA's q·k 192 / v 128 through the Mosaic GPU forward and backward at those widths (pallas_mgpu, the default;
  named here so that it certifies at these lengths): block bound, radius bound and online against float64, each no
  less accurate (within CLIS_VS_ONLINE) than the path that pads v to 256 (the Mosaic forward with the Triton
  backward); the deterministic backward is bit-identical run to run."""
  name, seq, hq, hkv, d, causal, packed = case
  q, k, v, do = random_inputs(len(name), 1, seq, hq, hkv, d, jnp.bfloat16)
  v, do = v[..., :128], do[..., :128]
  seg = packed_segments(len(name), 1, seq) if packed else None
  want = ref.attention(q, k, v, do, seg, causal=causal)
  errors = {}
  for label, implementation, extra in [("blocks", "pallas_mgpu", dict(bound="blocks")),
                                       ("radius", "pallas_mgpu", dict(bound="radius")),
                                       ("online", "pallas_mgpu", dict(stabilizer="online")),
                                       ("padded", "pallas_mgpu_triton_bwd", dict(stabilizer="online"))]:
    errors[label], got, stats, vjp = _errors_against_float64(want, q, k, v, do, seg, causal=causal,
                                                             implementation=implementation, **extra)
    if label == "blocks":
      assert float(stats.certified_fraction) == 1.0, (label, float(stats.certified_fraction))
      again = (got[0], *vjp((do, jax.tree.map(jnp.zeros_like, stats))))
      assert all(bool((a == b).all()) for a, b in zip(got, again)), "the two-kernel backward is deterministic"
  p = plan.make_plan(dtype=q.dtype, head_dim=d, value_head_dim=128, seq_len=seq, platform=HOPPER)
  assert (p.entry.name, p.head_dim, p.value_head_dim) == ("pallas_mgpu", 192, 128)
  for label in ("blocks", "radius", "online"):
    for i in range(4):
      assert errors[label][i] <= CLIS_VS_ONLINE * errors["padded"][i], (label, errors)


@needs_gpu
@pytest.mark.parametrize("case", WIDE_CASES, ids=[c[0] for c in WIDE_CASES])
def test_wide_heads_match_float64_on_gpu(case):
  """Head dims above 128 through the Mosaic GPU forward (64-key blocks, a pre-pass's certificate: the block bound
  and the radius bound) and the Triton backward, against float64, as accurate as the all-Triton path."""
  name, seq, hq, hkv, d, dv, causal, packed, kw = case
  q, k, v, do, seg, want = _float64_case(name, seq, hq, hkv, d, dv, causal, packed, kw)
  errors = {}
  for label, implementation, extra in [("blocks", "pallas_mgpu_triton_bwd", dict(bound="blocks")),
                                       ("radius", "pallas_mgpu_triton_bwd", dict(bound="radius")),
                                       ("online", "pallas_mgpu_triton_bwd", dict(stabilizer="online")),
                                       ("triton", "pallas_gpu", {})]:
    errors[label], _, stats, _ = _errors_against_float64(want, q, k, v, do, seg, causal=causal,
                                                         implementation=implementation, **extra, **kw)
    if label == "blocks":
      assert float(stats.certified_fraction) == 1.0, (label, float(stats.certified_fraction))
  for label in ("blocks", "radius"):
    for i in range(4):
      assert errors[label][i] <= CLIS_VS_ONLINE * errors["online"][i], (label, errors)
  assert errors["online"][0] <= CLIS_VS_ONLINE * errors["triton"][0], errors


# name, seq, q heads, kv heads, head dim, causal, packed, attention keywords
WINDOW_CAP_CASES = [
    ("causal_window300_gqa4_d128", 2048, 8, 2, 128, True, False, dict(local_window_size=300)),
    ("bidir_window_odd_d64", 1000, 4, 2, 64, False, False, dict(local_window_size=(200, 90))),
    ("causal_packed_window_d128", 1000, 8, 2, 128, True, True, dict(local_window_size=250)),
    ("causal_cap30_d128", 1024, 8, 2, 128, True, False, dict(logits_soft_cap=30.0)),
    ("bidir_cap20_d64_odd", 900, 4, 4, 64, False, False, dict(logits_soft_cap=20.0)),
    ("gemma2_cap50_window512_d128", 2048, 8, 4, 128, True, False, dict(logits_soft_cap=50.0, local_window_size=512)),
]


WINDOW_CAP_RUNS = [(case, "exp2") for case in WINDOW_CAP_CASES] + [
    (case, "approx") for case in WINDOW_CAP_CASES if "logits_soft_cap" in case[-1]]


@needs_gpu
@pytest.mark.parametrize("case,tanh", WINDOW_CAP_RUNS, ids=[f"{c[0]}-{t}" for c, t in WINDOW_CAP_RUNS])
def test_window_and_soft_cap_match_float64_on_gpu(case, tanh):
  """Local windows and soft caps on the Mosaic GPU kernels: the forward (certified and online) and every backward
  (two kernels, fused, fused with split dQ at head dim 128) against float64, as accurate as the Triton backward
  (after the default forward). Inputs scaled so the capped logits saturate; both soft_cap_tanh choices."""
  name, seq, hq, hkv, d, causal, packed, kw = case
  q, k, v, do, seg, want = _float64_case(name, seq, hq, hkv, d, d, causal, packed, kw)
  forward_tiles = pallas_mgpu.BlockSizes(soft_cap_tanh=tanh)
  fwd = {}
  variants = {"clis": {}, "online": dict(stabilizer="online")}
  if "logits_soft_cap" in kw:  # clis takes the cap's bound (Mode.CAP); the in-kernel radius bound too
    variants["clis_radius"] = dict(bound="radius")
  for label, variant in variants.items():
    out = attention(q, k, v, seg, causal=causal, implementation="pallas_mgpu", block_sizes=forward_tiles, **variant,
                    **kw)
    fwd[label] = ref.rel_err(out, want[0])
    assert fwd[label] < TOLERANCE[jnp.bfloat16][0], (label, fwd)
  assert fwd["clis"] <= CLIS_VS_ONLINE * fwd["online"], fwd
  if "logits_soft_cap" in kw:  # c <= tau / 2: every tile certifies, by either bound
    for label in ("clis", "clis_radius"):
      _, capped = attention(q, k, v, seg, causal=causal, implementation="pallas_mgpu", return_stats=True,
                            block_sizes=forward_tiles, **variants[label], **kw)
      assert float(capped.certified_fraction) == 1.0, label
    assert fwd["clis_radius"] <= CLIS_VS_ONLINE * fwd["online"], fwd
  errors = {}
  for label, (implementation, backward_tiles) in BACKWARDS.items():
    if label == "split" and d != 128:
      continue
    tiles = {}
    if label != "triton":  # the Triton backward after the default forward: the accurate baseline
      tiles = dict(block_sizes=forward_tiles, backward_block_sizes=dataclasses.replace(
          backward_tiles or pallas_mgpu_vjp.default_block_sizes(d, seq, jnp.bfloat16), soft_cap_tanh=tanh))
    f = lambda q, k, v: attention(q, k, v, seg, causal=causal, implementation=implementation, **tiles, **kw)
    grads = jax.vjp(f, q, k, v)[1](do)
    assert all(bool(jnp.isfinite(g.astype(jnp.float32)).all()) for g in grads), label
    errors[label] = [ref.rel_err(g, w) for g, w in zip(grads, want[1:])]
  for label in errors:
    assert max(errors[label]) < TOLERANCE[jnp.bfloat16][1], (label, errors)
    for mosaic, triton in zip(errors[label], errors["triton"]):
      assert mosaic <= CLIS_VS_ONLINE * triton, (label, errors)


@needs_gpu
@pytest.mark.parametrize("granularity,packed", [("head", False), ("tile", True)])
def test_failed_tiles_stay_exact_on_gpu(granularity, packed):
  """Failed tiles (a sink) run the online loop, the rest the certified one, and the output matches
  float64: with the XLA certificate (granularity="head") and with the in-kernel one on packed rows."""
  q, k, v, do = random_inputs(3, 1, 1024, 4, 2, 128, jnp.bfloat16)
  k = k.at[:, 600, 0].multiply(40.0)  # a sink in kv head 0 only: its query heads fail, the others pass
  seg = packed_segments(3, 1, 1024) if packed else None
  out, stats = attention(q, k, v, seg, causal=True, granularity=granularity, implementation="pallas_mgpu",
                         return_stats=True)
  assert 0.0 < float(stats.certified_fraction) < 1.0
  want = ref.attention(q, k, v, do, seg, causal=True)[0]
  online = attention(q, k, v, seg, causal=True, stabilizer="online", implementation="pallas_mgpu")
  assert ref.rel_err(out, want) < TOLERANCE[jnp.bfloat16][0]
  assert ref.rel_err(out, want) <= CLIS_VS_ONLINE * ref.rel_err(online, want)


@needs_gpu
@pytest.mark.parametrize("causal", [True, False])
def test_packed_in_kernel_certificate_is_never_looser_than_xla_on_gpu(causal):
  """Packed rows certify in the kernel against their segment's centre rounded to bf16, with the
  rounding slack added to the bound: it may refuse a tile the XLA certificate passes, never the reverse."""
  from clis_kernels import stabilizer
  q, k, v, _ = random_inputs(11, 1, 1024, 4, 1, 128, jnp.bfloat16)
  k = k.at[:, 600].multiply(40.0)
  seg = packed_segments(11, 1, 1024)
  _, stats = attention(q, k, v, seg, causal=causal, implementation="pallas_mgpu", tau=64.0, return_stats=True)
  cert = stabilizer.certify(q, k, v, seg, causal=causal, scale=128 ** -0.5, tau=64.0, granularity="tile",
                            block_q=64, seq_len=1024)
  kernel, xla = np.asarray(stats.certified_tiles), np.asarray(cert.certified)
  assert not np.any(kernel & ~xla) and kernel.mean() >= xla.mean() - 0.1, (kernel, xla)


@needs_gpu
def test_default_on_hopper_is_this_backend_on_gpu():
  """implementation=None takes the Mosaic GPU kernels for bf16 (forward and gradients bit for bit; their online loop,
  plan.CERTIFY_ON_HOPPER), Triton for f32."""
  q, k, v, do = random_inputs(5, 1, 512, 4, 2, 128, jnp.bfloat16)
  loss = lambda **kw: lambda q, k, v: jnp.vdot(attention(q, k, v, **kw).astype(jnp.float32), do.astype(jnp.float32))
  for got, want in zip(jax.value_and_grad(loss(), argnums=(0, 1, 2))(q, k, v),
                       jax.value_and_grad(loss(implementation="pallas_mgpu", stabilizer="online"),
                                          argnums=(0, 1, 2))(q, k, v)):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
  q32, k32, v32 = (x.astype(jnp.float32) for x in (q, k, v))
  np.testing.assert_array_equal(np.asarray(attention(q32, k32, v32)),
                                np.asarray(attention(q32, k32, v32, implementation="pallas_gpu")))


@needs_gpu
def test_matches_the_triton_backend_on_gpu():
  q, k, v, _ = random_inputs(7, 1, 2048, 8, 2, 128, jnp.bfloat16)
  for causal in (True, False):
    mosaic = attention(q, k, v, causal=causal, implementation="pallas_mgpu").astype(jnp.float32)
    triton = attention(q, k, v, causal=causal, implementation="pallas_gpu").astype(jnp.float32)
    assert float(jnp.abs(mosaic - triton).max()) < 2e-2


@needs_gpu
@pytest.mark.parametrize("block_kv,slots,pingpong,overlap", [
    (128, 2, True, False), (64, 2, True, False), (64, 3, True, False), (64, 4, True, False),
    (128, 2, False, False), (64, 3, False, False), (128, 2, False, True), (64, 3, False, True)])
def test_every_tile_config_is_exact_on_gpu(block_kv, slots, pingpong, overlap):
  bs = pallas_mgpu.BlockSizes(block_kv=block_kv, slots=slots, pingpong=pingpong, overlap=overlap)
  for causal, seq in ((True, 640), (False, 1000)):
    q, k, v, do = random_inputs(seq + slots, 1, seq, 4, 2, 128, jnp.bfloat16)
    want = ref.attention(q, k, v, do, causal=causal)[0]
    err = {}
    for stabilizer in ("clis", "online"):
      out = attention(q, k, v, causal=causal, stabilizer=stabilizer, implementation="pallas_mgpu", block_sizes=bs)
      err[stabilizer] = ref.rel_err(out, want)
      assert err[stabilizer] < TOLERANCE[jnp.bfloat16][0], (causal, err)
    assert err["clis"] <= CLIS_VS_ONLINE * err["online"], (causal, err)


@needs_gpu
@pytest.mark.parametrize("causal", [True, False])
def test_in_kernel_certificate_matches_the_xla_certificate_on_gpu(causal):
  """granularity="tile" certifies in the kernel; the XLA certificate must decide the same tiles."""
  from clis_kernels import stabilizer
  q, k, v, _ = random_inputs(9, 1, 1024, 4, 1, 128, jnp.bfloat16)
  k = k.at[:, 600].multiply(40.0)  # a sink: some tiles fail, in both decisions
  out, stats = attention(q, k, v, causal=causal, implementation="pallas_mgpu", tau=64.0, return_stats=True)
  cert = stabilizer.certify(q, k, v, None, causal=causal, scale=128 ** -0.5, tau=64.0, granularity="tile",
                            block_q=64, seq_len=1024)
  np.testing.assert_array_equal(np.asarray(stats.certified_tiles), np.asarray(cert.certified))
  assert 0.0 < float(stats.certified_fraction) < 1.0 or not causal
  online = attention(q, k, v, causal=causal, stabilizer="online", implementation="pallas_mgpu")
  assert float(jnp.abs(out.astype(jnp.float32) - online.astype(jnp.float32)).max()) < 2e-2


@pytest.mark.parametrize("causal", [True, False])
def test_packed_kernel_bounds_cover_every_visible_key(causal):
  """The kernel's packed inputs bound ‖k_j − c'_i‖ for every row i and every key j it may see, so U
  stays an upper bound (CPU): bidirectional rows' segment centres rounded to bf16 with radius +
  rounding slack; causal rows' one f32 centre, whose radius spans every segment's keys."""
  from clis_kernels import masks, stabilizer
  _, k, v, _ = random_inputs(13, 1, 256, 2, 2, 64, jnp.bfloat16, key_offset=3.0)
  seg = packed_segments(13, 1, 256)
  keys = stabilizer.key_bounds(k, v, seg, causal=causal, tau=64.0, block_q=64, seq_len=256)
  row_centres = keys.centre.shape[1] != 1
  assert row_centres == (not causal)
  centre, bounds = pallas_mgpu.kernel_key_inputs(keys, row_centres=row_centres, dtype=jnp.bfloat16, seq=256,
                                                 tile=64)
  if row_centres:  # rounding did move the centres, and the slack covers it
    assert centre.dtype == jnp.bfloat16 and float(bounds[:, :, 3].max()) > 0.0
  else:
    assert centre.dtype == jnp.float32 and float(bounds[:, :, 3].max()) == 0.0
  pos = jnp.arange(256)
  visible = masks.visible(pos, pos, seg[0], seg[0], causal=causal, kv_len=None)  # [rows, keys]
  dist = jnp.linalg.norm(k[0].astype(jnp.float32)[None, :] - centre[0].astype(jnp.float32)[:, None], axis=-1)
  radius = bounds[0, :, 0].T  # [rows, Hkv]
  real = (seg[0] != 0)[:, None, None]
  assert bool(jnp.all(jnp.where(visible[..., None] & real, dist <= radius[:, None, :] + 1e-4, True)))


@needs_gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=[c[0] for c in GPU_CASES])
def test_tensor_core_sum_matches_float64_on_gpu(case):
  """The certified loop with l summed on the tensor cores: the base's float64 check at the default tiles."""
  name, batch, seq, hq, hkv, d, causal, packed = case
  tests = TestPallasMgpu()
  tests.block_sizes = pallas_mgpu.BlockSizes(sum_on_tensor_cores=True)
  tests.check_case((name, batch, seq, hq, hkv, d, jnp.bfloat16, causal, packed))


@pytest.mark.parametrize("seed", range(6))
def test_segment_block_ranges_hold_every_visible_pair(seed):
  """masks.segment_block_ranges: every block pair with a visible (same-id, non-padding) pair lies inside
  [first, last], for arbitrary ids too; for packed documents (contiguous runs of ids 1, 2, 3, ...) the range
  is exactly the blocks that see something."""
  from clis_kernels import masks
  rng = np.random.default_rng(seed)
  seq, rows, cols = 512, 128, 64
  ids = np.asarray(testing.short_documents(seed, 2, seq, mean_len=[8, 40, 150][seed % 3]))
  if seed >= 3:  # arbitrary ids: not contiguous, not sorted
    ids = np.where(ids > 0, rng.integers(1, 9, size=ids.shape), 0)
  first, last = (np.asarray(x) for x in masks.segment_block_ranges(jnp.asarray(ids), jnp.asarray(ids),
                                                                   row_block=rows, col_block=cols))
  same = (ids[:, :, None] == ids[:, None, :]) & (ids[:, None, :] != 0)
  seen = same.reshape(2, seq // rows, rows, seq // cols, cols).any(axis=(2, 4))  # [B, row blocks, col blocks]
  blocks = np.arange(seq // cols)
  inside = (blocks[None, None, :] >= first[..., None]) & (blocks[None, None, :] <= last[..., None])
  assert not (seen & ~inside).any()
  if seed < 3:  # packed documents: the range is exactly the blocks that see something
    np.testing.assert_array_equal(seen, inside)


@pytest.mark.skipif(ON_GPU, reason="lowering check for machines without a GPU")
@pytest.mark.parametrize("stabilizer,fused,d", [("online", False, 64), ("clis", True, 64), ("clis", False, 128)])
def test_document_ranges_lower_for_the_gpu(stabilizer, fused, d):
  """BlockSizes(document_ranges=True), forward and both backwards: each CTA's first (or last) block travels as
  a range row its memory warpgroup loads; packed causal calls lower as the same number of kernels."""
  q = jax.ShapeDtypeStruct((1, 500, 8, d), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((1, 500, 2, d), jnp.bfloat16)
  seg = jax.ShapeDtypeStruct((1, 500), jnp.int32)

  def loss(q, k, v, seg):
    return attention(q, k, v, seg, causal=True, stabilizer=stabilizer, implementation="pallas_mgpu",
                     platform=HOPPER, block_sizes=pallas_mgpu.BlockSizes(document_ranges=True),
                     backward_block_sizes=pallas_mgpu_vjp.BlockSizes(document_ranges=True, fused_dq=fused)
                     ).astype(jnp.float32).sum()

  text = lower_for_h200(jax.grad(loss, argnums=(0, 1, 2)), q, k, k, seg)
  assert text.count("custom_call @mosaic_gpu") == (2 if fused else 3)


@needs_gpu
@pytest.mark.parametrize("stabilizer,d,mean_len", [("online", 64, 60), ("clis", 128, 300), ("clis", 64, 700)])
def test_document_ranges_change_nothing_on_gpu(stabilizer, d, mean_len):
  """Skipping the blocks before (after) the documents' first (last) block adds only exact zeros: forward and
  the two-kernel backward bit-identical to the full causal loops; the fused backward against float64. Many short
  documents, a padded tail, an odd length, GQA."""
  seq = 2000
  q, k, v, do = random_inputs(d + mean_len, 2, seq, 8, 2, d, jnp.bfloat16)
  seg = testing.short_documents(mean_len, 2, seq, mean_len)
  results = {}
  for ranges in (False, True):
    for fused in (False, True):
      f = lambda q, k, v: attention(q, k, v, seg, causal=True, stabilizer=stabilizer, implementation="pallas_mgpu",
                                    block_sizes=pallas_mgpu.BlockSizes(document_ranges=ranges),
                                    backward_block_sizes=pallas_mgpu_vjp.BlockSizes(document_ranges=ranges,
                                                                                    fused_dq=fused))
      out, vjp = jax.vjp(f, q, k, v)
      results[ranges, fused] = (out, *vjp(do))
  for got, want in zip(results[True, False], results[False, False]):
    np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), np.asarray(want.astype(jnp.float32)))
  want = ref.attention(q, k, v, do, seg, causal=True)
  for got, full, exact in zip(results[True, True], results[False, True], want):
    assert ref.rel_err(got, exact) <= CLIS_VS_ONLINE * max(ref.rel_err(full, exact), 1e-3)


@needs_gpu
@pytest.mark.parametrize("causal,seq,d,packed,kw,heads,block_kv", HEADS_PER_CTA_CASES)
def test_heads_per_cta_changes_nothing_on_gpu(causal, seq, d, packed, kw, heads, block_kv):
  """A CTA walking several heads of a GQA group runs each head's loop as its own CTA did: o and lse bit-identical to
  heads_per_cta=1, and o against float64 (seq scaled up so the stream wraps over several slots per head)."""
  seq, batch = seq * 8, 1
  q, k, v, do = random_inputs(seq + d, batch, seq, 8, 2, d, jnp.bfloat16)
  if "logits_soft_cap" in kw:
    q, k = q * 4.0, k * 4.0
  seg = packed_segments(seq, batch, seq) if packed else None
  got = {}
  for n in (1, heads):
    got[n] = attention(q, k, v, seg, causal=causal, implementation="pallas_mgpu", stabilizer="online",
                       block_sizes=_heads_tiles(d, n, block_kv), **kw)
  np.testing.assert_array_equal(np.asarray(got[heads].astype(jnp.float32)), np.asarray(got[1].astype(jnp.float32)))
  window = masks.as_window(kw.get("local_window_size"), causal=causal)
  want = ref.attention(q, k, v, do, seg, causal=causal, window=window, softcap=kw.get("logits_soft_cap"))[0]
  assert ref.rel_err(got[heads], want) < TOLERANCE[jnp.bfloat16][0]


# stabilizer, attention keywords: the forward's loops (online; certified by the in-kernel radius bound; certified by
# the cap's bound, through the XLA certificate)
LOOP_CASES = [("online", {}), ("clis", {}), ("clis", dict(logits_soft_cap=30.0, bound="cap"))]


@pytest.mark.skipif(ON_GPU, reason="lowering check for machines without a GPU")
@pytest.mark.parametrize("stabilizer,kw", LOOP_CASES)
@pytest.mark.parametrize("causal,packed", [(True, True), (False, False)])
def test_four_streaming_warps_lower_for_the_gpu(stabilizer, kw, causal, packed):
  """BlockSizes(one_memory_warp=False), the whole memory warpgroup streaming K/V, lowers for an H200 as one forward
  kernel in each loop (the default, one warp, lowers in every other lowering test)."""
  q = jax.ShapeDtypeStruct((1, 256, 8, 128), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((1, 256, 2, 128), jnp.bfloat16)
  seg = jax.ShapeDtypeStruct((1, 256), jnp.int32) if packed else None
  fwd = lambda q, k, v, seg: attention(q, k, v, seg, causal=causal, implementation="pallas_mgpu", platform=HOPPER,
                                       stabilizer=stabilizer, block_sizes=pallas_mgpu.BlockSizes(one_memory_warp=False),
                                       **kw)
  assert lower_for_h200(fwd, q, k, k, seg).count("custom_call @mosaic_gpu") == 1


@needs_gpu
@pytest.mark.parametrize("stabilizer,kw", LOOP_CASES)
@pytest.mark.parametrize("causal,packed", [(True, True), (False, False)])
def test_streaming_warps_change_nothing_on_gpu(stabilizer, kw, causal, packed):
  """One streaming warp (the default) or four only order the loads: o bit-identical either way, and within bf16's
  tolerance of float64 (inputs scaled up with a cap, so that it bites)."""
  seq = 1024
  q, k, v, do = random_inputs(seq + len(kw), 1, seq, 8, 2, 128, jnp.bfloat16)
  if "logits_soft_cap" in kw:
    q, k = q * 4.0, k * 4.0
  seg = packed_segments(seq, 1, seq) if packed else None
  got = {one: attention(q, k, v, seg, causal=causal, implementation="pallas_mgpu", stabilizer=stabilizer,
                        block_sizes=pallas_mgpu.BlockSizes(one_memory_warp=one), **kw) for one in (True, False)}
  np.testing.assert_array_equal(np.asarray(got[True].astype(jnp.float32)), np.asarray(got[False].astype(jnp.float32)))
  want = ref.attention(q, k, v, do, seg, causal=causal, softcap=kw.get("logits_soft_cap"))[0]
  assert ref.rel_err(got[True], want) < TOLERANCE[jnp.bfloat16][0]


NAMED_CASES = [  # (d, hq, hkv, causal, packed, stabilizer, keywords): Gemma 2's local layer (cap, window), a
    # causal drain with 64-key blocks (the two warpgroups' ranges differ by a block), packed, bidirectional, sinks
    (256, 4, 2, True, False, "online", dict(logits_soft_cap=50.0, local_window_size=(384, 0))),
    (256, 4, 2, True, False, "clis", dict(logits_soft_cap=50.0, bound="cap", local_window_size=(384, 0))),
    (256, 4, 2, True, False, "clis", {}),
    (128, 8, 2, True, True, "clis", {}),
    (128, 8, 2, False, False, "online", {}),
    (64, 8, 2, True, False, "online", dict(local_window_size=(128, 0))),
    (64, 8, 1, True, False, "online", dict(sinks=True)),  # gpt-oss's full layers: D 64, learned sinks
    (64, 8, 1, True, False, "clis", dict(sinks=True)),
]


def _named_case_keywords(kw: dict, hq: int) -> dict:
  """NAMED_CASES' keywords for `attention`: sinks=True stands for learned sink logits [hq] spread over ±3."""
  return {**kw, "sinks": jnp.linspace(-3.0, 3.0, hq, dtype=jnp.float32)} if kw.get("sinks") is True else kw


@pytest.mark.skipif(ON_GPU, reason="lowering check for machines without a GPU")
@pytest.mark.parametrize("d,hq,hkv,causal,packed,stabilizer,kw", NAMED_CASES)
def test_named_barriers_lower_for_the_gpu(d, hq, hkv, causal, packed, stabilizer, kw):
  """BlockSizes(named_barriers=True) lowers for an H200 as one forward kernel holding the schedule's and the slots'
  hardware barrier operations (FA3's: each warpgroup arrives for the other, 256 threads; slots: 288)."""
  q = jax.ShapeDtypeStruct((1, 512, hq, d), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((1, 512, hkv, d), jnp.bfloat16)
  seg = jax.ShapeDtypeStruct((1, 512), jnp.int32) if packed else None
  tiles = dataclasses.replace(pallas_mgpu.default_block_sizes(d, 512, jnp.bfloat16), named_barriers=True)
  kw = _named_case_keywords(kw, hq)
  fwd = lambda q, k, v, seg: attention(q, k, v, seg, causal=causal, implementation="pallas_mgpu", platform=HOPPER,
                                       stabilizer=stabilizer, block_sizes=tiles, **kw)
  text = lower_for_h200(fwd, q, k, k, seg)
  assert text.count("custom_call @mosaic_gpu") == 1
  for op in ("bar.arrive $0, 256;", "bar.sync $0, 256;", "bar.arrive $0, 288;", "bar.sync $0, 288;"):
    assert op in text, op


def test_named_barriers_refuse_kept_tile_lists():
  q = jnp.zeros((1, 256, 2, 128), jnp.bfloat16)
  visit = jnp.zeros((1, 2, 2, 4), jnp.int32)
  with pytest.raises(ValueError, match="named_barriers=True takes no kept-tile list"):
    jax.eval_shape(lambda q, visit: pallas_mgpu.forward_listed(
        q, q, q, visit, None, mode=plan.Mode.ONLINE, scale=0.1, kv_len=None, track=False,
        block_sizes=pallas_mgpu.BlockSizes(named_barriers=True)), q, visit)


def test_named_barriers_are_the_default_at_head_dim_256_only():
  """BlockSizes(named_barriers=None) takes them where they measured faster (head dim 256, q and v alike) and the call
  fits them; elsewhere, and with a kept-tile list (forward_listed), the mbarrier schedule."""
  auto = functools.partial(pallas_mgpu.auto_named_barriers, heads=1, listed=False)
  wide = pallas_mgpu.default_block_sizes(256, 8192, jnp.bfloat16)
  assert wide.named_barriers is None and auto(wide, head_dim=256, value_head_dim=256)
  assert not auto(pallas_mgpu.BlockSizes(), head_dim=128, value_head_dim=128)
  assert not auto(pallas_mgpu.BlockSizes(), head_dim=192, value_head_dim=128)  # MLA
  assert not auto(wide, head_dim=256, value_head_dim=256, listed=True)
  assert not auto(wide, head_dim=256, value_head_dim=256, heads=2)
  for changes in (dict(pingpong=False, overlap=True), dict(one_memory_warp=False), dict(slots=6)):
    assert not auto(dataclasses.replace(wide, **changes), head_dim=256, value_head_dim=256), changes
  q = jnp.zeros((1, 256, 2, 256), jnp.bfloat16)
  visit = jnp.zeros((1, 2, 2, 4), jnp.int32)
  o = jax.eval_shape(lambda q, visit: pallas_mgpu.forward_listed(
      q, q, q, visit, None, mode=plan.Mode.ONLINE, scale=0.1, kv_len=None, track=False, block_sizes=wide), q, visit)[0]
  assert o.shape == q.shape


@needs_gpu
@pytest.mark.parametrize("d,hq,hkv,causal,packed,stabilizer,kw", NAMED_CASES)
def test_named_barriers_change_nothing_on_gpu(d, hq, hkv, causal, packed, stabilizer, kw):
  """The turns and the slots' release on named barriers only order the same steps: o bit-identical to the mbarrier
  schedule's, and within bf16's tolerance of float64 (inputs scaled up with a cap, so that it bites)."""
  seq = 2048
  q, k, v, do = random_inputs(seq + d, 1, seq, hq, hkv, d, jnp.bfloat16)
  if "logits_soft_cap" in kw:
    q, k = q * 4.0, k * 4.0
  seg = packed_segments(seq, 1, seq) if packed else None
  tiles = pallas_mgpu.default_block_sizes(d, seq, jnp.bfloat16)
  kw = _named_case_keywords(kw, hq)
  got = {named: attention(q, k, v, seg, causal=causal, implementation="pallas_mgpu", stabilizer=stabilizer,
                          block_sizes=dataclasses.replace(tiles, named_barriers=named), **kw) for named in (True, False)}
  np.testing.assert_array_equal(np.asarray(got[True].astype(jnp.float32)), np.asarray(got[False].astype(jnp.float32)))
  if "sinks" in kw:
    from test_sinks_and_split_heads import dense64
    want = dense64(q, k, v, seg, kw["sinks"], causal=causal)
  else:
    want = ref.attention(q, k, v, do, seg, causal=causal, softcap=kw.get("logits_soft_cap"),
                         window=kw.get("local_window_size"))[0]
  assert ref.rel_err(got[True], want) < TOLERANCE[jnp.bfloat16][0]


def test_profiler_is_off_unless_a_directory_is_named(monkeypatch, tmp_path):
  """mgpu_pipeline.compiler_params: approximate math always; Mosaic GPU's in-kernel profiler only when
  CLIS_MGPU_PROFILE_DIR is set (then CLIS_MGPU_PROFILE_SPACE events per call)."""
  monkeypatch.delenv("CLIS_MGPU_PROFILE_DIR", raising=False)
  params = mgpu_pipeline.compiler_params()
  assert params.approx_math and (params.profile_space, params.profile_dir) == (0, "")
  monkeypatch.setenv("CLIS_MGPU_PROFILE_DIR", str(tmp_path))
  monkeypatch.setenv("CLIS_MGPU_PROFILE_SPACE", "512")
  params = mgpu_pipeline.compiler_params()
  assert (params.profile_space, params.profile_dir, params.profile_bounds_check) == (512, str(tmp_path), True)


@needs_gpu
@pytest.mark.parametrize("stabilizer", ["online", "clis"])
def test_profiled_forward_writes_its_step_regions_on_gpu(monkeypatch, tmp_path, stabilizer):
  """With CLIS_MGPU_PROFILE_DIR set the forward runs under Mosaic GPU's profiler (which needs a GPU even to lower:
  it reads its buffer back through a host callback) and writes a trace naming the step's regions; the output is
  the unprofiled one's."""
  q, k, v, _ = random_inputs(7, 1, 1024, 4, 2, 128, jnp.bfloat16)
  call = lambda q, k, v: attention(q, k, v, causal=True, implementation="pallas_mgpu", stabilizer=stabilizer)
  plain = jax.jit(call)(q, k, v)
  monkeypatch.setenv("CLIS_MGPU_PROFILE_DIR", str(tmp_path))
  profiled = jax.block_until_ready(jax.jit(lambda q, k, v: call(q, k, v))(q, k, v))
  np.testing.assert_array_equal(np.asarray(profiled.astype(jnp.float32)), np.asarray(plain.astype(jnp.float32)))
  traces = sorted(tmp_path.glob("*trace.json"))
  assert traces, list(tmp_path.iterdir())
  text = traces[-1].read_text()
  assert all(name in text for name in ("qk_wait", "softmax", "await_turn", "pv")), text[:300]


@needs_gpu
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("ranges", [False, True])
def test_document_ranges_skip_the_blocks_where_documents_do_not_meet_on_gpu(ranges, fused):
  """With document_ranges the NaNs of testing.documents_left_out stay out of the second document's output and
  dQ and of the first's dK and dV (forward, two-kernel and fused backward): the blocks are skipped, not masked."""
  run = lambda q, k, v, seg, ranges: attention(
      q, k, v, seg, causal=True, implementation="pallas_mgpu",
      block_sizes=pallas_mgpu.BlockSizes(document_ranges=ranges),
      backward_block_sizes=pallas_mgpu_vjp.BlockSizes(document_ranges=ranges, fused_dq=fused))
  assert testing.documents_left_out(run, ranges, jnp.bfloat16) == [ranges] * 4


@pytest.mark.parametrize("block_q,block_k", [(64, 128), (128, 64), (64, 64)])
def test_causal_document_ranges_hold_every_visible_causal_pair(block_q, block_k):
  """masks.causal_document_ranges: every causally visible same-document pair lies in [first, causal end) of its
  q block and in [causal start, end) of its kv block; first stays at or before the q block's first masked kv
  block and end at or after one past the q block of the kv block's last key."""
  from clis_kernels import masks
  ids = testing.short_documents(3, 2, 512, 40)
  first, end = (np.asarray(x) for x in masks.causal_document_ranges(masks.SegmentIds(ids, ids), block_q=block_q,
                                                                      block_k=block_k))
  ids = np.asarray(ids)
  pos = np.arange(512)
  seen = (ids[:, :, None] == ids[:, None, :]) & (ids[:, None, :] != 0) & (pos[:, None] >= pos[None, :])
  qb, kb = np.nonzero(seen.reshape(2, 512 // block_q, block_q, 512 // block_k, block_k).any(axis=(2, 4))[0])
  assert np.all(first[0][qb] <= kb) and np.all(end[0][kb] > qb)
  nq, nk = 512 // block_q, 512 // block_k
  assert np.all(first <= np.arange(nq) * block_q // block_k)
  assert np.all(end >= ((np.arange(nk) + 1) * block_k - 1) // block_q + 1) and np.all(end <= nq)


@pytest.mark.parametrize("rows,block", [(64, 128), (64, 64), (128, 64)])
def test_window_whole_blocks_are_wholly_visible_and_the_rest_of_the_band_is_masked(rows, block):
  """masks.window_full_blocks / masked_edges, as the Mosaic GPU kernels split a window's band: the blocks they run
  unmasked are exactly those every row sees whole (queries over key blocks; mirrored, keys over query blocks)."""
  seq, num_blocks = 1024, 1024 // block
  pos = np.arange(seq)
  for window in [(100, 0), (300, 0), (40, 70), (0, 0), (1000, 1000), (16, 8)]:
    for kv_len in (None, 1000):
      seen = (pos[None, :] >= pos[:, None] - window[0]) & (pos[None, :] <= pos[:, None] + window[1])
      if kv_len is not None:
        seen &= pos[None, :] < kv_len
      for mirrored in (False, True) if kv_len is None else (False,):  # the dK/dV kernel passes no kv_len
        vis = seen.T if mirrored else seen  # rows = keys, columns = queries: the window mirrored
        for row0 in range(0, seq, rows):
          whole = masks.window_full_blocks(row0, rows=rows, window=window[::-1] if mirrored else window, block=block,
                                           kv_len=None if mirrored else kv_len, div=lambda a, b: a // b)
          lead, full = (int(x) for x in masks.masked_edges(0, num_blocks, whole))
          band = vis[row0:row0 + rows].reshape(rows, num_blocks, block)
          wholly = [b for b in range(num_blocks) if band[:, b].all()]  # contiguous: a window's band is
          assert (lead, full) == ((wholly[0], wholly[-1] + 1) if wholly else (lead, lead)), (
              window, kv_len, mirrored, row0, wholly, lead, full)


# (name, seq, q·k head dim, v head dim, causal, packed, attention keywords, backward tiles): each backward kernel
# family with BlockSizes(overlap_dq=True, overlap_dkv=True) — the two kernels at 128, the fused one at 64, split dQ, the wide
# kernels at 256, MLA's 192/128 — and the soft cap with a window
OVERLAP = pallas_mgpu_vjp.BlockSizes(overlap_dq=True, overlap_dkv=True)
OVERLAP_CASES = [
    ("causal_d128", 1000, 128, 128, True, False, {}, OVERLAP),
    ("causal_packed_d64_fused", 1000, 64, 64, True, True, {}, dataclasses.replace(OVERLAP, fused_dq=True)),
    ("causal_packed_d256", 1000, 256, 256, True, True, {}, OVERLAP),
    ("causal_mla", 1000, 192, 128, True, False, {}, OVERLAP),
    ("causal_cap30_window300_d128", 1024, 128, 128, True, False, dict(logits_soft_cap=30.0, local_window_size=300),
     OVERLAP),
    ("bidir_cap30_d256", 640, 256, 256, False, False, dict(logits_soft_cap=30.0), OVERLAP)]


@pytest.mark.skipif(ON_GPU, reason="lowering check for machines without a GPU")
@pytest.mark.parametrize("name,seq,d,dv,causal,packed,kw,tiles", OVERLAP_CASES, ids=[c[0] for c in OVERLAP_CASES])
def test_overlapped_matmuls_lower_for_the_gpu(name, seq, d, dv, causal, packed, kw, tiles):
  """BlockSizes(overlap_dq=True, overlap_dkv=True) lowers for an H200 in every backward kernel family: each step issues dP's
  wgmma behind S's and waits for S alone."""
  q = jax.ShapeDtypeStruct((1, seq, 8, d), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((1, seq, 2, d), jnp.bfloat16)
  v = jax.ShapeDtypeStruct((1, seq, 2, dv), jnp.bfloat16)
  seg = jax.ShapeDtypeStruct((1, seq), jnp.int32) if packed else None

  def loss(q, k, v, seg):
    return attention(q, k, v, seg, causal=causal, implementation="pallas_mgpu", platform=HOPPER,
                     backward_block_sizes=tiles, **kw).astype(jnp.float32).sum()

  text = lower_for_h200(jax.grad(loss, argnums=(0, 1, 2)), q, k, v, seg)
  assert text.count("custom_call @mosaic_gpu") == (2 if tiles.fused_dq else 3) and "clis_bwd" not in text


@needs_gpu
@pytest.mark.parametrize("name,seq,d,dv,causal,packed,kw,tiles", OVERLAP_CASES, ids=[c[0] for c in OVERLAP_CASES])
def test_overlapped_matmuls_change_nothing_on_gpu(name, seq, d, dv, causal, packed, kw, tiles):
  """overlap_dq and overlap_dkv only reorder the wgmmas and their waits: dq, dk, dv bit-identical to the same backward without
  it (the fused kernels add dQ's parts in no fixed order, so there dQ is held to float64's tolerance only), and
  within bf16's tolerance of float64."""
  q, k, v, do, seg, want = _float64_case(name, seq, 8, 2, d, dv, causal, packed, kw)

  def grads(t):
    f = lambda q, k, v: attention(q, k, v, seg, causal=causal, implementation="pallas_mgpu", backward_block_sizes=t,
                                  **kw)
    return jax.vjp(f, q, k, v)[1](do)

  got, before = grads(tiles), grads(dataclasses.replace(tiles, overlap_dq=False, overlap_dkv=False))
  for i, (a, b) in enumerate(zip(got, before)):
    if i or not tiles.fused_dq:
      np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32)), err_msg=i)
  errors = [ref.rel_err(g, w) for g, w in zip(got, want[1:])]
  assert max(errors) < TOLERANCE[jnp.bfloat16][1], errors


DV_MOVED = [(128, 128, True), (128, 128, False), (192, 128, True), (192, 128, False), (256, 256, True),
            (256, 256, False)]


@pytest.mark.skipif(ON_GPU, reason="lowering check for machines without a GPU")
@pytest.mark.parametrize("d,dv,overlap", DV_MOVED)
def test_dkv_kernel_with_dv_behind_dp_lowers_for_the_gpu(d, dv, overlap):
  """BlockSizes(dv_with_dp=True): the dK/dV kernel (the wide one at 256) with dV's wgmma issued behind dP's, with S
  and dP overlapped or not (tokamax's order), lowers for an H200."""
  s = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)
  lse = jax.ShapeDtypeStruct((1, 8, 1024), jnp.float32)
  tiles = pallas_mgpu_vjp.BlockSizes(overlap_dq=overlap, overlap_dkv=overlap, dv_with_dp=True)
  f = lambda q, k, v, o, lse: pallas_mgpu_vjp.Launches(q, k, v, None, o, lse, o, causal=True, scale=0.1, kv_len=None,
                                                       block_sizes=tiles).dkv()
  text = lower_for_h200(f, s(1, 1024, 8, d), s(1, 1024, 2, d), s(1, 1024, 2, dv), s(1, 1024, 8, dv), lse)
  assert text.count("custom_call @mosaic_gpu") == 1


def test_dv_behind_dp_is_refused_by_the_fused_kernel():
  """The fused kernel has its own dV order: dv_with_dp=True with fused_dq=True is one clear error."""
  with pytest.raises(ValueError, match="the fused kernel \\(fused_dq=True\\) forms dV in its own order"):
    pallas_mgpu_vjp.BlockSizes(fused_dq=True, dv_with_dp=True)


@needs_gpu
@pytest.mark.parametrize("d,dv,overlap", DV_MOVED)
def test_dkv_kernel_with_dv_behind_dp_changes_nothing_on_gpu(d, dv, overlap):
  """Moving dV's wgmma (BlockSizes.dv_with_dp) reorders the dK/dV kernel's matmuls only: dk, dv bit-identical."""
  q, k, v, do = random_inputs(d + overlap, 1, 1024, 8, 2, d, jnp.bfloat16)
  v, do = v[..., :dv], do[..., :dv]
  lse = jax.random.normal(jax.random.PRNGKey(1), (1, 8, 1024), jnp.float32) + 8.0
  run = lambda moved: jax.jit(lambda q, k, v, do, lse: pallas_mgpu_vjp.Launches(
      q, k, v, None, do, lse, do, causal=True, scale=d ** -0.5, kv_len=None, block_sizes=pallas_mgpu_vjp.BlockSizes(
          overlap_dq=overlap, overlap_dkv=overlap, dv_with_dp=moved)).dkv())(q, k, v, do, lse)
  for a, b in zip(run(True), run(False)):
    np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32)))
