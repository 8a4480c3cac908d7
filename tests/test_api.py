"""The public API: bad input errors, dispatch, stats, shard_map, and Triton lowering without a GPU."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import PartitionSpec as P

from clis_kernels import reference_f64 as ref
from attention_base import lower_for_h200, random_inputs
from clis_kernels import SegmentIds, api, attention, pallas_gpu, pallas_tpu, plan, reference

q0 = jnp.zeros((2, 32, 4, 64), jnp.float32)
kv0 = jnp.zeros((2, 32, 2, 64), jnp.float32)


@pytest.mark.parametrize("kwargs,message", [
    (dict(q=jnp.zeros((2, 32, 64))), "q must be \\[batch, seq, heads, head_dim\\]"),
    (dict(k=jnp.zeros((2, 32, 2, 32)), v=jnp.zeros((2, 32, 2, 32))), "q and k must agree"),
    (dict(v=jnp.zeros((2, 32, 3, 64))), "v must have k's batch, length and heads"),
    (dict(k=jnp.zeros((2, 32, 3, 64)), v=jnp.zeros((2, 32, 3, 64))), "Hq=4 must be a multiple of kv heads Hkv=3"),
    (dict(segment_ids=jnp.zeros((2, 31), jnp.int32)), "segment_ids must be \\[batch, seq\\]"),
    (dict(segment_ids=jnp.zeros((2, 32), jnp.float32)), "segment_ids must be an integer array"),
    (dict(stabilizer="fixed"), "stabilizer='fixed' must be one of"),
    (dict(implementation="cuda"), "implementation='cuda' is not one of"),
    (dict(granularity="row"), "granularity='row' must be one of"),
    (dict(tau=0.0), "tau=0.0 must be positive"),
    (dict(q=q0.astype(jnp.bfloat16)), "q, k, v must share a dtype"),
    (dict(q=q0.astype(jnp.int32)), "q.dtype=int32 must be float32"),
    (dict(k=jnp.zeros((2, 16, 2, 64)), v=jnp.zeros((2, 16, 2, 64))), "one segment_ids array for queries and keys, needs equal"),
    (dict(implementation="pallas_gpu"), "needs a GPU device but this platform is 'cpu': pass interpret=True"),
    (dict(implementation="pallas_tpu"), "needs a TPU device but this platform is 'cpu': pass interpret=True"),
    (dict(implementation="reference", block_sizes=pallas_gpu.BlockSizes()), "block_sizes for implementation='reference'"),
])
def test_bad_input_names_the_argument(kwargs, message):
  args = dict(q=q0, k=kv0, v=kv0, segment_ids=None)
  args.update(kwargs)
  q, k, v, seg = args.pop("q"), args.pop("k"), args.pop("v"), args.pop("segment_ids")
  with pytest.raises(ValueError, match=message):
    attention(q, k, v, seg, **args)


@pytest.mark.parametrize("cls,kwargs,message", [
    (pallas_gpu.BlockSizes, dict(block_q=48), "block_q=48 must be a power of two"),
    (pallas_gpu.BlockSizes, dict(num_warps=3), "num_warps=3 must be one of"),
    (pallas_tpu.BlockSizes, dict(block_k=4), "block_k=4 must be a power of two >= 8"),
    (reference.BlockSizes, dict(block_q=3), "block_q=3 must be a power of two"),
])
def test_block_sizes_are_validated(cls, kwargs, message):
  with pytest.raises(ValueError, match=message):
    cls(**kwargs)


def test_cpu_default_is_the_reference_and_matches_xla():
  q, k, v, _ = random_inputs(0, 2, 40, 4, 2, 64, jnp.float32)
  auto = attention(q, k, v)
  np.testing.assert_array_equal(np.asarray(auto), np.asarray(attention(q, k, v, implementation="reference")))
  np.testing.assert_allclose(np.asarray(auto), np.asarray(attention(q, k, v, implementation="xla")), atol=2e-6)


@pytest.mark.parametrize("hopper,dtype,head_dim,window_or_cap,want", [
    (True, jnp.bfloat16, 128, False, "pallas_mgpu"), (True, jnp.float16, 64, False, "pallas_mgpu"),
    (True, jnp.float32, 128, False, "pallas_gpu"), (True, jnp.bfloat16, 96, False, "pallas_mgpu"),
    (True, jnp.bfloat16, 256, False, "pallas_mgpu"), (True, jnp.bfloat16, 192, True, "pallas_mgpu"),
    (True, jnp.bfloat16, 320, False, "pallas_gpu"), (True, jnp.bfloat16, 128, True, "pallas_mgpu"),
    (False, jnp.bfloat16, 128, False, "pallas_gpu"), (False, jnp.bfloat16, 256, False, "pallas_gpu")])
def test_gpu_default_is_the_mosaic_backend_on_hopper_where_it_applies(hopper, dtype, head_dim, window_or_cap, want):
  """Head dims up to 128 are padded to the Mosaic kernels' 64/128 (local windows and soft caps included); above
  128, up to 256, to 256, whose backward is pallas_mgpu_vjp_wide's."""
  call = plan.Call(jnp.dtype(dtype), head_dim, window_or_cap)
  assert plan.choose(None, call, plan.Platform("gpu", hopper=hopper)).name == want


