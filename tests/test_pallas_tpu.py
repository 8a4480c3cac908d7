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


@pytest.mark.parametrize("ranges", [False, True])
def test_document_ranges_skip_the_blocks_where_documents_do_not_meet(ranges):
  """BlockSizes(document_ranges=True): the NaNs of testing.documents_left_out stay out of the second document's
  output and dQ and of the first's dK and dV (those block pairs are neither fetched nor computed); the full
  causal grid brings them in."""
  from clis_kernels import testing
  run = lambda q, k, v, seg, ranges: TestPallasTpu().run(  # 64-row tiles: two per document, few interpreted steps
      q, k, v, seg, causal=True, block_sizes=pallas_tpu.BlockSizes(*(64,) * 6, document_ranges=ranges))
  assert testing.documents_left_out(run, ranges) == [ranges] * 4


@pytest.mark.parametrize("stabilizer", ["online", "clis"])
def test_document_ranges_change_nothing(stabilizer):
  """Many short documents, a padded tail, GQA: output and gradients bit-identical to the full causal grid's."""
  from clis_kernels import testing
  q, k, v, do = testing.random_inputs(11, 2, 256, 4, 2, 32, jnp.float32)
  seg = testing.short_documents(11, 2, 256, 12)
  results = []
  for ranges in (False, True):
    bs = pallas_tpu.BlockSizes(32, 32, 32, 64, 64, 32, document_ranges=ranges)
    out, vjp = jax.vjp(lambda q, k, v: TestPallasTpu().run(q, k, v, seg, causal=True, stabilizer=stabilizer,
                                                            block_sizes=bs), q, k, v)
    results.append((out, *vjp(do)))
  for with_ranges, without in zip(results[1], results[0]):
    assert bool((with_ranges == without).all())


def test_document_ranges_lower_for_a_tpu():
  """The scalar-prefetched range tables lower for a TPU v5e at the default tiles, forward and both backwards."""
  q = jax.ShapeDtypeStruct((1, 1024, 4, 128), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((1, 1024, 2, 128), jnp.bfloat16)
  seg = jax.ShapeDtypeStruct((1, 1024), jnp.int32)

  def loss(q, k, v, seg):
    return attention(q, k, v, seg, causal=True, implementation="pallas_tpu", platform=Platform("tpu"),
                     block_sizes=pallas_tpu.BlockSizes(*(512,) * 6, document_ranges=True)).astype(jnp.float32).sum()

  text = lower_for_tpu(jax.grad(loss, argnums=(0, 1, 2)), q, k, k, seg)
  assert text.count("tpu_custom_call") >= 3
