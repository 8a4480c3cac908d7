"""The Triton kernels in Pallas interpret mode against float64 (the shared test base)."""

import dataclasses

import jax
import pytest

from clis_kernels import reference_f64 as ref
from attention_base import CASES, CLIS_VS_ONLINE, TOLERANCE, AttentionTests, packed_segments, random_inputs
from clis_kernels import attention, pallas_gpu, testing


class TestPallasGpu(AttentionTests):
  implementation = "pallas_gpu"
  interpret = True
  # Equal loop steps for both paths, so clis-vs-online comparisons see the same dot shapes
  # (at |logit| ~ 1e4 in f32 the dot's rounding, not the stabilizer, dominates the error).
  block_sizes = pallas_gpu.BlockSizes(block_q=32, block_k=16, block_k_fixed=16, block_q_dq=16, block_k_dq=32,
                                      block_q_dkv=32, block_k_dkv=16, num_warps=4, num_stages=2)


@pytest.mark.gpu
@pytest.mark.skipif(jax.devices()[0].platform != "gpu", reason="the compiled Triton kernels need an NVIDIA GPU")
class TestPallasGpuCompiled(TestPallasGpu):
  """The same tests with the kernels compiled by Triton (on the H200: JAX_PLATFORMS=cuda pytest ...)."""
  interpret = False


@pytest.mark.parametrize("case", [c for c in CASES if c[0] in ("causal_packed_gqa4_d128_bf16", "bidir_gqa8_d64_bf16_odd")],
                         ids=lambda c: c[0])
def test_fixed_loop_with_its_own_block_k(case):
  """block_k_fixed != block_k (the GPU default): the certified loop's own tiling is exact too."""
  name, batch, seq, hq, hkv, d, dtype, causal, packed = case
  q, k, v, do = random_inputs(len(name), batch, seq, hq, hkv, d, dtype)
  seg = packed_segments(len(name), batch, seq) if packed else None
  want = ref.attention(q, k, v, do, seg, causal=causal)[0]
  tests = TestPallasGpu()
  bs = dataclasses.replace(TestPallasGpu.block_sizes, block_k_fixed=32)
  out, stats = tests.run(q, k, v, seg, causal=causal, block_sizes=bs, return_stats=True)
  online = tests.run(q, k, v, seg, causal=causal, stabilizer="online")
  assert float(stats.certified_fraction) == 1.0
  assert ref.rel_err(out, want) < TOLERANCE[dtype][0]
  assert ref.rel_err(out, want) <= CLIS_VS_ONLINE * ref.rel_err(online, want)


# Interpret mode here; compiled by Triton on the GPU (JAX_PLATFORMS=cuda pytest -m gpu ...).
RUNNERS = [pytest.param(TestPallasGpu, id="interpret"),
           pytest.param(TestPallasGpuCompiled, id="compiled", marks=TestPallasGpuCompiled.pytestmark)]


@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize("ranges", [False, True])
def test_document_ranges_skip_the_blocks_where_documents_do_not_meet(ranges, runner):
  """BlockSizes(document_ranges=True) visits only the block pairs where packed documents meet: with it the
  NaNs of testing.documents_left_out stay out of all four results; the full causal loops bring them in."""
  run = lambda q, k, v, seg, ranges: runner().run(
      q, k, v, seg, causal=True, block_sizes=dataclasses.replace(runner.block_sizes, document_ranges=ranges))
  assert testing.documents_left_out(run, ranges) == [ranges] * 4


@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize("stabilizer,mean_len", [("online", 6), ("clis", 40)])
def test_document_ranges_change_nothing(stabilizer, mean_len, runner):
  """Many short documents, a padded tail, an odd length, GQA: with document_ranges the output and gradients are
  the full loops' bit for bit (skipped blocks only ever added exact zeros) and match float64."""
  jnp = jax.numpy
  q, k, v, do = random_inputs(mean_len, 2, 301, 4, 2, 32, jnp.float32)
  seg = testing.short_documents(mean_len, 2, 301, mean_len)
  results = []
  for ranges in (False, True):
    bs = dataclasses.replace(runner.block_sizes, document_ranges=ranges)
    f = lambda q, k, v: runner().run(q, k, v, seg, causal=True, stabilizer=stabilizer, block_sizes=bs)
    out, vjp = jax.vjp(f, q, k, v)
    results.append((out, *vjp(do)))
  for with_ranges, without in zip(*results[::-1]):
    assert bool((with_ranges == without).all())
  for i, (got, want) in enumerate(zip(results[1], ref.attention(q, k, v, do, seg, causal=True))):
    assert ref.rel_err(got, want) < TOLERANCE[jnp.float32][min(i, 1)]  # output, then gradients


@pytest.mark.parametrize("stabilizer", ["online", "clis"])
def test_document_ranges_lower_for_the_gpu(stabilizer):
  """The range scalars lower through Triton for an H200 (forward, dQ, dK/dV: three Triton kernels)."""
  from clis_kernels.plan import Platform
  from clis_kernels.testing import lower_for_h200
  jnp = jax.numpy
  q = jax.ShapeDtypeStruct((1, 512, 8, 64), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((1, 512, 2, 64), jnp.bfloat16)
  seg = jax.ShapeDtypeStruct((1, 512), jnp.int32)
  bs = dataclasses.replace(pallas_gpu.default_block_sizes(64, 512, jnp.bfloat16), document_ranges=True)

  def loss(q, k, v, seg):
    return attention(q, k, v, seg, causal=True, stabilizer=stabilizer, implementation="pallas_gpu",
                     platform=Platform("gpu", hopper=False), block_sizes=bs).astype(jnp.float32).sum()

  assert lower_for_h200(jax.grad(loss, argnums=(0, 1, 2)), q, k, k, seg).count("__gpu$xla.gpu.triton") == 3