def test_wide_heads_on_hopper_certify_with_a_pre_pass_and_refuse_the_mosaic_backward():
  """Above head dim 128 the in-kernel certificate's scratch does not fit (pallas_mgpu.KEYS_MAX_HEAD_DIM): the radius
  bound runs as an XLA pre-pass; past 256 naming pallas_mgpu says what to use instead."""
  named = dict(implementation="pallas_mgpu_triton_bwd", platform=plan.HOPPER)  # the default runs online on Hopper
  p = plan.make_plan(dtype=jnp.bfloat16, head_dim=256, seq_len=32768, bound="radius", **named)
  assert p.entry.name == "pallas_mgpu_triton_bwd" and p.mode is plan.Mode.CERTIFICATE
  p = plan.make_plan(dtype=jnp.bfloat16, head_dim=256, seq_len=32768, **named)
  assert p.mode is plan.Mode.BLOCKS and p.block_sizes.block_kv == 64
  assert (p.backward_block_sizes.block_q_dkv, p.backward_block_sizes.num_warps_bwd) == (64, 8)  # Hopper's Triton tiles
  other = plan.make_plan(dtype=jnp.bfloat16, head_dim=256, seq_len=32768, platform=plan.Platform("gpu"))
  assert other.entry.name == "pallas_gpu" and other.backward_block_sizes.block_q_dkv == 32
  assert plan.make_plan(dtype=jnp.bfloat16, head_dim=256, seq_len=8192, **named).mode is plan.Mode.CERTIFICATE  # radius
  mosaic = plan.make_plan(dtype=jnp.bfloat16, head_dim=256, seq_len=1024, implementation="pallas_mgpu",
                          platform=plan.HOPPER)  # the Mosaic GPU backward at 256: pallas_mgpu_vjp_wide's kernels
  assert mosaic.mode is plan.Mode.CERTIFICATE and not mosaic.backward_block_sizes.fused_dq
  with pytest.raises(ValueError, match=r"takes head dims up to 128, \(256,\) and the .*pallas_mgpu_triton_bwd"):
    plan.make_plan(dtype=jnp.bfloat16, head_dim=320, seq_len=1024, implementation="pallas_mgpu", platform=plan.HOPPER)


@pytest.mark.parametrize("implementation,want", [
    (None, ("pallas_mgpu", 192, 128)), ("pallas_mgpu", ("pallas_mgpu", 192, 128)),
    ("pallas_mgpu_triton_bwd", ("pallas_mgpu_triton_bwd", 256, 256)), ("pallas_gpu", ("pallas_gpu", 256, 256)),
    ("reference", ("reference", 192, 192))])
def test_mla_head_dims_run_unpadded_where_both_kernels_take_them(implementation, want):
  """q·k 192 with v 128 (MLA): the Mosaic GPU forward and backward take the pair as it is; entries whose kernels run
  one width pad v up to q·k's (the Triton kernels to their power of two)."""
  p = plan.make_plan(dtype=jnp.bfloat16, head_dim=192, value_head_dim=128, seq_len=4096,
                     implementation=implementation, platform=plan.HOPPER)
  assert (p.entry.name, p.head_dim, p.value_head_dim) == want
  if want[0] == "pallas_mgpu":  # o shares q's shared memory, so 128-key blocks fit at q·k 192 (256 takes 64)
    assert p.block_sizes.block_kv == 128
  narrow = plan.make_plan(dtype=jnp.bfloat16, head_dim=160, value_head_dim=100, seq_len=32768, platform=plan.HOPPER)
  assert (narrow.entry.name, narrow.head_dim, narrow.value_head_dim) == ("pallas_mgpu", 192, 128)
  assert narrow.mode is plan.Mode.ONLINE  # no (U, L) kernel at 192: the plan runs MLA online by default
  wide_v = plan.make_plan(dtype=jnp.bfloat16, head_dim=192, value_head_dim=192, seq_len=4096, platform=plan.HOPPER)
  assert (wide_v.entry.name, wide_v.head_dim, wide_v.value_head_dim) == ("pallas_mgpu", 256, 256)
  past = plan.make_plan(dtype=jnp.bfloat16, head_dim=256, value_head_dim=128, seq_len=1024,
                        implementation="pallas_mgpu", platform=plan.HOPPER)  # no pair: v pads up to 256
  assert (past.head_dim, past.value_head_dim) == (256, 256)


