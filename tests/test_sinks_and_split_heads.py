"""Learned sink logits (gpt-oss) and a value head dim other than the q·k one (MLA) on every CPU-runnable backend,
forward and gradients against float64."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from clis_kernels import attention, pallas_gpu, pallas_tpu
from clis_kernels.plan import Platform

BACKENDS = {
    "reference": dict(implementation="reference"),
    "xla": dict(implementation="xla"),
    "pallas_gpu": dict(implementation="pallas_gpu", interpret=True, block_sizes=pallas_gpu.BlockSizes(32, 32)),
    "pallas_tpu": dict(implementation="pallas_tpu", interpret=True, platform=Platform("tpu"),
                       block_sizes=pallas_tpu.BlockSizes(32, 32, 32, 32, 32, 32)),
}


def _dense(q, k, v, seg, sinks, causal):
  """Softmax over each row's visible keys plus its head's sink logit (a column with no value); sinks None: none."""
  b, s, hq, d = q.shape
  group = hq // k.shape[2]
  kk, vv = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
  logits = jnp.einsum("bqhd,bkhd->bhqk", q, kk) / np.sqrt(d)
  visible = jnp.ones((b, 1, s, kk.shape[1]), bool)
  if causal:
    visible &= jnp.tril(jnp.ones((s, kk.shape[1]), bool))[None, None]
  if seg is not None:
    sg = jnp.asarray(seg)
    visible &= (sg[:, None, :, None] == sg[:, None, None, :]) & (sg[:, None, :, None] != 0)
  logits = jnp.where(visible, logits, -jnp.inf)
  column = jnp.full((hq,), -jnp.inf, logits.dtype) if sinks is None else sinks
  full = jnp.concatenate([logits, jnp.broadcast_to(column[None, :, None, None], (b, hq, s, 1))], axis=-1)
  top = jnp.max(full, axis=-1, keepdims=True)
  p = jnp.exp(full - jnp.where(jnp.isfinite(top), top, 0.0))
  p = p / jnp.maximum(p.sum(-1, keepdims=True), 1e-300)
  return jnp.einsum("bhqk,bkhd->bqhd", p[..., :-1], vv)


def _x64(*xs):
  return [None if x is None else jnp.asarray(np.asarray(x, np.float64)) for x in xs]


def dense64(q, k, v, seg, sinks, *, causal):
  """The output in float64."""
  with jax.enable_x64(True):
    return np.asarray(_dense(*_x64(q, k, v), seg, *_x64(sinks), causal))


def grads64(q, k, v, seg, sinks, do, *, causal):
  """float64 gradients (dq, dk, dv, dsinks) of Σ out·do."""
  with jax.enable_x64(True):
    q, k, v, sinks, do = _x64(q, k, v, sinks, do)
    return jax.grad(lambda *a: jnp.sum(_dense(*a[:3], seg, a[3], causal) * do), argnums=(0, 1, 2, 3))(q, k, v, sinks)


def rel(got, want):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def inputs(seed, b, s, hq, hkv, d, dv=None, dtype=jnp.float32):
  ks = jax.random.split(jax.random.PRNGKey(seed), 5)
  q = jax.random.normal(ks[0], (b, s, hq, d), dtype)
  k = jax.random.normal(ks[1], (b, s, hkv, d), dtype)
  v = jax.random.normal(ks[2], (b, s, hkv, dv or d), dtype)
  do = jax.random.normal(ks[3], (b, s, hq, dv or d), dtype)
  sinks = 2.0 * jax.random.normal(ks[4], (hq,), jnp.float32)
  return q, k, v, do, sinks


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("causal,packed", [(True, False), (False, False), (True, True)])
def test_learned_sinks_match_float64(backend, causal, packed):
  q, k, v, do, sinks = inputs(0, 2, 96, 4, 2, 64)
  seg = jnp.asarray(np.repeat([[1] * 40 + [2] * 50 + [0] * 6], 2, axis=0), jnp.int32) if packed else None
  run = lambda q, k, v, sinks: attention(q, k, v, seg, causal=causal, sinks=sinks, **BACKENDS[backend])
  out, vjp = jax.vjp(run, q, k, v, sinks)
  want = dense64(q, k, v, seg, sinks, causal=causal)
  assert rel(out, want) < 1e-5
  got = vjp(do)
  for g, w, name in zip(got, grads64(q, k, v, seg, sinks, do, causal=causal), ("dq", "dk", "dv", "dsinks")):
    assert rel(g, w) < 1e-4, (name, rel(g, w))
  if packed:  # padding rows see nothing: zero output, no gradient into the sinks from them
    np.testing.assert_array_equal(np.asarray(out[:, 90:]), 0.0)


def test_sinks_change_the_output_and_none_is_the_plain_call():
  q, k, v, _, sinks = inputs(1, 1, 64, 4, 4, 64)
  plain = attention(q, k, v, implementation="reference")
  np.testing.assert_array_equal(np.asarray(attention(q, k, v, implementation="reference", sinks=None)),
                                np.asarray(plain))
  with_sinks = attention(q, k, v, implementation="reference", sinks=sinks)
  assert rel(with_sinks, plain) > 1e-2  # a sink takes weight from every row
  very_negative = attention(q, k, v, implementation="reference", sinks=jnp.full((4,), -1e4))
  assert rel(very_negative, plain) < 1e-6  # a sink of weight e^-10000 takes nothing


def test_sinks_with_the_certificate_on_bf16_inputs_stay_as_accurate_as_online():
  q, k, v, do, sinks = inputs(2, 1, 128, 4, 2, 64, dtype=jnp.bfloat16)
  want = dense64(q, k, v, None, sinks, causal=True)
  errs = {}
  for stabilizer in ("clis", "online"):
    out, stats = attention(q, k, v, sinks=sinks, stabilizer=stabilizer, return_stats=True, **BACKENDS["pallas_gpu"])
    errs[stabilizer] = rel(out, want)
  assert errs["clis"] <= 1.25 * errs["online"] + 1e-6 and errs["clis"] < 1e-2, errs


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("dv", [32, 128])
def test_value_head_dim_other_than_the_qk_one(backend, dv):
  """MLA's shapes (q·k head dim 192 with v 128 in DeepSeek V3; here 64 with v 32 or 128): the output has v's head
  dim, the scale is q's (1/√64), forward and gradients against float64."""
  q, k, v, do, _ = inputs(3, 1, 64, 4, 2, 64, dv=dv)
  out, vjp = jax.vjp(lambda q, k, v: attention(q, k, v, causal=True, **BACKENDS[backend]), q, k, v)
  assert out.shape == (1, 64, 4, dv)
  assert rel(out, dense64(q, k, v, None, None, causal=True)) < 1e-5
  for g, w in zip(vjp(do), grads64(q, k, v, None, jnp.full((4,), -1e4), do, causal=True)[:3]):
    assert rel(g, w) < 1e-4


