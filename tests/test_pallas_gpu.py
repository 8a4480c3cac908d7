"""The Triton kernels in Pallas interpret mode against float64 (the shared test base)."""

import dataclasses

import jax
import pytest

from clis_kernels import reference_f64 as ref
from attention_base import CASES, CLIS_VS_ONLINE, TOLERANCE, AttentionTests, packed_segments, random_inputs
from clis_kernels import pallas_gpu


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