@pytest.mark.parametrize("seq_len,implementation,bound,want", [
    (2048, None, "radius", plan.Mode.ONLINE), (65536, None, "radius", plan.Mode.ONLINE),
    (65536, None, "blocks", plan.Mode.ONLINE), (65536, None, None, plan.Mode.ONLINE),
    (2048, "pallas_mgpu", "radius", plan.Mode.KEYS), (32768, "pallas_mgpu", "blocks", plan.Mode.BLOCKS),
    (plan.BLOCKS_FROM_MGPU - 1, "pallas_mgpu", None, plan.Mode.KEYS), (plan.BLOCKS_FROM_MGPU, "pallas_mgpu", None,
                                                              plan.Mode.BLOCKS)])
def test_automatic_plan_runs_online_on_hopper(seq_len, implementation, bound, want):
  """implementation=None on Hopper runs the online loop at every length (its certified loop does not pay there:
  plan.CERTIFY_ON_HOPPER); a backend named explicitly certifies at every length, with the block bound from
  plan.BLOCKS_FROM_MGPU keys when bound=None."""
  p = plan.make_plan(dtype=jnp.bfloat16, head_dim=128, seq_len=seq_len, bound=bound, implementation=implementation,
                     platform=plan.HOPPER)
  assert p.entry.name == "pallas_mgpu" and p.mode is want


@pytest.mark.parametrize("dtype,softcap,tau,by_cap", [
    (jnp.bfloat16, 50.0, None, True), (jnp.bfloat16, 64.0, None, False), (jnp.float32, 30.0, None, True),
    (jnp.float32, 50.0, None, False), (jnp.bfloat16, 50.0, 90.0, False), (jnp.bfloat16, None, None, False)])
def test_the_cap_bound_is_chosen_where_the_soft_cap_certifies_alone(dtype, softcap, tau, by_cap):
  """bound=None takes the cap's bound where the soft cap alone bounds every logit (2c within τ, widened for the
  kernels' tanh; stabilizer.certify_cap needs no pre-pass over q or K), on every platform where the plan certifies;
  implementation=None on Hopper still runs online (the certified loop measured slower there even so)."""
  for platform in (plan.Platform("gpu"), plan.Platform("cpu")):
    p = plan.make_plan(dtype=dtype, head_dim=128, seq_len=8192, window_or_cap=softcap is not None, softcap=softcap,
                       tau=tau, platform=platform)
    assert (p.mode is plan.Mode.CAP) is by_cap, platform
  if dtype == jnp.bfloat16:  # naming the Mosaic GPU backend certifies, by the cap where it suffices
    named = plan.make_plan(dtype=dtype, head_dim=128, seq_len=8192, window_or_cap=softcap is not None,
                           softcap=softcap, tau=tau, implementation="pallas_mgpu", platform=plan.HOPPER)
    assert (named.mode is plan.Mode.CAP) is by_cap
  default = plan.make_plan(dtype=jnp.bfloat16, head_dim=128, seq_len=8192, window_or_cap=softcap is not None,
                           softcap=softcap, tau=tau, platform=plan.HOPPER)
  assert (default.entry.name, default.mode) == ("pallas_mgpu", plan.Mode.ONLINE)


def test_only_the_hopper_entries_run_online_by_default():
  """Every other entry certifies under implementation=None (pre-Hopper GPUs, TPU, the reference)."""
  by_default = {e.name: e.certifies_by_default for e in plan.REGISTRY}
  assert by_default == {"pallas_mgpu": False, "pallas_mgpu_triton_bwd": False, "pallas_gpu": True,
                        "pallas_tpu": True, "reference": True}
  for platform, name in ((plan.Platform("gpu"), "pallas_gpu"), (plan.Platform("cpu"), "reference")):
    p = plan.make_plan(dtype=jnp.bfloat16, head_dim=128, seq_len=32768, platform=platform)
    assert (p.entry.name, p.mode is plan.Mode.ONLINE) == (name, False)
  wide = plan.make_plan(dtype=jnp.bfloat16, head_dim=256, seq_len=32768, platform=plan.HOPPER)
  assert (wide.entry.name, wide.mode) == ("pallas_mgpu", plan.Mode.ONLINE)


