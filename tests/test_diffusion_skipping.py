"""Temporal tile skipping (reference path): exact when off, within its promised bound when on, explicit state."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from clis_kernels import reference_f64 as ref
from attention_base import TOLERANCE, lower_for_h200, lower_for_tpu, random_inputs
from clis_kernels import attention, diffusion, pallas_gpu, pallas_mgpu, pallas_tpu, plan, reference
from clis_kernels.plan import HOPPER, Platform

ON_GPU = jax.devices()[0].platform == "gpu"

BS = reference.BlockSizes(block_q=16, block_k=16)


def local_inputs(seed, seq=90, heads=2, d=32, sharpness=3.0, drift=0.0):
  """Rows attend mostly to their own neighbourhood, as video tokens do; `drift` perturbs a later step."""
  rng = np.random.default_rng(seed)
  pos = np.arange(seq) / seq
  freqs = np.arange(1, d // 2 + 1)
  base = np.concatenate([np.cos(np.outer(pos, freqs) * 2.0), np.sin(np.outer(pos, freqs) * 2.0)], -1)
  q = sharpness * base[None, :, None, :] + 0.3 * rng.standard_normal((1, seq, heads, d))
  k = sharpness * base[None, :, None, :] + 0.3 * rng.standard_normal((1, seq, heads, d))
  v = rng.standard_normal((1, seq, heads, d))
  if drift:
    q, k = q + drift * rng.standard_normal(q.shape), k + drift * rng.standard_normal(k.shape)
  return tuple(jnp.asarray(x, jnp.float32) for x in (q, k, v))


@pytest.mark.parametrize("thr", [-math.inf, -200.0])
def test_no_marks_means_dense_bit_for_bit(thr):
  q, k, v = local_inputs(0)
  state = diffusion.init_state(1, 2, 90, BS)
  dense = attention(q, k, v, causal=False, implementation="reference", block_sizes=BS)
  for _ in range(3):
    out, state, stats = diffusion.attention(q, k, v, state, thr=thr, block_sizes=BS)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(dense))
    assert not bool(state.skip.any())
  assert int(state.calls) == 3


@pytest.mark.parametrize("n", [1, 7, 32, 64, 65, 130])  # pairwise up to tile_lists.PAIRWISE_MAX, sorted beyond
def test_tile_orders_are_the_stable_sorts(n):
  """stable_rank and kept_tiles, which compare pairs on short rows instead of sorting, give exactly the stable
  argsorts' results, ties (equal bounds, the inf of non-candidates) in index order."""
  from clis_kernels.diffusion.tile_lists import kept_tiles, stable_rank
  rng = np.random.default_rng(n)
  x = jnp.asarray(rng.integers(0, 4, (2, 3, 5, n)).astype(np.float32))
  x = jnp.where(x == 3, jnp.inf, x)
  want = jnp.argsort(jnp.argsort(x, axis=-1, stable=True), axis=-1, stable=True)
  np.testing.assert_array_equal(np.asarray(stable_rank(x)), np.asarray(want))
  skip = jnp.asarray(rng.random((2, 3, 5, n)) < 0.4)
  visit, count = kept_tiles(skip, width=n + 3)
  want_visit = jnp.pad(jnp.argsort(skip, axis=-1, stable=True), [(0, 0)] * 3 + [(0, 3)])
  np.testing.assert_array_equal(np.asarray(visit), np.asarray(want_visit))
  np.testing.assert_array_equal(np.asarray(count), np.asarray((~skip).sum(-1)))