def test_bad_sinks_and_value_shapes_get_one_clear_error():
  q, k, v, _, _ = inputs(4, 1, 32, 4, 2, 64)
  with pytest.raises(ValueError, match=r"sinks must be \[Hq\]=\[4\] logits"):
    attention(q, k, v, sinks=jnp.zeros((2,)))
  with pytest.raises(ValueError, match="v must have k's batch, length and heads"):
    attention(q, k, v[:, :16])


@pytest.mark.gpu
@pytest.mark.skipif(jax.devices()[0].platform != "gpu", reason="the Mosaic GPU kernels run on an NVIDIA Hopper GPU")
@pytest.mark.parametrize("causal,packed", [(True, False), (False, False), (True, True)])
def test_learned_sinks_on_the_mosaic_gpu_kernels_match_float64(causal, packed):
  """gpt-oss's sinks (GQA 8/2 at head dim 64, bf16) through the Mosaic GPU forward and backward, online and
  certified: o, dq, dk, dv and dsinks against float64, the certified path within 1.25x the online path's error."""
  b, s = 2, 1024
  q, k, v, do, sinks = inputs(5, b, s, 8, 2, 64, dtype=jnp.bfloat16)
  seg = jnp.asarray(np.repeat([[1] * 400 + [2] * 600 + [0] * 24], b, axis=0), jnp.int32) if packed else None
  want = (dense64(q, k, v, seg, sinks, causal=causal), *grads64(q, k, v, seg, sinks, do, causal=causal))
  errs = {}
  for stabilizer in ("online", "clis"):
    run = lambda q, k, v, sinks: attention(q, k, v, seg, causal=causal, sinks=sinks, stabilizer=stabilizer,
                                           implementation="pallas_mgpu")
    out, vjp = jax.vjp(run, q, k, v, sinks)
    errs[stabilizer] = [rel(g, w) for g, w in zip((out, *vjp(do)), want)]
  assert max(errs["online"][:1]) < 1e-2 and max(errs["online"][1:]) < 2e-2, errs
  assert all(c <= 1.25 * o + 1e-6 for c, o in zip(errs["clis"], errs["online"])), errs