def test_automatic_bound_keeps_the_radius_where_the_block_kernel_does_not_run():
  entry = plan.ENTRIES["pallas_mgpu"]
  kw = dict(seq_len=plan.BLOCKS_FROM_MGPU, causal=True, packed=False, separate_ids=False, window_or_cap=False)
  assert plan.automatic_bound(entry, **kw) == "blocks"
  assert plan.automatic_bound(entry, **{**kw, "causal": False, "packed": True}) == "radius"  # segment means: XLA
  assert plan.automatic_bound(entry, **{**kw, "separate_ids": True}) == "radius"
  assert plan.automatic_bound(plan.ENTRIES["reference"], **kw) == "radius"
  assert plan.automatic_bound(plan.ENTRIES["pallas_gpu"], **kw) == "radius"  # not measured on other GPUs


@pytest.mark.parametrize("kwargs,message", [
    (dict(local_window_size=-1), "local_window_size=-1 must be an int w >= 0"),
    (dict(local_window_size=(1, 2, 3)), "must be an int w >= 0 or a pair"),
    (dict(logits_soft_cap=0.0), "logits_soft_cap=0.0 must be a positive number"),
    (dict(local_window_size=8, sk=40), "local_window_size needs equal q and k lengths"),
    (dict(segment_ids="separate", causal=True), "causal attention takes one segment_ids"),
    (dict(segment_ids="short"), "segment_ids.kv must be"),
])
def test_window_cap_and_segment_ids_get_one_clear_error(kwargs, message):
  sk = kwargs.pop("sk", 32)
  q, k = jnp.zeros((1, 32, 2, 64)), jnp.zeros((1, sk, 2, 64))
  seg = kwargs.pop("segment_ids", None)
  if seg == "separate":
    seg = SegmentIds(jnp.ones((1, 32), jnp.int32), jnp.ones((1, sk), jnp.int32))
  elif seg == "short":
    seg = SegmentIds(jnp.ones((1, 32), jnp.int32), jnp.ones((1, 31), jnp.int32))
  kwargs.setdefault("causal", False)
  with pytest.raises(ValueError, match=message):
    attention(q, k, k, seg, **kwargs)


def test_xla_path_follows_the_segment_convention():
  q, k, v, do = random_inputs(1, 1, 24, 2, 2, 64, jnp.float32)
  seg = jnp.asarray([[1] * 10 + [2] * 10 + [0] * 4], jnp.int32)
  out = attention(q, k, v, seg, implementation="xla")
  want = ref.attention(q, k, v, do, seg, causal=True)[0]
  assert ref.rel_err(out, want) < 1e-5


def test_stats_report_fractions_per_head():
  q, k, v, _ = random_inputs(2, 2, 64, 4, 2, 64, jnp.float32)
  k = k.at[1, 3, 1].multiply(1e3)  # batch 1, kv head 1 -> query heads 2 and 3
  _, stats = attention(q, k, v, causal=False, return_stats=True, block_sizes=reference.BlockSizes(16, 16))
  assert stats.certified_tiles.shape == (2, 4, 4)
  np.testing.assert_allclose(np.asarray(stats.certified_fraction_per_head), [1.0, 1.0, 0.5, 0.5])
  assert float(stats.certified_fraction) == pytest.approx(0.75)
  _, online = attention(q, k, v, causal=False, stabilizer="online", return_stats=True)
  assert float(online.certified_fraction) == 0.0


@pytest.mark.parametrize("stabilizer", ["clis", "online"])
def test_stats_cover_the_real_tiles_only(stabilizer):
  """Lengths padded past a whole tile (here 80 rows padded to 128 for 64-key blocks): the tiles of padding
  rows only are not reported, so the fraction is over real tiles (the H200 run found them in the stats)."""
  q, k, v, _ = random_inputs(3, 1, 80, 2, 1, 64, jnp.float32)
  _, stats = attention(q, k, v, causal=True, stabilizer=stabilizer, return_stats=True,
                       block_sizes=reference.BlockSizes(32, 64))
  assert stats.certified_tiles.shape == (1, 2, 3)
  assert float(stats.certified_fraction) == (1.0 if stabilizer == "clis" else 0.0)


