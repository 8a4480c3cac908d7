"""Case families of other projects' attention tests, in our API's terms (small shapes for interpret mode).

Read from (and written anew for us, not copied): tokamax's attention test base (self/cross attention,
MQA/GQA, non-power-of-two head dims, padding masks whose padded region holds NaN, f32/bf16/f16 with
atol 1e-6/1e-2/5e-4), JAX's `nn_test` (dot_product_attention: T != S, GQA, causal, dtypes), Pallas'
`gpu_ops_test` and decode tests (flash attention with segment ids; one query row against many keys),
splash attention's tests (MQA/GQA with segment ids, head dim 128) and flash-attention's
`test_flash_attn` (odd and unequal lengths such as 113 x 203 and 108 x 256, head dims 24-256, 9 query
heads over 3 or 1 kv heads, and its rule: the error against a float64-like reference may be at most
twice a plain attention's error computed in the same low-precision dtype).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from clis_kernels import reference_f64 as ref


@dataclasses.dataclass(frozen=True)
class PeerCase:
  """One case: shapes, dtype, mask kind, input distribution, and where it comes from."""

  name: str
  source: str
  batch: int
  sq: int
  sk: int
  hq: int
  hkv: int
  d: int
  dtype: object
  causal: bool = False
  packed: bool = False
  inputs: str = "normal"  # normal | uniform (flash-attention's randn ~ our normal; tokamax's uniform masks)


PEER_CASES = [
    PeerCase("tokamax_self_f32", "tokamax", 2, 64, 64, 4, 4, 64, jnp.float32),
    PeerCase("tokamax_self_bf16", "tokamax", 2, 64, 64, 4, 4, 64, jnp.bfloat16),
    PeerCase("tokamax_self_f16", "tokamax", 2, 64, 64, 4, 4, 64, jnp.float16),
    PeerCase("tokamax_cross_f32", "tokamax", 2, 64, 96, 4, 4, 64, jnp.float32),
    PeerCase("tokamax_mqa_causal_f32", "tokamax", 2, 64, 64, 4, 1, 64, jnp.float32, causal=True),
    PeerCase("tokamax_gqa4_d48_f32", "tokamax", 1, 64, 64, 16, 4, 48, jnp.float32),
    PeerCase("jax_nn_t_ne_s_bf16", "jax nn_test", 2, 24, 40, 4, 2, 32, jnp.bfloat16),
    PeerCase("jax_nn_causal_gqa_f16", "jax nn_test", 2, 40, 40, 4, 2, 32, jnp.float16, causal=True),
    PeerCase("pallas_gpu_ops_segments_bf16", "pallas gpu_ops_test", 2, 96, 96, 2, 2, 64, jnp.bfloat16,
             causal=True, packed=True),
    PeerCase("pallas_decode_one_row_f32", "pallas decode test", 2, 1, 300, 4, 1, 64, jnp.float32),
    PeerCase("splash_mqa_segments_d128_bf16", "splash", 1, 64, 64, 4, 1, 128, jnp.bfloat16, packed=True),
    PeerCase("fa_113x203_d59_bf16", "flash-attention", 1, 113, 203, 9, 3, 59, jnp.bfloat16),
    PeerCase("fa_108x256_d80_f16", "flash-attention", 1, 108, 256, 9, 1, 80, jnp.float16),
    PeerCase("fa_128x217_d24_bf16", "flash-attention", 1, 128, 217, 3, 3, 24, jnp.bfloat16),
    PeerCase("fa_causal_97_d111_bf16", "flash-attention", 1, 97, 97, 9, 9, 111, jnp.bfloat16, causal=True),
    PeerCase("fa_causal_75_d160_bf16", "flash-attention", 1, 75, 75, 9, 3, 160, jnp.bfloat16, causal=True),
    PeerCase("fa_56x120_d256_bf16", "flash-attention", 1, 56, 120, 2, 1, 256, jnp.bfloat16),
    PeerCase("fa_causal_64_d96_uniform_bf16", "flash-attention", 2, 64, 64, 4, 2, 96, jnp.bfloat16, causal=True,
             inputs="uniform"),
]

# Relative L2 error against float64 for float32 cases: (forward, gradients).
F32_TOLERANCE = (1e-5, 5e-5)
# tokamax's absolute tolerances against its f32 reference (forward; gradients get twice these).
TOKAMAX_ATOL = {jnp.float32: 1e-6, jnp.bfloat16: 1e-2, jnp.float16: 5e-4}
# flash-attention's rule for low precision: error <= FA_FACTOR x a plain attention's error in that dtype.
FA_FACTOR = 2.0


def inputs(case: PeerCase, seed: int = 0):
  """q, k, v, dout in the case's dtype."""
  kq, kk, kv, kd = jax.random.split(jax.random.PRNGKey(seed), 4)
  draw = jax.random.normal if case.inputs == "normal" else (lambda key, shape: jax.random.uniform(key, shape))
  q = draw(kq, (case.batch, case.sq, case.hq, case.d))
  k = draw(kk, (case.batch, case.sk, case.hkv, case.d))
  v = draw(kv, (case.batch, case.sk, case.hkv, case.d))
  do = draw(kd, (case.batch, case.sq, case.hq, case.d))
  return [x.astype(case.dtype) for x in (q, k, v, do)]