def test_error_stays_under_the_promised_bound():
  q, k, v = local_inputs(1)
  thr = -12.0
  state = diffusion.init_state(1, 2, 90, BS)
  first, state, stats = diffusion.attention(q, k, v, state, thr=thr, block_sizes=BS)
  assert 0.1 < float(state.skip.mean()) < 0.9, "the local inputs should make some tiles negligible"
  second, state2, stats2 = diffusion.attention(q, k, v, state, thr=thr, block_sizes=BS)
  assert float(stats2.sparsity) == float(state.skip.mean())
  want = ref.attention(q, k, v, jnp.zeros_like(q), causal=False)[0]
  # The promise: each skipped tile weighed < 2^thr in every row at the marking call (same inputs here).
  skipped_per_row = np.repeat(np.asarray(state.skip).sum(-1), 16, axis=-1)[..., :90]  # [B, H, S]
  delta = skipped_per_row * 2.0 ** thr
  bound = 2 * delta / (1 - delta) * float(jnp.abs(v).max())
  err = np.abs(np.asarray(second, np.float64) - want).max(-1).transpose(0, 2, 1)  # [B, H, S]
  assert np.all(err <= bound + 1e-6), (err.max(), bound.max())
  assert err.max() > 0  # tiles really were left out


def test_marks_only_accumulate_and_fresh_state_is_dense():
  state = diffusion.init_state(1, 2, 90, BS)
  seen = None
  for step in range(4):
    q, k, v = local_inputs(2, drift=0.02 * step)
    thr = diffusion.threshold_schedule(step, num_steps=4, dense_steps=1, thr_early=-16.0, thr_late=-10.0)
    _, state, stats = diffusion.attention(q, k, v, state, thr=thr, block_sizes=BS)
    skip = np.asarray(state.skip)
    if seen is not None:
      assert np.all(skip >= seen)  # write ⊆ read: a skipped tile never comes back
    seen = skip
    if step == 0:
      assert not skip.any()  # the first (dense) step marks nothing
  assert seen.any()
  q, k, v = local_inputs(2)
  fresh, _, _ = diffusion.attention(q, k, v, diffusion.init_state(1, 2, 90, BS), thr=-10.0, block_sizes=BS)
  dense = attention(q, k, v, causal=False, implementation="reference", block_sizes=BS)
  np.testing.assert_array_equal(np.asarray(fresh), np.asarray(dense))


def test_state_is_per_layer_and_survives_jit():
  layers = [diffusion.init_state(1, 2, 90, BS) for _ in range(2)]
  step = jax.jit(lambda q, k, v, s: diffusion.attention(q, k, v, s, thr=-10.0, block_sizes=BS)[:2])
  inputs = [local_inputs(3), local_inputs(4, sharpness=0.5)]  # a sparse layer and a dense-ish layer
  for _ in range(2):
    for i, (q, k, v) in enumerate(inputs):
      _, layers[i] = step(q, k, v, layers[i])
  assert isinstance(layers[0], diffusion.SkipState) and int(layers[0].calls) == 2
  assert float(layers[0].skip.mean()) > float(layers[1].skip.mean())


def test_context_parallel_skipping_gives_the_single_calls_rows_and_marks():
  """The tokens split over 4 devices (diffusion.context_parallel: keys all-gathered, each device its rows' state):
  over three calls with marks accumulating, the marks are the single call's and the outputs too (to float32
  rounding: the devices' matmuls have other shapes; the first, dense call as close to float64 as the single
  call), and marking and leaving tiles out happened."""
  from jax.sharding import PartitionSpec as P
  seq, thr = 128, -10.0
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("context",))
  tokens, states = P(None, "context"), diffusion.SkipState(skip=P(None, None, "context", None), calls=P())

  @jax.jit
  @functools.partial(jax.shard_map, mesh=mesh, in_specs=(tokens,) * 3 + (states,), out_specs=(tokens, states, P()))
  def split(q, k, v, state):
    out, state, stats = diffusion.context_parallel.attention(q, k, v, state, thr=thr, axis_name="context",
                                                             block_sizes=BS)
    return out, state, stats.sparsity

  whole = jax.jit(lambda q, k, v, state: diffusion.attention(q, k, v, state, thr=thr, block_sizes=BS))
  one = many = diffusion.init_state(1, 2, seq, BS)
  for step in range(3):
    q, k, v = local_inputs(7, seq=seq, drift=0.02 * step)
    want, one, stats = whole(q, k, v, one)
    got, many, sparsity = split(q, k, v, many)
    np.testing.assert_array_equal(np.asarray(many.skip), np.asarray(one.skip))
    assert float(sparsity) == pytest.approx(float(stats.sparsity))
    assert ref.rel_err(got, want) < 1e-6
    if step == 0:
      exact = ref.attention(q, k, v, jnp.zeros_like(q), causal=False)[0]
      assert ref.rel_err(got, exact) <= 1.5 * ref.rel_err(want, exact) + 1e-7
  assert 0.1 < float(one.skip.mean()) < 0.9 and float(stats.sparsity) > 0  # marks made, and tiles left out
  with pytest.raises(ValueError, match="whole number of the skip grid's 16-row q tiles"):
    split(*local_inputs(7, seq=120), diffusion.init_state(1, 2, 120, BS))  # chunks of 30 rows


