"""attention=clis inside the real MaxText package (0.2.5): its AttentionOp, our kernels, its dot_product as the reference."""

from __future__ import annotations

import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.linen import partitioning

from clis_kernels import reference_f64 as ref

maxtext = pytest.importorskip("maxtext", reason="the maxtext extra is not installed (scripts/setup.sh installs it)")
from clis_train.integrations import maxtext as clis_maxtext  # noqa: E402
from maxtext.common import common_types  # noqa: E402
from maxtext.configs import pyconfig  # noqa: E402
from maxtext.layers import attention_op  # noqa: E402

pytestmark = pytest.mark.maxtext

B, S, HQ, HKV, D = 2, 96, 4, 2, 64


@pytest.fixture(scope="module")
def config():
  base = os.path.join(os.path.dirname(maxtext.__file__), "configs", "base.yml")
  return pyconfig.initialize([None, base, "run_name=clis_test", "attention=clis", "skip_jax_distributed_system=true",
                              "enable_checkpointing=false", "hardware=cpu", f"max_target_length={S}",
                              f"base_num_query_heads={HQ}", f"base_num_kv_heads={HKV}", f"head_dim={D}"])


def _mesh(config, **sizes):
  shape = [sizes.get(axis, 1) for axis in config.mesh_axes]
  return jax.sharding.Mesh(np.array(jax.devices()[:int(np.prod(shape))]).reshape(shape), config.mesh_axes)


def _inputs():
  ks = jax.random.split(jax.random.PRNGKey(0), 4)
  q = jax.random.normal(ks[0], (B, S, HQ, D)) * D ** -0.5  # MaxText hands the op a pre-scaled query
  k = jax.random.normal(ks[1], (B, S, HKV, D)) + 0.5 * jax.random.normal(ks[3], (1, 1, HKV, D))
  v = jax.random.normal(ks[2], (B, S, HKV, D))
  seg = jnp.asarray([[1] * 40 + [2] * 50 + [0] * 6, [1] * 96], jnp.int32)  # packed, with a padded tail
  return q, k, v, seg


def _run(config, mesh, kernel, q, k, v, seg, jit=False, **kw):
  """MaxText's AttentionOp built as its Attention layer builds it, value and vjp (jit: of the jitted call)."""
  clis_maxtext.install()
  op = attention_op.AttentionOp(config=config, mesh=mesh, attention_kernel=kernel, max_target_length=S,
                                num_query_heads=HQ, num_kv_heads=HKV, dtype=jnp.float32, **kw)
  call = lambda q, k, v: op(q, k, v, seg, None, common_types.MODEL_MODE_TRAIN)
  with mesh, partitioning.axis_rules(config.logical_axis_rules):
    return jax.vjp(jax.jit(call) if jit else call, q, k, v)


@pytest.mark.parametrize("kernel", ["clis", "clis_online"])
@pytest.mark.parametrize("layout", [{}, {"data": 2, "tensor": 2}], ids=["1dev", "data2_tensor2"])
def test_matches_maxtext_dot_product_with_packed_segments(config, kernel, layout):
  q, k, v, seg = _inputs()
  mesh = _mesh(config, **layout)
  real = (seg != 0)[:, :, None, None]  # MaxText lets padding rows attend among padding; we return 0 there
  do = jnp.where(real, jax.random.normal(jax.random.PRNGKey(9), q.shape), 0.0)
  out, vjp = _run(config, mesh, kernel, q, k, v, seg)
  want_out, want_vjp = _run(config, mesh, "dot_product", q, k, v, seg)
  assert not np.array_equal(np.asarray(out), np.asarray(want_out))  # our kernel ran, not MaxText's dot_product
  assert ref.rel_err(jnp.where(real, out, 0), jnp.where(real, want_out, 0)) < 2e-5
  for got, want in zip(vjp(do), want_vjp(do)):
    assert ref.rel_err(got, want) < 5e-5
  exact = ref.attention(q, k, v, do, seg, causal=True, scale=1.0)[0]  # and both against float64
  assert ref.rel_err(jnp.where(real, out, 0), exact) < 2e-5


@pytest.mark.parametrize("strategy,value_dim", [("ring", D), ("all_gather", D), ("ring", 32)],
                         ids=["ring", "all_gather", "ring_mla"])
