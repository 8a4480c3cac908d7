"""The certificate's soundness (pure JAX, no kernels).

On many random and skewed inputs: the upper bound is never below the true row max, the
lower bound never above it, and wherever a tile is certified the true max is within τ of
the bound. And the threshold is not vacuous: forcing the fixed stabilizer past the floor T
loses accuracy, which is exactly where the real certificate refuses.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from clis_kernels import reference_f64 as ref
from clis_kernels import reference, stabilizer, testing
from clis_kernels.plan import Mode
from clis_kernels.stabilizer import LOG2E, Certificate

BLOCK_Q = 16


def true_row_max(q, k, segment_ids, causal, scale, window=None):
  """[B, Hq, S] max visible logit in base 2, float64 (-inf where nothing is visible)."""
  q64, k64 = np.asarray(q, np.float64), np.asarray(k, np.float64)
  k64 = np.repeat(k64, q.shape[2] // k.shape[2], axis=2)
  s = np.einsum("bqhd,bkhd->bhqk", q64, k64) * scale * LOG2E
  mask = ref.visible(q.shape[1], k.shape[1], segment_ids, causal, window)
  return np.where(mask[:, None], s, -np.inf).max(-1)


def skewed_inputs(seed, kind, batch=2, seq=64, hq=4, hkv=2, d=32):
  rng = np.random.default_rng(seed)
  q = rng.standard_normal((batch, seq, hq, d))
  k = rng.standard_normal((batch, seq, hkv, d))
  if kind == "common_component":  # trained-model-like keys: a large shared direction
    k += 6.0 * rng.standard_normal((1, 1, hkv, d))
  elif kind == "sink":
    k[:, rng.integers(seq)] *= 50.0
  elif kind == "heavy_tail":
    k *= rng.standard_cauchy((batch, seq, hkv, 1)).clip(-30, 30)
    q *= rng.standard_cauchy((batch, seq, hq, 1)).clip(-30, 30)
  elif kind == "scaled":
    q *= 8.0
    k *= 8.0
  elif kind == "aligned":  # q and k share a direction: large positive logits, small spread
    direction = rng.standard_normal(d)
    q = 5.0 * direction + 0.1 * q
    k = 5.0 * direction + 0.1 * k
  return jnp.asarray(q, jnp.float32), jnp.asarray(k, jnp.float32), jnp.asarray(rng.standard_normal(k.shape), jnp.float32)


def packed(seed, batch, seq):
  rng = np.random.default_rng(seed)
  ids = np.stack([np.searchsorted(np.sort(rng.choice(np.arange(1, seq), 4, replace=False)), np.arange(seq),
                                  side="right") + 1 for _ in range(batch)])
  ids[:, :2] = 0
  return jnp.asarray(ids, jnp.int32)


KINDS = ["gaussian", "common_component", "sink", "heavy_tail", "scaled", "aligned"]


CERTIFY = {"radius": stabilizer.certify, "blocks": stabilizer.certify_blocks}


@pytest.mark.parametrize("bound", list(CERTIFY))
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("causal,is_packed", [(True, False), (True, True), (False, False), (False, True)])
def test_bounds_hold_and_certified_tiles_are_within_tau(kind, causal, is_packed, bound):
  scale = 1 / math.sqrt(32)
  for seed in range(4):
    q, k, v = skewed_inputs(seed, kind)
    seg = packed(seed, q.shape[0], q.shape[1]) if is_packed else None
    tau = 8.0
    cert = CERTIFY[bound](q, k, v, seg, causal=causal, scale=scale, tau=tau, granularity="tile",
                          block_q=BLOCK_Q, seq_len=q.shape[1])
    _check_sound(cert, q, k, v, seg, causal, scale, tau)


def _check_sound(cert, q, k, v, seg, causal, scale, tau, window=None, block_q=BLOCK_Q):
  """U >= the true row max >= L (f32 slack), certified rows within tau of U, no weight above 2^h."""
  row_max = true_row_max(q, k, seg, causal, scale, window)
  seen = np.isfinite(row_max)
  upper, lower = np.asarray(cert.upper, np.float64), np.asarray(cert.lower, np.float64)
  slack = 1e-4 * (1 + np.abs(row_max[seen]))  # f32 arithmetic of the bound itself
  assert np.all(upper[seen] >= row_max[seen] - slack), "upper bound below the true max"
  assert np.all(lower[seen] <= row_max[seen] + slack), "lower bound above the true max"
  tiles = np.repeat(np.asarray(cert.certified), block_q, axis=-1)
  certified_rows = tiles & seen
  gap = upper - row_max
  assert np.all(gap[certified_rows] <= tau * LOG2E + slack.max()), "a certified row is farther than tau"
  # The stabilizer of a certified row never lets a weight exceed 2^h (no overflow).
  headroom, _ = stabilizer.headroom_and_floor(v, segment_ids=seg, seq_len=k.shape[1])
  top = row_max - np.asarray(cert.m)
  h = np.repeat(np.asarray(headroom), q.shape[2] // k.shape[2], axis=1)[..., None]
  assert np.all((top <= h + 1e-3)[certified_rows])


@pytest.mark.parametrize("family", ["sink0", "sinks_many", "outlier_channels", "rope_5e5_wide", "packed_sinks"])
@pytest.mark.parametrize("causal,window", [(True, None), (False, None), (True, (40, 0)), (False, (24, 24))])
def test_block_bound_is_sound_on_pretrained_like_inputs(family, causal, window):
  from clis_kernels.testing import inputs
  q, k, v, _, seg = inputs(family, 2, 128, 4, 2, 32, dtype=jnp.float32)
  scale = 1 / math.sqrt(32)
  cert = stabilizer.certify_blocks(q, k, v, seg, causal=causal, scale=scale, tau=64.0, granularity="tile",
                                   block_q=BLOCK_Q, seq_len=q.shape[1], window=window)
  _check_sound(cert, q, k, v, seg, causal, scale, 64.0, window)


def test_block_bound_is_sound_with_separate_ids_and_unequal_lengths():
  rng = np.random.default_rng(3)
  q = jnp.asarray(rng.standard_normal((2, 48, 4, 32)) * 3, jnp.float32)
  k = jnp.asarray(rng.standard_normal((2, 80, 2, 32)) + 2.0, jnp.float32).at[:, 7].multiply(20.0)
  v = jnp.asarray(rng.standard_normal((2, 80, 2, 32)), jnp.float32)
  seg = stabilizer.masks.SegmentIds(jnp.asarray(np.repeat([[1] * 20 + [2] * 20 + [0] * 8], 2, 0), jnp.int32),
                                    jnp.asarray(np.repeat([[1] * 30 + [2] * 40 + [0] * 10], 2, 0), jnp.int32))
  scale = 1 / math.sqrt(32)
  cert = stabilizer.certify_blocks(q, k, v, seg, causal=False, scale=scale, tau=64.0, granularity="tile",
                                   block_q=BLOCK_Q, seq_len=48, kv_seq_len=80, separate_ids=True)
  _check_sound(cert, q, k, v, seg, False, scale, 64.0)


def test_sink_and_scale_make_certification_fail():
  scale = 1 / math.sqrt(32)
  q, k, v = skewed_inputs(0, "gaussian")
  ok = stabilizer.certify(q, k, v, None, causal=False, scale=scale, tau=64.0, granularity="tile", block_q=BLOCK_Q,
                          seq_len=q.shape[1])
  assert bool(ok.certified.all())
  k_sink = k.at[:, 5].multiply(1e3)
  bad = stabilizer.certify(q, k_sink, v, None, causal=False, scale=scale, tau=64.0, granularity="tile",
                           block_q=BLOCK_Q, seq_len=q.shape[1])
  assert not bool(bad.certified.any())


@pytest.mark.parametrize("dtype,cap,v_scale,certifies", [
    (jnp.bfloat16, 50.0, 1.0, True),  # Gemma 2's cap: 2c·log2 e = 144 <= min(185, h + T = 213)
    (jnp.float32, 30.0, 1.0, True),  # 87 <= 92 (τ = 64 nats)
    (jnp.float32, 50.0, 1.0, False),  # 144 > 92: τ refuses
    (jnp.bfloat16, 50.0, 2.0**90, False)])  # |v| ~ 2^90 leaves h + T = 141 < 144: the data refuses
def test_cap_bound_holds_and_certifies_by_the_cap_alone(dtype, cap, v_scale, certifies):
  """bound="cap": ±c·log2 e (widened for tanh.approx) bounds every capped row max, even of logits ~1e3 before the
  cap; M = max(−U, U − h) per (batch, kv head); every tile passes or none does, as τ and h + T say."""
  q, k, v = skewed_inputs(3, "heavy_tail")
  q, k, v = q.astype(dtype), k.astype(dtype), (v * v_scale).astype(dtype)
  scale, cap2, tau = 1 / math.sqrt(32), cap * LOG2E, stabilizer.default_tau(dtype)
  cert = stabilizer.certify_cap(v, None, num_heads=q.shape[2], q_len=q.shape[1], softcap=cap, tau=tau,
                                granularity="tile", block_q=BLOCK_Q, seq_len=q.shape[1])
  row_max = true_row_max(q, k, None, True, scale)
  assert np.abs(row_max).max() > 4 * cap2  # the cap is what bounds these rows
  capped = cap2 * np.tanh(row_max / cap2)  # capping is monotone: the capped max is the max's cap
  upper, lower = np.asarray(cert.upper, np.float64), np.asarray(cert.lower, np.float64)
  assert np.all(upper >= capped) and np.all(lower <= capped) and np.all(upper == -lower)
  headroom, _ = stabilizer.headroom_and_floor(v, segment_ids=None, seq_len=k.shape[1])
  h = np.repeat(np.asarray(headroom), q.shape[2] // k.shape[2], axis=1)[..., None]
  np.testing.assert_allclose(np.asarray(cert.m), np.maximum(lower, upper - h), rtol=1e-6)
  assert bool(cert.certified.all()) is certifies and bool(cert.certified.any()) is certifies
  assert stabilizer.cap_certifies(cap, tau) is (certifies or v_scale > 1)


def test_floor_depends_on_dtype_and_length():
  v32 = jnp.ones((1, 4096, 1, 8), jnp.float32)
  h32, t32 = stabilizer.headroom_and_floor(v32, segment_ids=None, seq_len=4096)
  h16, t16 = stabilizer.headroom_and_floor(v32.astype(jnp.bfloat16), segment_ids=None, seq_len=4096)
  hf16, tf16 = stabilizer.headroom_and_floor(v32.astype(jnp.float16), segment_ids=None, seq_len=4096)
  assert (t32, t16) == (126 - 25 - 12, 126 - 9 - 12)
  assert tf16 < 0 and float(hf16.max()) < 16  # f16 has no range to spare: never certified
  assert float(h32.max()) == float(h16.max()) == 126 - 12  # (maxexp - 2) - log2 N - 0
  big_v = stabilizer.headroom_and_floor(v32 * 2.0**20, segment_ids=None, seq_len=4096)[0]
  assert float(big_v.max()) == 126 - 12 - 20


def _wide_rows(seed, gap_bits, seq=64, d=32):
  """Bidirectional rows whose logits span about `gap_bits` (base 2) between bound and max."""
  rng = np.random.default_rng(seed)
  q = rng.standard_normal((1, seq, 1, d))
  q /= np.linalg.norm(q, axis=-1, keepdims=True)
  k = rng.standard_normal((1, seq, 1, d))
  k /= np.linalg.norm(k, axis=-1, keepdims=True)
  radius = np.linalg.norm(k - k.mean(1, keepdims=True), axis=-1).max()
  scale = gap_bits / (LOG2E * radius)  # U - L = σ·log2e·‖q‖·R = gap_bits exactly
  v = rng.standard_normal((1, seq, 1, d))
  return (jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)), float(scale)


def test_forcing_past_the_floor_loses_accuracy_where_the_certificate_refuses():
  (q, k, v), scale = _wide_rows(0, gap_bits=600.0)
  do = jnp.zeros_like(q)
  want = ref.attention(q, k, v, do, causal=False, scale=scale)[0]
  bs = reference.BlockSizes(block_q=16, block_k=16)
  real = stabilizer.certify(q, k, v, None, causal=False, scale=scale, tau=1e9, granularity="tile", block_q=16,
                            seq_len=q.shape[1])
  assert not bool(real.certified.any()), "a 600-bit gap exceeds h + T for bf16 and must not certify"
  # Force certification with M = U (no headroom): the dominant weight underflows.
  forced = Certificate(m=real.upper, certified=jnp.ones_like(real.certified), upper=real.upper, lower=real.lower,
                       threshold=real.threshold)
  kw = dict(causal=False, scale=scale, kv_len=None, block_sizes=bs)
  forced_out = reference.forward(q, k, v, None, forced, mode=Mode.CERTIFICATE, **kw)[0]
  online_out = reference.forward(q, k, v, None, None, mode=Mode.ONLINE, **kw)[0]
  real_out = reference.forward(q, k, v, None, real, mode=Mode.CERTIFICATE, **kw)[0]
  online_err = ref.rel_err(online_out, want)
  assert ref.rel_err(real_out, want) == online_err  # refused: it ran the online path
  assert ref.rel_err(forced_out, want) > 10 * online_err  # and refusing was right


@pytest.mark.parametrize("gap_bits", [40.0, 150.0, 200.0])
def test_certified_near_the_floor_is_as_accurate_as_online(gap_bits):
  """With tau out of the way, rows certified by h + T alone keep online accuracy (bf16)."""
  errs = {"clis": [], "online": []}
  certified_any = False
  for seed in range(6):
    (q, k, v), scale = _wide_rows(seed, gap_bits)
    want = ref.attention(q, k, v, jnp.zeros_like(q), causal=False, scale=scale)[0]
    cert = stabilizer.certify(q, k, v, None, causal=False, scale=scale, tau=1e9, granularity="tile", block_q=16,
                              seq_len=q.shape[1])
    certified_any |= bool(cert.certified.any())
    kw = dict(causal=False, scale=scale, kv_len=None, block_sizes=reference.BlockSizes(16, 16))
    errs["clis"].append(ref.rel_err(reference.forward(q, k, v, None, cert, mode=Mode.CERTIFICATE, **kw)[0], want))
    errs["online"].append(ref.rel_err(reference.forward(q, k, v, None, None, mode=Mode.ONLINE, **kw)[0], want))
  assert certified_any
  assert np.mean(errs["clis"]) <= 1.25 * np.mean(errs["online"]), errs


def test_head_granularity_needs_every_tile():
  scale = 1 / math.sqrt(32)
  q, k, v = skewed_inputs(1, "gaussian", batch=1)
  k = k.at[0, 40, 0].multiply(1e3)
  kw = dict(causal=True, scale=scale, tau=64.0, block_q=BLOCK_Q, seq_len=q.shape[1])
  tile = stabilizer.certify(q, k, v, None, granularity="tile", **kw).certified
  head = stabilizer.certify(q, k, v, None, granularity="head", **kw).certified
  np.testing.assert_array_equal(np.asarray(head), np.broadcast_to(np.asarray(tile).all(-1, keepdims=True), tile.shape))
  assert bool(tile[0, 0].any()) and not bool(head[0, 0].any())


def test_sampled_centre_keeps_the_radius_tight_and_ignores_a_sink():
  """Causal rows' centre comes from 32 of 256 blocks; the radius about it stays within 2% of the radius
  about the median of all block means, and a sink key does not move it."""
  rng = np.random.default_rng(7)
  k = rng.standard_normal((1, 4096, 2, 64)) + 4.0 * rng.standard_normal((1, 1, 2, 64))
  k[0, 1000] *= 100.0  # a sink
  k = jnp.asarray(k, jnp.float32)
  v = jnp.ones_like(k)
  keys = stabilizer.key_bounds(k, v, None, causal=True, tau=64.0, block_q=16, seq_len=4096)
  full = jnp.median(k.reshape(1, 256, 16, 2, 64).mean(2), axis=1, keepdims=True)  # [1, 1, 2, 64]
  assert stabilizer.SAMPLED_BLOCKS < 256
  typical = np.delete(np.asarray(k[0]), 1000, axis=0)  # every key but the sink
  radius = lambda c: np.linalg.norm(typical - np.asarray(c[0]), axis=-1).max(0)  # [2]
  assert np.all(radius(keys.centre) <= 1.02 * radius(full))
  assert float(jnp.linalg.norm(keys.centre - full, axis=-1).max()) < 0.5


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("block_q", [16, 64])
def test_bidirectional_lower_bound_holds_where_the_median_of_block_means_leaves_the_hull(block_q, dtype):
  """Key blocks in three orthogonal clusters have a coordinate-wise median of block means near 0, outside
  the keys' convex hull, and queries pointing away from all three see every logit far below q·median. The
  bidirectional lower bound q·c must stay below the true row max there (c the exact key mean), for the
  radius bound's XLA certificate and for the KeyBounds the kernels certify from."""
  for magnitude in (20.0, 60.0):
    q, k, v, _ = testing.hull_escaping(1, 384, 2, 1, 64, magnitude=magnitude, dtype=dtype)
    scale = 1 / 8
    cert = stabilizer.certify(q, k, v, None, causal=False, scale=scale, tau=128.0, granularity="tile",
                              block_q=block_q, seq_len=384)
    _check_sound(cert, q, k, v, None, False, scale, 128.0, block_q=block_q)
    assert float(cert.certified.mean()) == 1.0  # the mean's gap is certifiable here: the tiles run the fixed loop
    keys = stabilizer.key_bounds(k, v, None, causal=False, tau=128.0, block_q=block_q, seq_len=384)
    mean = jnp.asarray(k, jnp.float32).mean(1, keepdims=True)
    np.testing.assert_allclose(np.asarray(keys.centre), np.asarray(mean), rtol=1e-5, atol=1e-6)