def test_schedule_is_dense_first_and_stricter_early():
  thrs = [diffusion.threshold_schedule(s, num_steps=10, dense_steps=2) for s in range(10)]
  assert thrs[:2] == [-math.inf, -math.inf]
  assert thrs[2] == -20.0 and thrs[-1] == -10.0 and thrs == sorted(thrs)


def test_state_shape_is_checked():
  q, k, v = local_inputs(0)
  with pytest.raises(ValueError, match="state.skip.shape"):
    diffusion.attention(q, k, v, diffusion.init_state(1, 3, 90, BS), thr=-10.0, block_sizes=BS)


GPU_BS = pallas_gpu.BlockSizes(block_q=16, block_k=16, block_k_fixed=16, block_q_dq=16, block_k_dq=16,
                               block_q_dkv=16, block_k_dkv=16, num_warps=4, num_stages=2)
TPU_BS = pallas_tpu.BlockSizes(*(16,) * 6)
KERNELS = [("pallas_gpu", GPU_BS), ("pallas_tpu", TPU_BS)]


@pytest.mark.parametrize("implementation,kernel_bs", KERNELS, ids=[k[0] for k in KERNELS])
@pytest.mark.parametrize("stabilizer_name", ["clis", "online"])
def test_skip_kernel_marks_like_the_reference_and_keeps_the_bound(stabilizer_name, implementation, kernel_bs):
  """Each skip kernel (Triton, Mosaic TPU; interpret mode) forms the same marking statistic as the
  reference, runs dense when nothing is marked, and stays within the promised bound when tiles are
  left out."""
  q, k, v = local_inputs(5)
  thr = -12.0
  run = lambda impl, bs, state: diffusion.attention(q, k, v, state, thr=thr, block_sizes=bs, implementation=impl,
                                                    interpret=impl != "reference", stabilizer_name=stabilizer_name)
  ref_out, ref_state, _ = run("reference", BS, diffusion.init_state(1, 2, 90, BS))
  gpu_out, gpu_state, _ = run(implementation, kernel_bs, diffusion.init_state(1, 2, 90, kernel_bs))
  np.testing.assert_array_equal(np.asarray(gpu_state.skip), np.asarray(ref_state.skip))
  assert 0.1 < float(gpu_state.skip.mean()) < 0.9
  want = ref.attention(q, k, v, jnp.zeros_like(q), causal=False)[0]
  assert ref.rel_err(gpu_out, want) < 1e-5  # the marking call itself is dense
  second, _, stats = run(implementation, kernel_bs, gpu_state)
  assert float(stats.sparsity) == float(gpu_state.skip.mean())
  skipped_per_row = np.repeat(np.asarray(gpu_state.skip).sum(-1), 16, axis=-1)[..., :90]
  delta = skipped_per_row * 2.0 ** thr
  err = np.abs(np.asarray(second, np.float64) - want).max(-1).transpose(0, 2, 1)
  rounding = 2 * float(np.abs(np.asarray(gpu_out, np.float64) - want).max())  # f32 error of the dense call
  assert np.all(err <= 2 * delta / (1 - delta) * float(jnp.abs(v).max()) + rounding)
  assert not np.array_equal(np.asarray(second), np.asarray(gpu_out))  # tiles really were left out
  ref_second, _, _ = run("reference", BS, ref_state)
  assert ref.rel_err(second, ref_second) < 1e-5  # same tiles left out, same result


