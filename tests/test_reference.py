"""The blockwise pure-JAX reference against float64 (the shared test base)."""

from attention_base import AttentionTests
from clis_kernels import reference


class TestReference(AttentionTests):
  implementation = "reference"
  interpret = False
  block_sizes = reference.BlockSizes(block_q=32, block_k=16)
