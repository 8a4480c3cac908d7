"""The Mosaic TPU kernels in TPU interpret mode against float64 (the shared test base)."""

from attention_base import AttentionTests
from clis_kernels import pallas_tpu


class TestPallasTpu(AttentionTests):
  implementation = "pallas_tpu"
  interpret = True
  block_sizes = pallas_tpu.BlockSizes(block_q=32, block_k=16, block_q_dq=16, block_k_dq=32, block_q_dkv=32,
                                      block_k_dkv=16)
