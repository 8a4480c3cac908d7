"""Inputs for tests, notes and benchmarks (as numpy.testing is for numpy): the shared table of case
shapes (CASES), random inputs and packed segment ids, and inputs shaped like a pretrained LLM's attention.

RoPE (θ = 1e4 or 5e5) applied to queries and keys; a few key channels carrying large shared
offsets before RoPE (the outlier channels of KIVI/KVQuant); attention-sink keys at position 0 and
at a few other positions with 2–10× the median key norm; packed documents each starting with its
own sink; queries scaled so rows span 10–30 nats of logits.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

# The shared case table. name, batch, seq, q heads, kv heads, head dim, dtype, causal, packed
CASES = [
    ("causal_mha_d64_f32_odd", 1, 80, 2, 2, 64, jnp.float32, True, False),
    ("causal_packed_gqa4_d128_bf16", 1, 100, 8, 2, 128, jnp.bfloat16, True, True),
    ("bidir_gqa8_d64_bf16_odd", 1, 72, 16, 2, 64, jnp.bfloat16, False, False),
    ("bidir_packed_mqa_d128_f32", 1, 64, 4, 1, 128, jnp.float32, False, True),
    ("causal_mqa_d128_bf16", 1, 128, 4, 1, 128, jnp.bfloat16, True, False),
    ("causal_packed_mha_d64_bf16_b2", 2, 50, 2, 2, 64, jnp.bfloat16, True, True),
]


# The benchmarks' shapes (scripts/bench_attention.py, scripts/gpu_check.py): q heads, kv heads, head dim
# of the LLM case (Llama-3-8B's attention), and the video DiT's head dim (its head counts are a flag).
# Their --quick suites run the first of CASES above, so tests and benchmarks share one table.
LLM_HEADS = (32, 8, 128)
DIT_HEAD_DIM = 128


def random_inputs(seed, batch, seq, hq, hkv, d, dtype, *, key_offset=0.5):
  """q, k, v, dout; keys share a common component, as in trained models."""
  kq, kk, kv, kd, kc = jax.random.split(jax.random.PRNGKey(seed), 5)
  q = jax.random.normal(kq, (batch, seq, hq, d))
  k = jax.random.normal(kk, (batch, seq, hkv, d)) + key_offset * jax.random.normal(kc, (1, 1, hkv, d))
  v = jax.random.normal(kv, (batch, seq, hkv, d))
  do = jax.random.normal(kd, (batch, seq, hq, d))
  return [x.astype(dtype) for x in (q, k, v, do)]


def packed_segments(seed, batch, seq):
  """Three or four documents per row, ids starting at 1, and a padded (id 0) tail."""
  rng = np.random.default_rng(seed)
  rows = []
  for _ in range(batch):
    cuts = np.sort(rng.choice(np.arange(2, seq - 4), 3, replace=False))
    ids = np.searchsorted(cuts, np.arange(seq), side="right") + 1
    ids[-3:] = 0
    rows.append(ids)
  return jnp.asarray(np.stack(rows), jnp.int32)


def short_documents(seed, batch, seq, mean_len):
  """Packed rows of many short documents (lengths 1 to 2·mean_len, ids 1, 2, ...) and a padded (id 0) tail."""
  rng = np.random.default_rng(seed)
  rows = []
  for _ in range(batch):
    lengths = rng.integers(1, 2 * mean_len, size=seq)
    ids = np.repeat(np.arange(1, seq + 1), lengths)[:seq]
    ids[seq - rng.integers(1, 40):] = 0
    rows.append(ids)
  return jnp.asarray(np.stack(rows), jnp.int32)


def documents_left_out(run, ranges: bool, dtype=jnp.float32):
  """Two documents of 128 tokens, and NaNs that reach a result only through block pairs where the documents do
  not meet (0 · NaN is NaN, so a loop that visits such a block, even masked, returns NaN there): V of the first
  document for the second's output and dQ, dO of the second for the first's dK and dV. run(q, k, v, seg, ranges)
  is the attention call; returns whether each of the four results came out finite."""
  q, k, v, do = random_inputs(7, 1, 256, 4, 2, 64, dtype)
  seg = jnp.asarray([[1] * 128 + [2] * 128], jnp.int32)
  f = lambda q, k, v: run(q, k, v, seg, ranges)
  out, vjp = jax.vjp(f, q, k, v.at[:, :128].set(jnp.nan))
  dq = vjp(do)[0]
  dk, dv = jax.vjp(f, q, k, v)[1](do.at[:, 128:].set(jnp.nan))[1:]
  return [bool(jnp.isfinite(x.astype(jnp.float32)).all()) for x in (out[:, 128:], dq[:, 128:], dk[:, :128],
                                                                      dv[:, :128])]


FAMILIES = ("sink0", "sinks_many", "outlier_channels", "rope_5e5_wide", "packed_sinks")


def rope(x, theta):
  d = x.shape[-1]
  freq = theta ** (-jnp.arange(0, d, 2) / d)
  angle = jnp.arange(x.shape[1])[:, None] * freq[None, :]
  cos, sin = jnp.cos(angle)[None, :, None, :], jnp.sin(angle)[None, :, None, :]
  x1, x2 = x[..., ::2], x[..., 1::2]
  return jnp.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).reshape(x.shape)


def inputs(family, batch, seq, hq, hkv, d, *, seed=0, dtype=jnp.bfloat16):
  """(q, k, v, do, segment_ids or None) of one family."""
  kq, kk, kv, kd, ko = jax.random.split(jax.random.PRNGKey(seed), 5)
  q = jax.random.normal(kq, (batch, seq, hq, d))
  k = jax.random.normal(kk, (batch, seq, hkv, d))
  v = jax.random.normal(kv, (batch, seq, hkv, d))
  do = jax.random.normal(kd, (batch, seq, hq, d))
  theta = 5e5 if family == "rope_5e5_wide" else 1e4
  offsets = jnp.zeros((d,)).at[jax.random.choice(ko, d, (4,), replace=False)].set(
      8.0 if family in ("outlier_channels", "rope_5e5_wide") else 3.0)
  k = rope(k + offsets, theta)
  q = rope(q * (3.5 if family == "rope_5e5_wide" else 2.5), theta)  # spreads ~20-30 nats
  median = jnp.median(jnp.linalg.norm(k, axis=-1))
  seg = None
  sinks = {"sink0": [(0, 4.0)], "sinks_many": [(0, 10.0), (seq // 3, 2.0), (seq // 2, 5.0), (seq - 7, 3.0)],
           "outlier_channels": [(0, 3.0)], "rope_5e5_wide": [(0, 6.0)], "packed_sinks": []}[family]
  if family == "packed_sinks":
    starts = [0, seq // 5, seq // 2, (3 * seq) // 4]
    ids = np.searchsorted(np.asarray(starts[1:]), np.arange(seq), side="right") + 1
    ids[-3:] = 0
    seg = jnp.asarray(np.tile(ids, (batch, 1)), jnp.int32)
    sinks = [(s, 5.0) for s in starts]
  for position, factor in sinks:
    k = k.at[:, position].set(factor * median * k[:, position] / jnp.linalg.norm(k[:, position], axis=-1, keepdims=True))
  return [x.astype(dtype) for x in (q, k, v, do)] + [seg]


def hull_escaping(batch, seq, hq, hkv, d, *, magnitude, run=128, seed=0, dtype=jnp.bfloat16):
  """(q, k, v, do): keys in runs of `run` positions cycling through three orthogonal clusters (e_0, e_1, e_2,
  each with a little noise) and queries pointing away from all three, with logits q·k/√d near −magnitude.

  The coordinate-wise median of the means of key blocks of at most `run` keys is then ~0, outside the keys'
  convex hull, so q·median lies far above every logit: a bidirectional lower bound q·c needs c to be a mean of
  the keys instead (stabilizer.py), or a certified tile's weights all flush to zero at 16-bit precision.
  """
  kq, kk, kv, kd = jax.random.split(jax.random.PRNGKey(seed), 4)
  cluster = (jnp.arange(seq) // run) % 3
  k = jax.nn.one_hot(cluster, d)[None, :, None, :] + 0.02 * jax.random.normal(kk, (batch, seq, hkv, d))
  away = -magnitude * d ** 0.5 * (jnp.arange(d) < 3)
  q = away * (1.0 + 0.1 * jax.random.normal(kq, (batch, seq, hq, d)))
  v = jax.random.normal(kv, (batch, seq, hkv, d))
  do = jax.random.normal(kd, (batch, seq, hq, d))
  return [x.astype(dtype) for x in (q, k, v, do)]


def _lower_for(device_kind, num_cores, platform, lowering_platform):
  def lower(fn, *args):
    device = jax.sharding.AbstractDevice(device_kind=device_kind, num_cores=num_cores, platform=platform)
    mesh = jax.sharding.AbstractMesh((1,), ("x",), (jax.sharding.AxisType.Explicit,), abstract_device=device)
    with jax.sharding.use_abstract_mesh(mesh):
      return jax.jit(fn).trace(*args).lower(lowering_platforms=(lowering_platform,)).as_text()
  return lower


# lower_for_h200(fn, *args): lowered text for an H200 on a machine with no GPU (Pallas's Triton and
# Mosaic GPU backends both lower in Python), so ops a GPU backend cannot lower fail in CI.
lower_for_h200 = _lower_for("NVIDIA H200", 132, "gpu", "cuda")
# lower_for_tpu(fn, *args): the same for a TPU v5e (Mosaic TPU's lowering runs in Python and checks
# block shapes and layouts; the compiler's own checks still need a TPU).
lower_for_tpu = _lower_for("TPU v5 lite", 1, "tpu", "tpu")
