"""The Triton kernels in Pallas interpret mode against float64 (the shared test base)."""

from attention_base import AttentionTests
from clis_kernels import pallas_gpu


class TestPallasGpu(AttentionTests):
  implementation = "pallas_gpu"
  interpret = True
  block_sizes = pallas_gpu.BlockSizes(block_q=32, block_k=16, block_q_dq=16, block_k_dq=32, block_q_dkv=32,
                                      block_k_dkv=16, num_warps=4, num_stages=2)
