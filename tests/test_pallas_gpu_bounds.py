"""The block bound's (U, L) kernel (pallas_gpu_bounds, Pallas interpret mode on the CPU) against its XLA
statement (stabilizer.block_row_bounds) and against the exact row max in float64."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from clis_kernels import api, pallas_gpu_bounds, plan, stabilizer, testing
from clis_kernels import reference_f64 as ref
from clis_kernels.masks import segment_ids_of
from attention_base import CLIS_VS_ONLINE

BLOCK_Q, KEY_BLOCK = 32, 16


def exact_row_max(q, k, seg, causal, scale, kv_len):
  """[B, Hq, S] float64 base-2 max logit over the visible keys (−inf where none)."""
  q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
  group = q.shape[2] // k.shape[2]
  s = np.einsum("bihd,bjhd->bhij", q, np.repeat(k, group, axis=2)) * scale * stabilizer.LOG2E
  i, j = np.arange(q.shape[1])[:, None], np.arange(k.shape[1])[None, :]
  ok = np.broadcast_to(j < kv_len, s.shape[2:])
  ok = ok & (j <= i) if causal else ok
  ok = ok[None, None]
  if seg is not None:
    ids = np.asarray(seg)
    ok = ok & (ids[:, None, :, None] == ids[:, None, None, :]) & (ids[:, None, None, :] != 0)
  return np.where(ok, s, -np.inf).max(-1)


@pytest.mark.parametrize("dtype,heads,key_block", [(jnp.bfloat16, 2, KEY_BLOCK), (jnp.float32, 1, KEY_BLOCK),
                                                   (jnp.bfloat16, 2, BLOCK_Q)])
@pytest.mark.parametrize("family,causal", [("sink0", True), ("sinks_many", True), ("packed_sinks", True),
                                           ("outlier_channels", False), ("sinks_many", False)])
def test_kernel_bounds_match_xla_and_hold(family, causal, dtype, heads, key_block):
  """Centres of 16 keys, and of a whole query tile's worth (the largest certify_blocks uses)."""
  q, k, _, _, seg = testing.inputs(family, 2, 128, 4, 2, 64, dtype=dtype)
  kv_len = 128 if causal else 120  # bidirectional: the last keys are block padding
  seg = segment_ids_of(seg)
  scale = 1 / math.sqrt(64)
  bounds = stabilizer.block_bounds(k, seg, block=key_block, seq_len=kv_len, budget=8)
  kw = dict(causal=causal, scale=scale, block=key_block, kv_len=kv_len)
  upper, lower = pallas_gpu_bounds.row_bounds(q, k, seg, bounds, block_sizes=pallas_gpu_bounds.BlockSizes(rows=BLOCK_Q, heads=heads, centres=16),
                                              interpret=True, **kw)
  ref_upper, ref_lower = stabilizer.block_row_bounds(q, k, seg, bounds, own_block=BLOCK_Q, **kw)
  row_max = exact_row_max(q, k, None if seg is None else seg.q, causal, scale, kv_len)
  seen = np.isfinite(row_max)
  upper, lower = np.asarray(upper, np.float64), np.asarray(lower, np.float64)
  slack = 1e-5 * (1 + np.abs(row_max[seen]))
  assert np.all(upper[seen] >= row_max[seen] - slack), "kernel upper bound below the true max"
  assert np.all(lower[seen] <= row_max[seen] + slack), "kernel lower bound above the true max"
  # The same bound as the XLA statement: U widened only by the centres' rounding to q's dtype.
  width = np.abs(np.asarray(ref_upper))[seen] * (2.0 ** -7 if dtype == jnp.bfloat16 else 1e-5) + 1e-3
  np.testing.assert_array_less(np.asarray(ref_upper)[seen] - 1e-3, upper[seen])
  np.testing.assert_array_less(upper[seen], np.asarray(ref_upper)[seen] + width + 0.5)
  np.testing.assert_allclose(lower[seen], np.asarray(ref_lower)[seen], rtol=1e-5, atol=1e-3)


def test_plan_takes_the_kernel_only_for_calls_it_supports():
  p = plan.make_plan(dtype=jnp.bfloat16, head_dim=64, seq_len=256, bound="blocks", implementation="pallas_gpu",
                     interpret=True)
  args = dict(packed=False, window=None, separate_ids=False, same_length=True)
  assert p.row_bounds_kernel(causal=True, **args) is not None
  assert p.row_bounds_kernel(causal=False, **args) is not None
  assert p.row_bounds_kernel(causal=False, **{**args, "packed": True}) is None  # segment means: XLA
  assert p.row_bounds_kernel(causal=True, **{**args, "window": (8, 0)}) is None
  assert p.row_bounds_kernel(causal=False, **{**args, "separate_ids": True}) is None
  assert p.row_bounds_kernel(causal=True, **{**args, "same_length": False}) is None
  ref = plan.make_plan(dtype=jnp.bfloat16, head_dim=64, seq_len=256, bound="blocks", implementation="reference")
  assert ref.row_bounds_kernel(causal=True, **args) is None
  mla = plan.make_plan(dtype=jnp.bfloat16, head_dim=192, value_head_dim=128, seq_len=32768, bound="blocks",
                       implementation="pallas_mgpu", platform=plan.HOPPER)
  assert (mla.head_dim, mla.mode) == (192, plan.Mode.BLOCKS) and mla.row_bounds_kernel(causal=True, **args) is None


