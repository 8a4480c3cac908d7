"""Context parallelism (clis_kernels.context_parallel) on an 8-device CPU mesh: the sequence split over a
`context` axis gives the single device's result, forward and gradients, against float64."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from clis_kernels import attention
from clis_kernels import context_parallel as cp
from clis_kernels import reference
from clis_kernels import reference_f64 as ref
from clis_kernels import testing


def _mesh(context, data=1):
  devices = np.array(jax.devices()[:context * data]).reshape(data, context)
  return jax.sharding.Mesh(devices, ("data", "context"))


def _sharded(mesh, check_vma=True, **kw):
  """The context-parallel call on inputs in its layout (zig-zag unless kw names another), as a function of
  natural-order arrays."""
  n = mesh.shape["context"]
  contiguous = kw.get("layout") == "contiguous"
  seq = P("data", "context")

  @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P("data", "context", None, None),) * 3 + (seq,),
                     out_specs=(P("data", "context", None, None), P()), check_vma=check_vma)
  def run(q, k, v, ids):
    out, stats = cp.context_parallel_attention(q, k, v, ids, axis_name="context", return_stats=True, **kw)
    return out, jax.lax.pmean(stats.certified_fraction, ("data", "context"))

  def natural(q, k, v, ids):
    zig = (lambda x: x) if contiguous else (lambda x: cp.to_zigzag(x, n))
    ids = jnp.ones(q.shape[:2], jnp.int32) if ids is None else ids
    out, frac = run(zig(q), zig(k), zig(v), zig(ids))
    return (out if contiguous else cp.from_zigzag(out, n)), frac

  return natural


def test_zigzag_order_gives_each_device_a_chunk_from_each_end():
  order = cp.zigzag_order(16, 4)  # 8 chunks of 2: device r holds chunks r and 7 - r
  np.testing.assert_array_equal(order.reshape(4, 4), [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11],
                                                      [6, 7, 8, 9]])
  x = jnp.arange(32).reshape(2, 16)
  np.testing.assert_array_equal(cp.from_zigzag(cp.to_zigzag(x, 4), 4), x)
  with pytest.raises(ValueError, match="multiple of 2"):
    cp.zigzag_order(12, 4)


CASES = {  # name: (causal, packed, heads (Hq, Hkv))
    "causal": (True, False, (4, 4)),
    "causal_gqa_packed": (True, True, (4, 2)),
    "bidirectional_gqa": (False, False, (4, 1)),
    "bidirectional_packed": (False, True, (2, 2)),
}


@pytest.mark.parametrize("case,strategy,layout", [  # every case, and every strategy and layout on a causal and a
    ("causal", "ring", "zigzag"), ("causal", "ring", "contiguous"),  # bidirectional, packed and unpacked case
    ("causal_gqa_packed", "ring", "zigzag"), ("causal_gqa_packed", "all_gather", "zigzag"),
    ("bidirectional_gqa", "ring", "contiguous"), ("bidirectional_packed", "all_gather", "zigzag")])
def test_matches_one_device_and_float64(case, strategy, layout):
  causal, packed, (hq, hkv) = CASES[case]
  mesh = _mesh(context=4, data=2)
  q, k, v, do = testing.random_inputs(7, 2, 256, hq, hkv, 16, jnp.float32)
  ids = testing.packed_segments(3, 2, 256) if packed else None
  kw = dict(causal=causal, implementation="reference")
  f = _sharded(mesh, strategy=strategy, layout=layout, **kw)
  (out, frac), vjp = jax.vjp(lambda q, k, v: jax.jit(f)(q, k, v, ids), q, k, v)
  got = (out, *vjp((do, jnp.zeros(())))[:3])
  want = ref.attention(q, k, v, do, ids, causal=causal)
  one_device = jax.vjp(lambda q, k, v: attention(q, k, v, ids, **kw), q, k, v)
  single = (one_device[0], *one_device[1](do))
  for name, g, w, s in zip(("out", "dq", "dk", "dv"), got, want, single):
    assert ref.rel_err(g, w) < 2e-6, name
    assert ref.rel_err(g, w) <= 1.5 * ref.rel_err(s, w) + 1e-6, name  # as accurate as one device
  assert float(frac) > 0.9  # Gaussian keys certify under the gathered bound


@pytest.mark.parametrize("causal,packed", [(True, True), (False, False)])
def test_mla_value_head_dim_matches_one_device_and_float64(causal, packed):
  """v's head dim other than q's (MLA: q·k 192 / v 128, here 24 / 16) under context parallelism: v pads to the
  plan's width (the reference runs one width) and the output and dV come back at v's own; output and gradients
  match float64 and one device."""
  mesh = _mesh(context=4)
  q, k, v, do = testing.random_inputs(5, 1, 256, 4, 2, 24, jnp.float32)
  v, do = v[..., :16], do[..., :16]
  ids = testing.packed_segments(2, 1, 256) if packed else None
  kw = dict(causal=causal, implementation="reference")
  (out, frac), vjp = jax.vjp(lambda q, k, v: jax.jit(_sharded(mesh, **kw))(q, k, v, ids), q, k, v)
  got = (out, *vjp((do, jnp.zeros(())))[:3])
  assert out.shape == do.shape and got[3].shape == v.shape
  want = ref.attention(q, k, v, do, ids, causal=causal)
  one_device = jax.vjp(lambda q, k, v: attention(q, k, v, ids, **kw), q, k, v)
  for name, g, w, s in zip(("out", "dq", "dk", "dv"), got, want, (one_device[0], *one_device[1](do))):
    assert ref.rel_err(g, w) < 2e-6, name
    assert ref.rel_err(g, w) <= 1.5 * ref.rel_err(s, w) + 1e-6, name
  assert float(frac) > 0.9


def test_certified_rows_add_partials_exactly_and_online_combine_agrees():
  """The CLiS combination (one M per row across shards) and the online one give the same output on
  pretrained-shaped inputs (sinks, RoPE, outlier channels); both match float64."""
  mesh = _mesh(context=8)
  q, k, v, do, _ = testing.inputs("sinks_many", 1, 512, 4, 2, 32, dtype=jnp.float32)
  want = ref.attention(q, k, v, do, None, causal=True)[0]
  outs = {}
  for stabilizer, combine in (("clis", "clis"), ("clis", "online"), ("online", "online")):  # the last: a plain ring
    out, frac = jax.jit(_sharded(mesh, stabilizer=stabilizer, combine=combine, implementation="reference"))(
        q, k, v, None)
    outs[stabilizer, combine] = out
    assert ref.rel_err(out, want) < 2e-6, combine
    assert float(frac) == (0.0 if stabilizer == "online" else 1.0)
  assert ref.rel_err(outs["clis", "clis"], outs["online", "online"]) < 2e-6


def test_uncertified_rows_fall_back_and_stay_exact():
  """A τ too small to certify anything sends every row down the online combination: results stay exact."""
  mesh = _mesh(context=2)  # chunks of 128 keys: more than the 32 exceptional keys that are scored exactly
  q, k, v, do = testing.random_inputs(1, 1, 512, 2, 2, 16, jnp.float32)
  run = _sharded(mesh, tau=1e-3, implementation="reference")
  (out, frac), vjp = jax.vjp(lambda q, k, v: jax.jit(run)(q, k, v, None), q, k, v)
  assert float(frac) == 0.0
  want = ref.attention(q, k, v, do, None, causal=True)
  for g, w in zip((out, *vjp((do, jnp.zeros(())))[:3]), want):
    assert ref.rel_err(g, w) < 2e-6


def test_interpreted_triton_kernel_under_context_parallelism():
  mesh = _mesh(context=2)
  q, k, v, do = testing.random_inputs(2, 1, 256, 2, 1, 32, jnp.float32)
  ids = testing.packed_segments(5, 1, 256)
  from clis_kernels import pallas_gpu
  # JAX's GPU interpret mode drops the varying-axis types in its grid loop (tests/test_api.py says the same)
  run = _sharded(mesh, check_vma=False, implementation="pallas_gpu", interpret=True,
                 block_sizes=pallas_gpu.BlockSizes(block_q=32, block_k=32))
  (out, _), vjp = jax.vjp(lambda q, k, v: jax.jit(run)(q, k, v, ids), q, k, v)
  want = ref.attention(q, k, v, do, ids, causal=True)
  for g, w in zip((out, *vjp((do, jnp.zeros(())))[:3]), want):
    assert ref.rel_err(g, w) < 5e-5


def test_chunks_that_are_not_whole_blocks_are_padded():
  """Chunks of 24 keys with blocks of 32: each chunk is padded (padding keys hidden), results stay exact."""
  mesh = _mesh(context=2)
  q, k, v, do = testing.random_inputs(0, 1, 2 * 2 * 24, 2, 2, 16, jnp.float32)
  run = _sharded(mesh, implementation="reference", block_sizes=reference.BlockSizes(32, 32))
  (out, _), vjp = jax.vjp(lambda q, k, v: jax.jit(run)(q, k, v, None), q, k, v)
  want = ref.attention(q, k, v, do, None, causal=True)
  for g, w in zip((out, *vjp((do, jnp.zeros(())))[:3]), want):
    assert ref.rel_err(g, w) < 2e-6


def test_bad_layouts_get_one_clear_error():
  mesh = _mesh(context=4)
  q, k, v, _ = testing.random_inputs(0, 1, 4 * 2 * 24 + 4, 2, 2, 16, jnp.float32)
  with pytest.raises(ValueError, match="multiple of 2"):
    jax.jit(_sharded(mesh, implementation="reference"))(q, k, v, None)
  q, k, v, _ = testing.random_inputs(0, 1, 4 * 2 * 24, 2, 2, 16, jnp.float32)
  with pytest.raises(ValueError, match="strategy="):
    jax.jit(_sharded(mesh, strategy="tree"))(q, k, v, None)


def test_example_dit_attention_split_over_devices():
  """The example DiT's self-attention with its tokens split over the 8 devices ("clis_cp") gives the single call's
  output ("clis"), within float64's distance of the single call's own error."""
  from examples.video_dit import sampler
  q, k, v, do = testing.random_inputs(3, 1, 8 * 2 * 32, 2, 2, 32, jnp.float32)
  split, _, _ = jax.jit(sampler.make_attend("clis_cp"))(q, k, v, None)
  whole, _, _ = jax.jit(sampler.make_attend("clis"))(q, k, v, None)
  want = ref.attention(q, k, v, do, None, causal=False)[0]
  assert ref.rel_err(split, want) <= 1.5 * ref.rel_err(whole, want) + 1e-6


def test_example_dit_skipping_split_over_devices():
  """The example DiT's skipping self-attention with its tokens split over the 8 devices ("clis_skip_cp") marks and
  leaves out what the single call ("clis_skip") does, call after call."""
  from examples.video_dit import sampler
  from examples.video_dit.model import DiTConfig
  cfg = DiTConfig(frames=4)  # 1,024 tokens: one 128-row q tile per device
  pos = np.arange(cfg.tokens)[:, None] / cfg.tokens * np.arange(1, cfg.head_dim // 2 + 1)[None] * 2.0
  local = 4.0 * np.concatenate([np.cos(pos), np.sin(pos)], -1)[None, :, None, :]  # rows peaked on their neighbours
  q, k, v, _ = testing.random_inputs(4, 1, cfg.tokens, cfg.heads, cfg.heads, cfg.head_dim, jnp.float32)
  q, k, v = ((local + 0.3 * x).astype(jnp.bfloat16) if i < 2 else x.astype(jnp.bfloat16) for i, x in enumerate((q, k, v)))
  split, whole = (jax.jit(sampler.make_attend(name, -8.0, cfg)) for name in ("clis_skip_cp", "clis_skip"))
  one = many = sampler.init_skip_states(cfg, 1)[0]
  for _ in range(2):
    want, one, sparsity = whole(q, k, v, one)
    got, many, split_sparsity = split(q, k, v, many)
    np.testing.assert_array_equal(np.asarray(many.skip), np.asarray(one.skip))
    assert float(split_sparsity) == float(sparsity)
    assert ref.rel_err(got, want) < 1e-2  # bf16 outputs: rounding of differently shaped matmuls
  assert float(sparsity) > 0


ON_GPU = jax.devices()[0].platform == "gpu"


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="the Mosaic GPU kernels run on an NVIDIA Hopper GPU only")
@pytest.mark.parametrize("causal", [True, False])
def test_mosaic_gpu_kernels_under_context_parallelism(causal):
  """One GPU on the context axis still runs every part: two chunks, diagonal and full pairs, the gathered bound,
  the combination and the backward, on the Mosaic GPU kernels; within the dtype's tolerance of float64 and no
  more than CLIS_VS_ONLINE x the single-call kernel's error."""
  from attention_base import CLIS_VS_ONLINE, TOLERANCE
  mesh = _mesh(context=1)
  q, k, v, do, ids = testing.inputs("packed_sinks", 1, 4096, 8, 2, 128, dtype=jnp.bfloat16)
  kw = dict(causal=causal, implementation="pallas_mgpu")
  run = _sharded(mesh, **kw)
  (out, frac), vjp = jax.vjp(lambda q, k, v: jax.jit(run)(q, k, v, ids), q, k, v)
  got = (out, *vjp((do, jnp.zeros(())))[:3])
  single = jax.vjp(lambda q, k, v: attention(q, k, v, ids, **kw), q, k, v)
  single = (single[0], *single[1](do))
  want = ref.attention(q, k, v, do, ids, causal=causal)
  fwd_tol, bwd_tol = TOLERANCE[jnp.bfloat16]
  for name, g, s, w in zip(("out", "dq", "dk", "dv"), got, single, want):
    assert ref.rel_err(g, w) < (fwd_tol if name == "out" else bwd_tol), name
    assert ref.rel_err(g, w) <= CLIS_VS_ONLINE * ref.rel_err(s, w), name
  assert float(frac) > 0.9


def test_a_partial_with_no_visible_key_adds_nothing():
  """What kernels leave in rows that see no key of a chunk — EMPTY_LSE, −inf with 0/0 (the Mosaic GPU kernel's
  certified rows), NEG + log2(count) (an online row whose keys were all masked) — leaves the combination as it
  was, with no NaN."""
  q = jnp.zeros((1, 4, 2, 8))
  o1, lse1 = jax.random.normal(jax.random.PRNGKey(0), q.shape), jax.random.normal(jax.random.PRNGKey(1), (1, 2, 4))
  for fixed in (False, True):
    rows = cp._Rows(q, jnp.full((1, 2, 4), fixed), jnp.full((1, 2, 4), 3.0), q.shape[-1])
    rows.add(o1, lse1)
    for o, lse in ((jnp.zeros(q.shape), cp.EMPTY_LSE), (jnp.full(q.shape, jnp.nan), -jnp.inf),
                   (jnp.ones(q.shape), cp.NEG + 7.0)):
      rows.add(o, jnp.full((1, 2, 4), lse))
    out, lse = rows.result(jnp.float32)
    np.testing.assert_allclose(out, o1, rtol=1e-6)
    np.testing.assert_allclose(lse, lse1, rtol=1e-6)