def test_context_parallelism_matches_one_device(config, strategy, value_dim):
  """MaxText's context axis (length sharded two ways, its load-balanced dual-chunk-swap order): the adapter runs
  clis_kernels.context_parallel, and the result in natural order equals MaxText's dot_product on one device; with
  MLA's value head dim too (v 32 where q·k is 64)."""
  from maxtext.utils import max_utils
  q, k, v, seg = _inputs()
  v = v[..., :value_dim]
  cp_config = pyconfig.initialize([None, os.path.join(os.path.dirname(maxtext.__file__), "configs", "base.yml"),
                                   "run_name=clis_test", "attention=clis", "skip_jax_distributed_system=true",
                                   "enable_checkpointing=false", f"max_target_length={S}",
                                   f"base_num_query_heads={HQ}", f"base_num_kv_heads={HKV}", f"head_dim={D}",
                                   # MaxText's config takes the ring strategy on GPUs only
                                   f"hardware={'gpu' if strategy == 'ring' else 'cpu'}",
                                   "ici_context_parallelism=2", f"context_parallel_strategy={strategy}"])
  mesh = _mesh(cp_config, context=2, data=2)
  order = lambda x: max_utils.reorder_sequence(x, cp_size=2, seq_dim=1)
  natural = lambda x: max_utils.reorder_sequence(x, cp_size=2, seq_dim=1, to_contiguous=True)
  real = (seg != 0)[:, :, None, None]
  do = jnp.where(real, jax.random.normal(jax.random.PRNGKey(9), q.shape[:3] + (value_dim,)), 0.0)
  out, vjp = _run(cp_config, mesh, "clis", *map(order, (q, k, v, seg)), jit=True)
  want_out, want_vjp = _run(config, _mesh(config), "dot_product", q, k, v, seg)
  assert ref.rel_err(jnp.where(real, natural(out), 0), jnp.where(real, want_out, 0)) < 2e-5
  for got, want in zip(vjp(order(do)), want_vjp(do)):
    assert ref.rel_err(natural(got), want) < 5e-5


def test_bidirectional_full_attention(config):
  q, k, v, seg = _inputs()
  mesh = _mesh(config)
  kw = dict(attention_type=common_types.AttentionType.FULL)
  out, _ = _run(config, mesh, "clis", q, k, v, None, **kw)
  want, _ = _run(config, mesh, "dot_product", q, k, v, None, **kw)
  assert ref.rel_err(out, want) < 2e-5


@pytest.mark.parametrize("what", ["sliding_window", "soft_cap", "both"])
def test_sliding_window_and_soft_cap_match_maxtext_dot_product(config, what):
  """LOCAL_SLIDING (MaxText's causal window i − W < j <= i) and attn_logits_soft_cap run on our kernels."""
  q, k, v, seg = _inputs()
  q = q * 8.0  # logits large enough for the cap to matter
  mesh = _mesh(config)
  kw = {}
  if what in ("sliding_window", "both"):
    kw.update(attention_type=common_types.AttentionType.LOCAL_SLIDING, sliding_window_size=24)
  if what in ("soft_cap", "both"):
    kw.update(attn_logits_soft_cap=5.0)
  real = (seg != 0)[:, :, None, None]
  do = jnp.where(real, jax.random.normal(jax.random.PRNGKey(3), q.shape), 0.0)
  out, vjp = _run(config, mesh, "clis", q, k, v, seg, **kw)
  want_out, want_vjp = _run(config, mesh, "dot_product", q, k, v, seg, **kw)
  assert ref.rel_err(jnp.where(real, out, 0), jnp.where(real, want_out, 0)) < 2e-5
  for got, want in zip(vjp(do), want_vjp(do)):
    assert ref.rel_err(got, want) < 5e-5
  window = (23, 0) if what != "soft_cap" else None
  exact = ref.attention(q, k, v, do, seg, causal=True, scale=1.0, window=window,
                        softcap=5.0 if what != "sliding_window" else None)[0]
  assert ref.rel_err(jnp.where(real, out, 0), exact) < 2e-5


@pytest.mark.parametrize("layout", [{}, {"data": 2, "tensor": 2}], ids=["1dev", "data2_tensor2"])
def test_learned_sinks_match_maxtext_dot_product(config, layout):
  """gpt-oss's sinks: one logit per query head in the softmax's denominator; output and gradients (the sinks'
  too) equal MaxText's dot_product on packed inputs, on one device and on a 2x2 (data, tensor) mesh."""
  q, k, v, seg = _inputs()
  sinks = jnp.asarray([1.5, -0.5, 3.0, 0.0], jnp.float32)
  real = (seg != 0)[..., None, None]  # MaxText lets padding rows attend among padding; we return 0 there
  do = jnp.where(real, jax.random.normal(jax.random.PRNGKey(7), q.shape), 0.0)
  mesh = _mesh(config, **layout)
  results = {}
  for kernel in ("clis", "dot_product"):
    clis_maxtext.install()
    op = attention_op.AttentionOp(config=config, mesh=mesh, attention_kernel=kernel, max_target_length=S,
                                  num_query_heads=HQ, num_kv_heads=HKV, dtype=jnp.float32)
    with mesh, partitioning.axis_rules(config.logical_axis_rules):
      out, vjp = jax.vjp(lambda q, k, v, s: op(q, k, v, seg, None, common_types.MODEL_MODE_TRAIN, sinks=s),
                         q, k, v, sinks)
      results[kernel] = (out, *vjp(do))
  for got, want, name in zip(results["clis"], results["dot_product"], ("out", "dq", "dk", "dv", "dsinks")):
    if name == "out":
      got, want = jnp.where(real, got, 0), jnp.where(real, want, 0)
    assert ref.rel_err(got, want) < 5e-5, name