def segments(case: PeerCase, seed: int = 0):
  """Three or four documents per row and a padded (id 0) tail, or None."""
  if not case.packed:
    return None
  rng = np.random.default_rng(seed)
  rows = []
  for _ in range(case.batch):
    cuts = np.sort(rng.choice(np.arange(2, case.sq - 4), 3, replace=False))
    ids = np.searchsorted(cuts, np.arange(case.sq), side="right") + 1
    ids[-3:] = 0
    rows.append(ids)
  return jnp.asarray(np.stack(rows), jnp.int32)


def plain_attention(q, k, v, segment_ids, *, causal):
  """Dense softmax attention computed wholly in the inputs' dtype (flash-attention's `attention_ref`
  with upcast=False): the error budget a low-precision kernel is held to. Padding rows give 0."""
  group = q.shape[2] // k.shape[2]
  kr, vr = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
  s = jnp.einsum("bqhd,bkhd->bhqk", q * jnp.asarray(1 / np.sqrt(q.shape[-1]), q.dtype), kr,
                 preferred_element_type=q.dtype)
  mask = jnp.ones((1, 1, q.shape[1], k.shape[1]), bool)
  if causal:
    mask = mask & jnp.tril(jnp.ones((q.shape[1], k.shape[1]), bool))
  if segment_ids is not None:
    mask = mask & ((segment_ids[:, :, None] == segment_ids[:, None, :]) & (segment_ids[:, None, :] != 0))[:, None]
  s = jnp.where(mask, s, jnp.finfo(q.dtype).min)
  p = jax.nn.softmax(s, axis=-1)
  p = jnp.where(mask.any(-1, keepdims=True), p, 0)
  return jnp.einsum("bhqk,bkhd->bqhd", p, vr, preferred_element_type=q.dtype)


def check_peer_case(case: PeerCase, value_and_grads):
  """Asserts one case's forward and gradients against float64 under its suite's tolerances, for both
  stabilizers. value_and_grads(q, k, v, do, segment_ids, causal=, stabilizer=) -> (o, dq, dk, dv)."""
  q, k, v, do = inputs(case)
  seg = segments(case)
  want = ref.attention(q, k, v, do, seg, causal=case.causal)
  budget = None
  if case.dtype != jnp.float32:
    plain = jax.vjp(lambda q, k, v: plain_attention(q, k, v, seg, causal=case.causal), q, k, v)
    budget = [ref.max_abs_err(g, w) for g, w in zip((plain[0], *plain[1](do)), want)]
  for stabilizer in ("clis", "online"):
    got = value_and_grads(q, k, v, do, seg, causal=case.causal, stabilizer=stabilizer)
    assert got[0].dtype == case.dtype and got[0].shape == q.shape
    assert all(bool(jnp.isfinite(g.astype(jnp.float32)).all()) for g in got)
    errors = [ref.max_abs_err(g, w) for g, w in zip(got, want)]
    if case.source == "tokamax":  # its atol, and rtol = max(atol / 10, 1e-6), on the forward
      atol = TOKAMAX_ATOL[case.dtype]
      assert errors[0] <= atol + max(atol / 10, 1e-6) * float(np.abs(want[0]).max()), (stabilizer, errors)
    if budget is None:
      rel = [ref.rel_err(g, w) for g, w in zip(got, want)]
      assert rel[0] < F32_TOLERANCE[0] and max(rel[1:]) < F32_TOLERANCE[1], (stabilizer, rel)
      continue
    for what, err, allowed in zip(("out", "dq", "dk", "dv"), errors, budget):
      assert err <= FA_FACTOR * allowed + 1e-6, (stabilizer, what, err, allowed)