@pytest.mark.parametrize("implementation,kernel_bs", KERNELS, ids=[k[0] for k in KERNELS])
def test_skip_kernel_without_marks_is_dense(implementation, kernel_bs):
  q, k, v = local_inputs(6, seq=70)
  state = diffusion.init_state(1, 2, 70, kernel_bs)
  out, state, _ = diffusion.attention(q, k, v, state, thr=-math.inf, block_sizes=kernel_bs,
                                      implementation=implementation, interpret=True)
  assert not bool(state.skip.any())
  want = ref.attention(q, k, v, jnp.zeros_like(q), causal=False)[0]
  assert ref.rel_err(out, want) < 1e-5  # f32 forward tolerance of the shared test base


LOWERINGS = {"pallas_gpu": (pallas_gpu, lower_for_h200, 300, "clis_skip_fwd", Platform("gpu", hopper=True)),
             "pallas_tpu": (pallas_tpu, lower_for_tpu, 1000, "clis_skip_fwd_tpu", Platform("tpu")),
             "pallas_mgpu": (pallas_mgpu, lower_for_h200, 1000, "custom_call @mosaic_gpu", HOPPER)}


@pytest.mark.parametrize("implementation", list(LOWERINGS))
@pytest.mark.parametrize("track", [True, False])
def test_skip_kernels_lower_for_their_hardware(implementation, track):
  """With no GPU or TPU present: the Triton and Mosaic GPU list-driven loops lower for an H200, the TPU
  kernel's scalar-prefetched tables and index maps for a TPU v5e, at their default tiles."""
  backend, lower, seq, name, platform = LOWERINGS[implementation]
  q = jax.ShapeDtypeStruct((1, seq, 4, 128), jnp.bfloat16)
  bs = backend.default_block_sizes(128, seq, jnp.bfloat16)
  state = diffusion.init_state(1, 4, seq, bs)
  fn = lambda q, k, v, s: diffusion.attention(q, k, v, s, thr=-10.0 if track else -math.inf, block_sizes=bs,
                                              implementation=implementation, platform=platform)[0]
  assert name in lower(fn, q, q, q, state)


def test_calibration_finds_the_loosest_threshold_within_the_target_error():
  q, k, v = local_inputs(7)
  state = diffusion.init_state(1, 2, 90, BS)
  dense = diffusion.attention(q, k, v, state, thr=-math.inf, block_sizes=BS)[0]
  rel_l1 = lambda s: float(jnp.mean(jnp.abs(diffusion.attention(q, k, v, s, thr=-math.inf, block_sizes=BS)[0] - dense))
                           / jnp.mean(jnp.abs(dense)))
  found = {}
  for target in (1e-4, 1e-2):
    thr, err = diffusion.calibrate_thr(q, k, v, state, target=target, block_sizes=BS, iters=6)
    assert math.isfinite(thr) and err <= target
    _, marked, _ = diffusion.attention(q, k, v, state, thr=thr, block_sizes=BS)
    assert bool(marked.skip.any()) and rel_l1(marked) == pytest.approx(err)
    found[target] = (thr, marked)
  assert found[1e-2][0] >= found[1e-4][0]  # a looser target never gives a stricter threshold
  assert found[1e-2][1].skip.sum() >= found[1e-4][1].skip.sum()


def test_a_loose_threshold_never_skips_a_rows_last_keys():
  """At thr = -1 every tile is a candidate; the budget 2^(-thr-1) = 1 tile per q tile keeps δ < 1/2."""
  q, k, v = local_inputs(8)
  state = diffusion.init_state(1, 2, 90, BS)
  for thr in (-1.0, -2.0):
    _, marked, _ = diffusion.attention(q, k, v, state, thr=thr, block_sizes=BS)
    per_q_tile = np.asarray(marked.skip).sum(-1)
    assert per_q_tile.max() <= 2.0 ** (-thr - 1) and per_q_tile.max() >= 1
    out = diffusion.attention(q, k, v, marked, thr=-math.inf, block_sizes=BS)[0]
    assert bool(jnp.isfinite(out).all()) and float(jnp.abs(out).sum(-1).min()) > 0  # no row emptied