def test_mla_value_head_dim_matches_maxtext_dot_product(config):
  """MLA's shapes (DeepSeek V3: q·k head dim 192, v 128; here 64 and 32): output [B, S, H, 32] and gradients equal
  MaxText's dot_product on packed inputs."""
  q, k, v, seg = _inputs()
  v = v[..., :32]
  real = (seg != 0)[..., None, None]
  do = jnp.where(real, jax.random.normal(jax.random.PRNGKey(8), q.shape[:3] + (32,)), 0.0)
  out, vjp = _run(config, _mesh(config), "clis", q, k, v, seg)
  want, want_vjp = _run(config, _mesh(config), "dot_product", q, k, v, seg)
  assert out.shape == want.shape == q.shape[:3] + (32,)
  assert ref.rel_err(jnp.where(real, out, 0), jnp.where(real, want, 0)) < 2e-5
  for got, exp in zip(vjp(do), want_vjp(do)):
    assert ref.rel_err(got, exp) < 5e-5


@pytest.mark.parametrize("what", ["decode"])
def test_unsupported_modes_fail_clearly(config, what):
  clis_maxtext.install()
  q, k, v, seg = _inputs()
  mesh = _mesh(config)
  op = attention_op.AttentionOp(config=config, mesh=mesh, attention_kernel="clis", max_target_length=S,
                                num_query_heads=HQ, num_kv_heads=HKV, dtype=jnp.float32)
  mode = common_types.MODEL_MODE_AUTOREGRESSIVE if what == "decode" else common_types.MODEL_MODE_TRAIN
  call_kw = {}
  with mesh, partitioning.axis_rules(config.logical_axis_rules), pytest.raises(NotImplementedError, match="clis"):
    op.apply_attention(q, k, v, seg, None, None, mode, qk_product_einsum=jnp.einsum, wv_product_einsum=jnp.einsum,
                       **call_kw)


def test_install_is_idempotent_and_leaves_other_kernels_alone(config):
  clis_maxtext.install()
  first = attention_op.AttentionOp.apply_attention
  clis_maxtext.install()
  assert attention_op.AttentionOp.apply_attention is first
  q, k, v, seg = _inputs()
  out, _ = _run(config, _mesh(config), "dot_product", q, k, v, seg)
  assert out.shape == q.shape


def test_launcher_installs_then_runs_the_module_as_main(tmp_path):
  """`python -m clis_train.integrations.maxtext MODULE ARGS` patches MaxText before MODULE runs."""
  import subprocess
  import sys
  (tmp_path / "fake_maxtext_entry.py").write_text(
      "import sys\n"
      "from maxtext.layers import attention_op\n"
      "if __name__ == '__main__':\n"
      "  assert getattr(attention_op.AttentionOp.apply_attention, '_clis_installed', False)\n"
      "  open(sys.argv[2], 'w').write(' '.join(sys.argv[1:]))\n")
  marker = tmp_path / "ran.txt"
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
  subprocess.run([sys.executable, "-m", "clis_train.integrations.maxtext", "fake_maxtext_entry", "attention=clis",
                  str(marker)], env=env, check=True, capture_output=True, text=True)
  assert marker.read_text() == f"attention=clis {marker}"


TINY_MODEL = ["skip_jax_distributed_system=true", "per_device_batch_size=1", "max_target_length=256",
              "base_emb_dim=128", "base_num_query_heads=4", "base_num_kv_heads=2", "base_mlp_dim=256",
              "base_num_decoder_layers=2", "head_dim=64", "vocab_size=512"]


def test_maxtext_train_loop_with_clis_matches_dot_product(tmp_path):
  """MaxText's own train loop (maxtext.trainers.pre_train.train, synthetic data) through scripts/bench_maxtext.py:
  attention=clis runs our kernel (its log line), trains, and its losses follow dot_product's within bf16 noise
  (activations are bf16; measured on the CPU: 0.001)."""
  import importlib.util
  spec = importlib.util.spec_from_file_location("bench_maxtext", pathlib.Path(__file__).parents[1] / "scripts" /
                                                "bench_maxtext.py")
  bench = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(bench)
  out = tmp_path / "maxtext.json"
  result = bench.main(["--variants", "clis", "dot_product", "--steps", "4", "--skip", "1", "--out", str(out),
                       *TINY_MODEL])
  runs = {r["variant"]: r for r in result["variants"]}
  assert all(r["returncode"] == 0 and len(r["steps"]) == 4 for r in runs.values()), runs
  assert runs["clis"]["clis_calls_logged"] >= 1 and runs["dot_product"]["clis_calls_logged"] == 0
  assert result["summary"]["max_abs_dloss_vs_dot_product"]["clis"] < 0.02, result["summary"]
  losses = [s["loss"] for s in runs["clis"]["steps"]]
  assert losses[-1] < losses[0]  # it trains
  assert out.with_suffix(".md").exists() and out.with_suffix(".png").exists()
