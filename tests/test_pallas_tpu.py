"""The Mosaic TPU kernels in TPU interpret mode against float64 (the shared test base), and lowered for a TPU."""

import jax
import jax.numpy as jnp
import pytest

from attention_base import AttentionTests, lower_for_tpu
from clis_kernels import attention, pallas_tpu
from clis_kernels.plan import Platform


class TestPallasTpu(AttentionTests):
  """interpret=True: Pallas's plain interpreter (the grid as XLA loops), ~5x faster here than the TPU interpreter
  that simulates VMEM, SMEM and DMAs; test_the_simulating_interpreter_gives_the_same_bits runs that one."""

  implementation = "pallas_tpu"
  interpret = True
  # 32-row tiles (certificates per tile as on the GPU tests), 64-key steps: the interpreter runs every grid step
  block_sizes = pallas_tpu.BlockSizes(block_q=32, block_k=64, block_q_dq=64, block_k_dq=64, block_q_dkv=64,
                                      block_k_dkv=64)


@pytest.mark.parametrize("stabilizer", ["clis", "online"])
def test_the_simulating_interpreter_gives_the_same_bits(stabilizer):
  """pltpu.InterpretParams (the TPU interpreter: VMEM, SMEM and every DMA simulated and checked) runs the forward and
  both backward kernels with the scalar-prefetched tables (certificate, document ranges) on packed GQA rows with
  sinks, and gives the plain interpreter's bits; the block bound certifies there."""
  from jax.experimental.pallas import tpu as pltpu
  from clis_kernels import reference_f64 as ref, testing
  q, k, v, do, seg = testing.inputs("packed_sinks", 1, 128, 4, 2, 64)
  bs = pallas_tpu.BlockSizes(32, 64, 64, 64, 64, 64, document_ranges=True)
  results = []
  for interpret in (True, pltpu.InterpretParams()):
    run = lambda q, k, v: attention(q, k, v, seg, causal=True, stabilizer=stabilizer, implementation="pallas_tpu",
                                    interpret=interpret, block_sizes=bs, return_stats=True)
    (out, stats), vjp = jax.vjp(run, q, k, v)
    results.append((out, *vjp((do, jax.tree.map(jnp.zeros_like, stats)))))
    assert float(stats.certified_fraction) == (1.0 if stabilizer == "clis" else 0.0)
  for simulated, plain in zip(results[1], results[0]):
    assert bool((simulated == plain).all())
  assert ref.rel_err(results[0][0], ref.attention(q, k, v, do, seg, causal=True)[0]) < 2e-2


def test_the_simulating_interpreter_is_for_the_tpu_kernels_only():
  from jax.experimental.pallas import tpu as pltpu
  q = jnp.zeros((1, 64, 2, 64), jnp.float32)
  with pytest.raises(ValueError, match="InterpretParams is for implementation='pallas_tpu'"):
    attention(q, q, q, implementation="pallas_gpu", interpret=pltpu.InterpretParams())


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


@pytest.mark.parametrize("family", ["sinks_many", "outlier_channels", "packed_sinks"])
@pytest.mark.parametrize("causal", [True, False])
def test_default_bound_certifies_pretrained_like_inputs(family, causal):
  """bound=None on a TPU is the block bound (plan.BLOCKS_FROM_TPU): on sink and outlier-channel inputs it
  certifies at least 95% of the tiles, exactly (against float64), in interpret mode; the one-radius bound, the
  default before, certifies at most half of them (none at real lengths)."""
  from clis_kernels import plan, reference_f64 as ref, testing
  q, k, v, do, seg = testing.inputs(family, 1, 256, 4, 2, 64)
  if seg is not None and not causal:
    pytest.skip("bidirectional packed rows take the radius bound (the block bound's kernel condition)")
  kw = dict(causal=causal, implementation="pallas_tpu", interpret=True, platform=Platform("tpu"),
            block_sizes=TestPallasTpu.block_sizes)
  chosen = plan.make_plan(dtype=q.dtype, head_dim=64, seq_len=256, causal=causal, packed=seg is not None,
                          implementation="pallas_tpu", interpret=True, platform=Platform("tpu"))
  assert chosen.mode is plan.Mode.BLOCKS
  out, stats = attention(q, k, v, seg, return_stats=True, **kw)
  _, radius = attention(q, k, v, seg, return_stats=True, bound="radius", tau=64.0, **kw)
  want = ref.attention(q, k, v, do, seg, causal=causal)
  assert float(stats.certified_fraction) >= 0.95 and float(radius.certified_fraction) <= 0.5
  assert ref.rel_err(out, want[0]) < 2e-2


@pytest.mark.parametrize("chip", ["TPU v5 lite", "TPU v6 lite"])
def test_default_block_bound_lowers_for_v5e_and_v6e(chip):
  """The TPU default (block bound: an XLA pre-pass, then the kernels taking a Certificate) lowers for a TPU v5e
  and a v6e at the default tiles, forward and both backwards."""
  from clis_kernels.testing import _lower_for
  q = jax.ShapeDtypeStruct((1, 2048, 4, 128), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((1, 2048, 2, 128), jnp.bfloat16)

  def loss(q, k, v):
    return attention(q, k, v, causal=True, implementation="pallas_tpu", platform=Platform("tpu")).astype(
        jnp.float32).sum()

  text = _lower_for(chip, 1, "tpu", "tpu")(jax.grad(loss, argnums=(0, 1, 2)), q, k, k)
  assert text.count("tpu_custom_call") >= 3