def test_hopper_picks_the_mosaic_gpu_skip_kernel_and_its_tiles():
  """Through the one front door: skipping on Hopper plans the Mosaic GPU kernel, whose skip tile is a CTA's
  128 rows by a 128-key block; float32 (which it does not take) falls back to the Triton kernel."""
  chosen = plan.make_plan(dtype=jnp.bfloat16, head_dim=128, seq_len=32768, skipping=True, causal=False, platform=HOPPER)
  assert chosen.entry.name == "pallas_mgpu" and chosen.block_sizes.skip_tiles == (128, 128)
  f32 = plan.make_plan(dtype=jnp.float32, head_dim=128, seq_len=32768, skipping=True, causal=False, platform=HOPPER)
  assert f32.entry.name == "pallas_gpu"
  state = diffusion.init_state(1, 2, 1000, chosen.block_sizes)
  assert state.skip.shape == (1, 2, 8, 8)


@pytest.mark.skipif(ON_GPU, reason="lowering check for machines without a GPU")
@pytest.mark.parametrize("seq,hkv,stabilizer_name,track", [(1000, 4, "clis", True), (1024, 2, "online", True),
                                                            (75600, 4, "clis", False)])
def test_mosaic_gpu_skip_kernel_lowers_with_lists_of_any_length(seq, hkv, stabilizer_name, track):
  """Lists of 8 to 591 KV blocks (kept in rows of 128 entries for TMA), GQA, odd lengths (a masked last
  block), the certified and online loops, with and without the row maxima."""
  q = jax.ShapeDtypeStruct((1, seq, 4, 128), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((1, seq, hkv, 128), jnp.bfloat16)
  bs = pallas_mgpu.default_block_sizes(128, seq, jnp.bfloat16)
  state = diffusion.init_state(1, 4, seq, bs)
  fn = lambda q, k, v, s: diffusion.attention(q, k, v, s, thr=-10.0 if track else -math.inf, block_sizes=bs,
                                              stabilizer_name=stabilizer_name, implementation="pallas_mgpu",
                                              platform=HOPPER)[0]
  assert lower_for_h200(fn, q, k, k, state).count("custom_call @mosaic_gpu") == 1


def _f64_with_skips(q, k, v, skip, rows, keys):
  """float64 attention with the marked (q tile, kv tile) pairs left out: [B, S, H, D]."""
  q64, k64, v64 = (np.asarray(x, np.float64) for x in (q, k, v))
  group = q.shape[2] // k.shape[2]
  k64, v64 = np.repeat(k64, group, axis=2), np.repeat(v64, group, axis=2)
  s = np.einsum("bqhd,bkhd->bhqk", q64, k64) / math.sqrt(q.shape[-1])
  hidden = np.repeat(np.repeat(np.asarray(skip), rows, axis=2), keys, axis=3)[:, :, :q.shape[1], :k.shape[1]]
  s = np.where(hidden, -np.inf, s)
  p = np.exp(s - s.max(-1, keepdims=True))
  return np.einsum("bhqk,bkhd->bqhd", p / p.sum(-1, keepdims=True), v64)


MGPU_SKIP_CASES = [("odd_gqa", 1000, 8, 2), ("whole_blocks", 2048, 4, 4), ("odd_long", 4500, 4, 4)]


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="Mosaic GPU kernels run on an NVIDIA Hopper GPU only")
@pytest.mark.parametrize("case", MGPU_SKIP_CASES, ids=[c[0] for c in MGPU_SKIP_CASES])
@pytest.mark.parametrize("stabilizer_name", ["clis", "online"])
def test_mosaic_gpu_skip_kernel_matches_float64_on_gpu(case, stabilizer_name):
  """Bidirectional, with half the tiles left out at random (never a q tile's every tile), against float64
  attention that leaves out the same tiles; nothing left out equals the dense kernel within bf16 tolerance;
  the marking statistic bounds max_{i, j∈u} (t_ij − lse_i) of the float64 call from above, and is tight."""
  name, seq, hq, hkv = case
  q, k, v, _ = random_inputs(len(name), 1, seq, hq, hkv, 128, jnp.bfloat16)
  bs = pallas_mgpu.default_block_sizes(128, seq, jnp.bfloat16)
  rows, keys = bs.skip_tiles
  empty = diffusion.init_state(1, hq, seq, bs)
  run = lambda state, thr=-math.inf: diffusion.attention(q, k, v, state, thr=thr, implementation="pallas_mgpu",
                                                         stabilizer_name=stabilizer_name)
  dense_out = run(empty)[0]
  want_dense = _f64_with_skips(q, k, v, empty.skip, rows, keys)
  assert ref.rel_err(dense_out, want_dense) < TOLERANCE[jnp.bfloat16][0]
  want_plain = attention(q, k, v, causal=False, stabilizer=stabilizer_name, implementation="pallas_mgpu")
  assert ref.rel_err(dense_out, want_plain.astype(jnp.float32)) < TOLERANCE[jnp.bfloat16][0]

  rank = jax.random.uniform(jax.random.PRNGKey(1), empty.skip.shape).argsort(-1).argsort(-1)
  skip = rank < empty.skip.shape[-1] // 2
  out = run(diffusion.SkipState(skip, empty.calls))[0]
  assert bool(jnp.isfinite(out.astype(jnp.float32)).all())
  assert ref.rel_err(out, _f64_with_skips(q, k, v, skip, rows, keys)) < TOLERANCE[jnp.bfloat16][0]

  plan_ = plan.make_plan(dtype=q.dtype, head_dim=128, seq_len=seq, skipping=True, causal=False,
                         implementation="pallas_mgpu", stabilizer=stabilizer_name)
  gap, log2_l = _statistic(q, k, v, empty.skip, plan_, stabilizer_name)
  exact = _f64_excess(q, k, rows, keys)
  assert np.all(np.asarray(gap - log2_l[..., None]) >= exact - 0.02)  # bf16 logits: a few ulps of ~8 nats
  assert np.all(np.asarray(gap - log2_l[..., None]) <= exact + 0.05)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="Mosaic GPU kernels run on an NVIDIA Hopper GPU only")
