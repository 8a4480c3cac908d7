"""Inputs shaped like a pretrained LLM's attention, for tests and benchmarks (as numpy.testing is for numpy).

RoPE (θ = 1e4 or 5e5) applied to queries and keys; a few key channels carrying large shared
offsets before RoPE (the outlier channels of KIVI/KVQuant); attention-sink keys at position 0 and
at a few other positions with 2–10× the median key norm; packed documents each starting with its
own sink; queries scaled so rows span 10–30 nats of logits.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

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
