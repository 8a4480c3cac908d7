"""The Mosaic TPU kernels in TPU interpret mode against float64 (the shared test base), and lowered for a TPU."""

import jax
import jax.numpy as jnp
import pytest

from attention_base import AttentionTests, lower_for_tpu
from clis_kernels import attention, pallas_tpu
from clis_kernels.plan import Platform


class TestPallasTpu(AttentionTests):
  implementation = "pallas_tpu"
  interpret = True
  block_sizes = pallas_tpu.BlockSizes(block_q=32, block_k=16, block_q_dq=16, block_k_dq=32, block_q_dkv=32,
                                      block_k_dkv=16)


@pytest.mark.parametrize("causal,seq,packed", [(True, 1000, False), (False, 1000, False), (True, 1024, True)])
def test_kernels_lower_for_a_tpu(causal, seq, packed):
  """Forward and both backward kernels at their default (512-row) tiles lower for a TPU v5e."""
  q = jax.ShapeDtypeStruct((1, seq, 4, 128), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((1, seq, 2, 128), jnp.bfloat16)
  seg = jax.ShapeDtypeStruct((1, seq), jnp.int32) if packed else None

  def loss(q, k, v, seg):
    return attention(q, k, v, seg, causal=causal, implementation="pallas_tpu",
                     platform=Platform("tpu")).astype(jnp.float32).sum()

  text = lower_for_tpu(jax.grad(loss, argnums=(0, 1, 2)), q, k, k, seg)
  assert text.count("tpu_custom_call") >= 3