@pytest.mark.parametrize("thr", [-math.inf, -1e4])
def test_nothing_skipped_is_the_dense_kernel_bit_for_bit_on_gpu(thr):
  """The example DiT's shape (B 4, S 4096, H 2, D 64), through the sampler's own attention functions: the skip
  path walking every block, marking (thr −1e4) or not, returns the dense `clis` call's output bit for bit (both
  take the plan's automatic loop), so a skipped sample differs from the dense one only by what was left out."""
  from examples.video_dit import sampler
  from examples.video_dit.model import DiTConfig
  cfg = DiTConfig()
  q, k, v, _ = random_inputs(4, 4, cfg.tokens, cfg.heads, cfg.heads, cfg.head_dim, jnp.bfloat16)
  state = sampler.init_skip_states(cfg, 4)[0]
  listed, marked, _ = jax.jit(sampler.make_attend("clis_skip", thr, cfg))(q, k, v, state)
  dense, _, _ = jax.jit(sampler.make_attend("clis"))(q, k, v, None)
  np.testing.assert_array_equal(np.asarray(listed.astype(jnp.float32)), np.asarray(dense.astype(jnp.float32)))
  assert not bool(marked.skip.any())


def _statistic(q, k, v, skip, plan_, stabilizer_name):
  """The skip kernel's (gap, log2_l) for this call, as diffusion.attention receives them."""
  from clis_kernels import api
  from clis_kernels.stabilizer import default_tau
  qp, kp, vp = (api.pad_seq(x, plan_.multiple) for x in (q, k, v))
  kv_len = k.shape[1] if kp.shape[1] != k.shape[1] else None
  scale = 1 / math.sqrt(q.shape[-1])
  stab = api.stabilizer_input(plan_, qp, kp, vp, None, causal=False, scale=scale, tau=default_tau(q.dtype),
                              granularity="tile", seq_len=q.shape[1], kv_seq_len=k.shape[1], window=None,
                              separate_ids=False, softcap=None)
  _, gap, log2_l = plan_.backend.skip_forward(qp, kp, vp, skip, stab, mode=plan_.mode, scale=scale, kv_len=kv_len,
                                              seq_len=q.shape[1], block_sizes=plan_.block_sizes, track=True)
  return gap, log2_l