SMALL_TILES = {
    "reference": reference.BlockSizes(16, 16),
    "pallas_tpu": pallas_tpu.BlockSizes(16, 16, 16, 16, 16, 16),
    "pallas_gpu": pallas_gpu.BlockSizes(block_q=16, block_k=16, block_k_fixed=16, block_q_dq=16, block_k_dq=16, block_q_dkv=16,
                                        block_k_dkv=16),
}


# Pallas's plain interpreter cannot run kernels under check_vma (its grid loop drops the varying-axis types), so the
# Triton kernels are checked with check_vma=False here and the TPU kernels under the TPU interpreter
# (pltpu.InterpretParams), which keeps them.
@pytest.mark.parametrize("implementation,check_vma", [("reference", True), ("pallas_tpu", True),
                                                      ("pallas_gpu", False)])
def test_shard_map_over_batch_and_heads(implementation, check_vma):
  devices = np.array(jax.devices()[:4]).reshape(2, 2)
  mesh = jax.sharding.Mesh(devices, ("data", "tensor"))
  q, k, v, do = random_inputs(3, 4, 48, 4, 2, 64, jnp.float32)
  seg = jnp.asarray(np.repeat([[1] * 20 + [2] * 28], 4, 0), jnp.int32)

  @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P("data", None, "tensor"),) * 3 + (P("data"),),
                     out_specs=P("data", None, "tensor"), check_vma=check_vma)
  def sharded(q, k, v, seg):
    interpret = {"reference": False, "pallas_tpu": pltpu.InterpretParams()}.get(implementation, True)
    return attention(q, k, v, seg, implementation=implementation, interpret=interpret,
                     block_sizes=SMALL_TILES[implementation])

  out, vjp = jax.vjp(jax.jit(sharded), q, k, v, seg)
  got = (out, *vjp(do)[:3])
  want = ref.attention(q, k, v, do, seg, causal=True)
  for g, w in zip(got, want):
    assert ref.rel_err(g, w) < 5e-5


@pytest.mark.parametrize("causal,packed,dtype", [(True, False, jnp.bfloat16), (True, True, jnp.bfloat16),
                                                 (False, False, jnp.float32), (False, True, jnp.bfloat16)])
def test_triton_kernels_lower_for_the_gpu(causal, packed, dtype):
  """Catches ops the Triton backend cannot lower (interpret mode would not) without a GPU."""
  q = jax.ShapeDtypeStruct((1, 200, 8, 128), dtype)
  k = jax.ShapeDtypeStruct((1, 200, 2, 128), dtype)
  seg = jax.ShapeDtypeStruct((1, 200), jnp.int32) if packed else None

  def loss(q, k, v, seg):
    out = attention(q, k, v, seg, causal=causal, implementation="pallas_gpu", platform=plan.Platform("gpu"))
    return out.astype(jnp.float32).sum()

  text = lower_for_h200(jax.grad(loss, argnums=(0, 1, 2)), q, k, k, seg)
  for name in ("clis_fwd", "clis_bwd_dq", "clis_bwd_dkv"):
    assert name in text


def test_kernels_take_the_mode_and_refuse_a_stabilizer_that_does_not_match_it():
  """Every backend's forward receives the plan's Mode; the stabilizer must be what that mode names."""
  from clis_kernels import reference, stabilizer
  q = jnp.zeros((1, 64, 2, 32), jnp.float32)
  kw = dict(causal=True, scale=0.2, kv_len=None, block_sizes=reference.BlockSizes(32, 32))
  out, _, tiles = reference.forward(q, q, q, None, None, mode=plan.Mode.ONLINE, **kw)
  assert out.shape == q.shape and tiles is None
  with pytest.raises(ValueError, match="Mode.CERTIFICATE.*takes the stabilizer as Certificate; got NoneType"):
    reference.forward(q, q, q, None, None, mode=plan.Mode.CERTIFICATE, **kw)
  keys = stabilizer.key_bounds(q, q, None, causal=True, tau=64.0, block_q=32, seq_len=64)
  with pytest.raises(ValueError, match="reference.forward takes no Mode.KEYS"):
    reference.forward(q, q, q, None, keys, mode=plan.Mode.KEYS, **kw)
  assert plan.stabilizer_inputs(keys, plan.Mode.KEYS) == (keys, None)