def check_block_bound_call(family, causal, shape, **kw):
  """bound="blocks" through api.attention: nearly every tile certified, and forward and gradients no less
  accurate than online against float64 (relative error within CLIS_VS_ONLINE of online's, as in the shared
  base; the worst element within one bf16 rounding step of online's worst)."""
  q, k, v, do, seg = testing.inputs(family, *shape, dtype=jnp.bfloat16)
  kw = dict(causal=causal, bound="blocks", **kw)
  run = lambda stab: jax.vjp(lambda a, b, c: api.attention(a, b, c, seg, stabilizer=stab, **kw), q, k, v)
  (out, pullback), (online, online_pullback) = run("clis"), run("online")
  _, stats = api.attention(q, k, v, seg, return_stats=True, **kw)
  want, *want_grads = ref.attention(q, k, v, do, seg, causal=causal)
  assert float(stats.certified_fraction) >= 0.95
  step = lambda x: 2.0 ** (np.floor(np.log2(np.abs(np.asarray(x, np.float64)).max())) - 7)  # bf16's ulp at max|x|
  for got, base, exact in zip((out, *pullback(do)), (online, *online_pullback(do)), (want, *want_grads)):
    assert ref.rel_err(got, exact) <= CLIS_VS_ONLINE * ref.rel_err(base, exact)
    assert ref.max_abs_err(got, exact) <= ref.max_abs_err(base, exact) + step(exact)


@pytest.mark.parametrize("causal,family", [(True, "packed_sinks"), (False, "sink0")])
def test_attention_with_the_kernel_bound_is_exact_and_certifies(causal, family):
  check_block_bound_call(family, causal, (1, 256, 4, 2, 64), implementation="pallas_gpu", interpret=True)


ON_GPU = jax.devices()[0].platform == "gpu"


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="the compiled Triton kernel needs an NVIDIA GPU")
@pytest.mark.parametrize("causal,family", [(True, "sinks_many"), (True, "packed_sinks"), (False, "outlier_channels")])
def test_compiled_kernel_matches_xla_on_gpu(causal, family):
  q, k, _, _, seg = testing.inputs(family, 2, 2048, 16, 4, 128, dtype=jnp.bfloat16)
  seg = segment_ids_of(seg)
  scale = 1 / math.sqrt(128)
  bounds = stabilizer.block_bounds(k, seg, block=KEY_BLOCK, seq_len=2048)
  kw = dict(causal=causal, scale=scale, block=KEY_BLOCK, kv_len=2048)
  upper, lower = jax.jit(lambda q, k: pallas_gpu_bounds.row_bounds(q, k, seg, bounds, **kw))(q, k)
  ref_upper, ref_lower = stabilizer.block_row_bounds(q, k, seg, bounds, own_block=64, **kw)
  row_max = exact_row_max(q, k, None if seg is None else seg.q, causal, scale, 2048)
  seen = np.isfinite(row_max)
  upper, lower = np.asarray(upper, np.float64)[seen], np.asarray(lower, np.float64)[seen]
  assert np.all(upper >= row_max[seen] - 1e-5 * (1 + np.abs(row_max[seen])))
  assert np.all(lower <= row_max[seen] + 1e-3)
  np.testing.assert_array_less(np.asarray(ref_upper)[seen] - 1e-3, upper)
  np.testing.assert_allclose(lower, np.asarray(ref_lower)[seen], rtol=1e-4, atol=1e-2)


@pytest.mark.skipif(ON_GPU, reason="lowering check for machines without a GPU")
@pytest.mark.parametrize("causal,packed", [(True, False), (True, True), (False, False)])
def test_kernel_lowers_for_the_gpu(causal, packed):
  """The (U, L) kernel lowers to Triton for an H200, with the block bound in the Mosaic GPU entry's plan."""
  from attention_base import lower_for_h200
  q = jax.ShapeDtypeStruct((1, 512, 8, 128), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((1, 512, 2, 128), jnp.bfloat16)
  seg = jax.ShapeDtypeStruct((1, 512), jnp.int32) if packed else None
  text = lower_for_h200(lambda q, k, v, seg: api.attention(q, k, v, seg, causal=causal, bound="blocks",
                                                          implementation="pallas_mgpu", platform=plan.HOPPER),
                        q, k, k, seg)
  assert "clis_block_bounds" in text and "mosaic_gpu" in text


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="the Mosaic GPU kernels need an NVIDIA Hopper GPU")
@pytest.mark.parametrize("causal,family", [(True, "sinks_many"), (True, "packed_sinks"), (False, "outlier_channels")])
def test_block_bound_through_the_mosaic_kernel_matches_float64_on_gpu(causal, family):
  """bound="blocks" on the Mosaic GPU forward (its certificate mode) and backward (check_block_bound_call)."""
  check_block_bound_call(family, causal, (1, 2048, 8, 2, 128), implementation="pallas_mgpu")