def _f64_excess(q, k, rows, keys):
  """max over each (q tile, kv tile) of t_ij − lse_i in log2 units, float64: [B, H, nq, nk]."""
  q64, k64 = np.asarray(q, np.float64), np.asarray(k, np.float64)
  k64 = np.repeat(k64, q.shape[2] // k.shape[2], axis=2)
  t = np.einsum("bqhd,bkhd->bhqk", q64, k64) / math.sqrt(q.shape[-1]) / math.log(2)
  lse = np.log2(np.exp2(t - t.max(-1, keepdims=True)).sum(-1)) + t.max(-1)
  excess = t - lse[..., None]
  nq, nk = -(-q.shape[1] // rows), -(-k.shape[1] // keys)
  pad = np.full(excess.shape[:2] + (nq * rows, nk * keys), -np.inf)
  pad[:, :, :q.shape[1], :k.shape[1]] = excess
  return pad.reshape(*excess.shape[:2], nq, rows, nk, keys).max(axis=(3, 5))


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="Mosaic GPU kernels run on an NVIDIA Hopper GPU only")
def test_calibration_works_with_the_mosaic_gpu_skip_kernel_on_gpu():
  """LiteAttention's per-call calibration through the Hopper default (no implementation named): the loosest thr
  within a 1% relative L1 error marks tiles, and the marked call's measured error is what calibration said."""
  q, k, v = (x.astype(jnp.bfloat16) for x in local_inputs(9, seq=2048, heads=4, d=128, sharpness=4.0))
  bs = plan.make_plan(dtype=q.dtype, head_dim=128, seq_len=2048, skipping=True, causal=False).block_sizes
  assert bs.skip_tiles == (128, 128)
  state = diffusion.init_state(1, 4, 2048, bs)
  thr, err = diffusion.calibrate_thr(q, k, v, state, target=0.01, iters=6)
  assert math.isfinite(thr) and err <= 0.01
  _, marked, _ = diffusion.attention(q, k, v, state, thr=thr)
  assert bool(marked.skip.any())
  dense = diffusion.attention(q, k, v, state, thr=-math.inf)[0].astype(jnp.float32)
  out = diffusion.attention(q, k, v, marked, thr=-math.inf)[0].astype(jnp.float32)
  assert float(jnp.mean(jnp.abs(out - dense)) / jnp.mean(jnp.abs(dense))) == pytest.approx(err, rel=1e-3)


def test_head_dims_the_kernels_do_not_run_are_padded():
  """D 80 (Wan's 5120 / 64 heads is 80): zero columns up to the plan's head dim, cut off again; the output
  equals the unpadded reference's and the Mosaic GPU skip kernel lowers for it."""
  q, k, v = local_inputs(10, seq=90, d=80)
  state = diffusion.init_state(1, 2, 90, BS)
  out = diffusion.attention(q, k, v, state, thr=-math.inf, block_sizes=BS)[0]
  assert out.shape == q.shape
  want = ref.attention(q, k, v, jnp.zeros_like(q), causal=False)[0]
  assert ref.rel_err(out, want) < 1e-5
  spec = jax.ShapeDtypeStruct((1, 256, 2, 80), jnp.bfloat16)
  bs = plan.make_plan(dtype=jnp.bfloat16, head_dim=80, seq_len=256, skipping=True, causal=False,
                      platform=HOPPER).block_sizes
  fn = lambda q, k, v, s: diffusion.attention(q, k, v, s, thr=-10.0, platform=HOPPER)[0]
  if not ON_GPU:
    assert lower_for_h200(fn, spec, spec, spec, diffusion.init_state(1, 2, 256, bs)).count("custom_call @mosaic_gpu") == 1
