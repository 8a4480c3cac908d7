"""The benchmark scripts run end to end (tiny, CPU) and write the promised records and reports."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import jax.numpy as jnp
import pytest

from clis_kernels.testing import CASES
from clis_train import benchmarking

ROOT = pathlib.Path(__file__).parent.parent
REQUIRED = {"case", "impl", "pass", "ms", "B", "S", "Hq", "Hkv", "D", "causal", "device", "jax_version", "repeat"}


def _run(*args, **env_extra):
  env = dict(os.environ, JAX_PLATFORMS="cpu", **env_extra)
  return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, check=True, capture_output=True, text=True)


def test_bench_attention_quick(tmp_path):
  out = tmp_path / "quick.json"
  result = _run("scripts/bench_attention.py", "--quick", "--out", str(out))
  records = json.loads(out.read_text())
  assert {(r["impl"], r["pass"]) for r in records} >= {("clis", "fwd"), ("online", "fwd_bwd"), ("xla", "fwd")}
  for r in records:
    assert REQUIRED <= set(r) and r["ms"] > 0 and r["ms_min"] <= r["ms"] <= r["ms_max"]
    assert (r["tflops"] is None) == r["impl"].endswith("prepass") and (r["tflops"] is None or r["tflops"] > 0)
  assert {("clis_prepass", "fwd"), ("clis_kernel", "fwd"), ("clis_blocks_prepass", "fwd")} <= {
      (r["impl"], r["pass"]) for r in records}
  outliers = {r["impl"]: r["certified"] for r in records if r["case"] == "quick_bidir_outlier_channels"}
  assert outliers["clis"] == 0.0 and outliers["clis_blocks"] >= 0.95  # the radius bound collapses, blocks hold
  assert {c[0] for c in CASES[:2]} < {r["case"] for r in records}  # the quick suite runs the tests' first cases
  assert f"| {CASES[0][0]} | fwd | clis |" in out.with_suffix(".md").read_text()
  assert out.with_suffix(".png").stat().st_size > 1000
  assert "cudnn skipped" in result.stdout


def test_bench_attention_with_learned_sinks(tmp_path):
  """--sinks: our implementations and the dense path run with per-head sink logits (gpt-oss) and say so."""
  out = tmp_path / "sinks.json"
  result = _run("scripts/bench_attention.py", "--quick", "--sinks", "2", "--out", str(out))
  records = json.loads(out.read_text())
  assert {r["impl"] for r in records} >= {"clis", "online", "xla"}
  assert all(r["sinks"] == 2.0 for r in records), {(r["impl"], r["sinks"]) for r in records}
  assert " fwd skipped: " not in result.stdout and " fwd_bwd skipped: " not in result.stdout  # all took the sinks


def test_bench_train_tiny(tmp_path):
  out = tmp_path / "train.json"
  context = "clis:mesh.context=2:mesh.data=1"  # an entry with its own overrides: two devices share each sequence
  _run("scripts/bench_train.py", "recipes/cpt_tiny.yaml", f"run_dir={tmp_path}", "data.seq_len=64",
       "data.per_device_batch=2", "--attentions", "clis", "online", context, "--warmup", "1", "--steps", "2",
       "--out", str(out))
  records = json.loads(out.read_text())
  assert [r["impl"] for r in records] == ["clis", "online", context]
  for r in records:
    assert REQUIRED <= set(r) and r["pass"] == "train_step" and r["tokens_per_s"] > 0 and len(r["step_loss"]) == 2
  assert records[0]["certified_fraction"] == 1.0
  assert records[2]["mesh"]["context"] == 2 and records[2]["B"] == 2


def test_bench_context_parallel_tiny(tmp_path):
  out = tmp_path / "cp.json"
  _run("scripts/bench_context_parallel.py", "--seq", "250", "--heads", "2", "1", "16", "--context", "2",
       "--implementation", "reference", "--repeats", "1", "--inner", "1", "--strategies", "ring", "--out", str(out))
  records = json.loads(out.read_text())
  assert {(r["impl"], r["pass"]) for r in records} == {(i, p) for i in ("one_device", "ring_clis", "ring_online")
                                                        for p in ("fwd", "fwd_bwd")}
  for r in records:
    assert REQUIRED <= set(r) and r["ms"] > 0 and r["scaling_efficiency"] > 0
  assert {r["impl"]: r["certified"] for r in records}["ring_online"] == 0.0


def test_bench_diffusion_quick(tmp_path):
  out = tmp_path / "diffusion.json"
  _run("-m", "scripts.bench_diffusion", "--quick", "--out", str(out))
  records = json.loads(out.read_text())
  assert {r["impl"] for r in records} == {"xla", "clis", "clis_skip[-10000:-10000]", "clis_skip[-6:-2]",
                                          "clis_skip[cal 0.01]"}
  calibrated = next(r for r in records if r["impl"] == "clis_skip[cal 0.01]")
  assert all(len(s["layer_thrs"]) == 2 for s in calibrated["per_step"][1:])  # one thr per layer per step
  assert all(len(s["layer_sparsity"]) == 2 for s in calibrated["per_step"])  # and a sparsity per layer
  twin = next(r for r in records if r["impl"] == "clis_skip[-10000:-10000]")
  assert twin["mean_sparsity"] == 0 and "psnr_vs_unskipped_db" not in twin  # the twin marks nothing
  assert all("psnr_vs_unskipped_db" in r for r in records if r["impl"].startswith("clis_skip[-6"))
  for r in records:
    assert {"step_ms", "attention_ms", "mean_sparsity", "psnr_db", "ssim", "per_step", "device", "date"} <= set(r)
    assert len(r["per_step"]) == r["steps"] and all(s["attention_ms"] > 0 for s in r["per_step"])
  clis = next(r for r in records if r["impl"] == "clis")
  assert clis["psnr_db"] > 40 and clis["ssim"] > 0.99  # CLiS matches dense XLA on the same noise
  for suffix in (".md", ".png"):
    assert out.with_suffix(suffix).exists()
  assert (tmp_path / "diffusion_strip.png").exists()


def test_multi_gpu_check_on_two_cpu_devices(tmp_path):
  """The mesh-layout check runs 1-device, 2-way data and 2-way tensor layouts and finds the same losses."""
  out = tmp_path / "multi.json"
  _run("scripts/multi_gpu_check.py", "recipes/cpt_tiny.yaml", f"run_dir={tmp_path}", "data.seq_len=64", "--steps", "3",
       "--out", str(out), XLA_FLAGS="--xla_force_host_platform_device_count=2")
  records = {r["impl"]: r for r in json.loads(out.read_text())}
  assert set(records) == {"clis|1dev", "online|1dev", "clis|data2", "clis|tensor2"}
  assert records["clis|data2"]["devices"] == 2 and records["clis|tensor2"]["mesh"]["tensor"] == 2
  for name in ("clis|data2", "clis|tensor2"):
    assert records[name]["max_abs_loss_diff_vs_1dev"] < 1e-3  # same global batch, same steps
    assert records[name]["B"] == records["clis|1dev"]["B"]


def test_bench_skipping_quick(tmp_path):
  out = tmp_path / "skipping.json"
  _run("scripts/bench_skipping.py", "--quick", "--fractions", "0", "0.5", "--out", str(out))
  records = json.loads(out.read_text())
  assert {r["impl"] for r in records} == {"clis", "online", "triton_skip@0.00", "triton_skip_track@0.00",
                                          "triton_skip@0.50", "triton_skip_track@0.50"}
  for r in records:
    assert REQUIRED <= set(r) and r["ms"] > 0 and r["ms_min"] <= r["ms"] <= r["ms_max"]
    assert (r["vs_unskipped"] is None) == ("@" not in r["impl"])
  assert next(r for r in records if r["impl"] == "triton_skip@0.00")["vs_unskipped"] == 1.0
  assert out.with_suffix(".png").stat().st_size > 1000


def test_bench_skipping_rejects_a_fraction_of_one():
  result = subprocess.run([sys.executable, "scripts/bench_skipping.py", "--quick", "--fractions", "1.0"], cwd=ROOT,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True)
  assert result.returncode != 0 and "--fractions=[1.0] must each be in [0, 1)" in result.stderr


def test_bench_skip_rule_quick(tmp_path):
  """Marks from the rule itself, bisected on thr to the target fraction; the skipped call stays close to dense."""
  out = tmp_path / "rule.json"
  result = _run("scripts/bench_skip_rule.py", "--quick", "--out", str(out))
  records = json.loads(out.read_text())
  assert {r["impl"] for r in records} == {"clis", "skip@rule", "skip_track@rule"}
  rule = next(r for r in records if r["impl"] == "skip@rule")
  assert abs(rule["skipped"] - 0.42) < 0.05 and rule["thr"] < -1 and rule["rel_l1_vs_dense"] < 1e-3
  for r in records:
    assert REQUIRED <= set(r) and r["ms"] > 0 and r["ms_min"] <= r["ms"] <= r["ms_max"]
  assert "marks 0.4" in result.stdout


def test_profile_backward_names_each_kernel_order():
  """scripts/profile_backward.py --overlap times each backward kernel in every step order under a name that says it
  (the device runs' tables read these names): serial, overlapped (dV with dK), and dV behind dP in each."""
  import dataclasses
  import importlib.util

  from clis_kernels import pallas_mgpu_vjp
  spec = importlib.util.spec_from_file_location("profile_backward", ROOT / "scripts" / "profile_backward.py")
  script = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(script)
  bs = pallas_mgpu_vjp.BlockSizes(overlap_dq=True)
  flags = lambda t: (t.overlap_dq, t.overlap_dkv, t.dv_with_dp)
  got = {name: (method, flags(t)) for name, (method, t) in script.kernel_parts(bs, fused=False, overlap=True).items()}
  assert got == {
      "dq_kernel": ("dq", (False, False, False)), "dkv_kernel": ("dkv", (False, False, False)),
      "dkv_kernel_dv_with_dp": ("dkv", (False, False, True)),
      "dq_kernel_overlap": ("dq", (True, True, False)), "dkv_kernel_overlap": ("dkv", (True, True, False)),
      "dkv_kernel_overlap_dv_with_dp": ("dkv", (True, True, True))}
  assert {n: flags(t) for n, (_, t) in script.kernel_parts(bs, fused=False, overlap=False).items()} == {
      "dq_kernel": flags(bs), "dkv_kernel": flags(bs)}
  fused = dataclasses.replace(bs, fused_dq=True)
  assert list(script.kernel_parts(fused, fused=True, overlap=True)) == ["fused_kernel", "fused_kernel_overlap"]
  assert script.work_dims("dkv_kernel_overlap_dv_with_dp", 128, 128) == 512


def test_interleaved_rounds_rotate_so_every_variant_takes_every_position():
  orders = benchmarking.round_orders(["a", "b", "c"], repeats=4)
  assert orders == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]
  calls = []
  fns = {n: (lambda n=n: calls.append(n) or jnp.zeros(())) for n in "abc"}
  timings = benchmarking.interleaved_medians(fns, repeats=3, inner=2, warmup=1)
  assert calls[3:] == [n for order in orders[:3] for n in order for _ in range(2)]  # after one warm-up call each
  assert set(timings) == set("abc") and all(lo <= med <= hi for med, lo, hi in timings.values())


def test_speed_against_online_pairs_the_rounds_when_both_keep_samples():
  med, lo, hi = benchmarking.paired_ratio([10.0, 20.0, 10.0], [5.0, 20.0, 8.0])
  assert (med, lo, hi) == (1.25, 1.0, 2.0)
  row = dict(case="c", **{"pass": "fwd"}, ms_min=1.0, ms_max=1.0, tflops=1.0)
  records = [dict(row, impl="online", ms=10.0, samples_ms=[10.0, 20.0, 10.0]),
             dict(row, impl="clis", ms=8.0, samples_ms=[5.0, 20.0, 8.0]),
             dict(row, impl="cudnn", ms=12.5)]  # no samples: the ratio of the medians
  table = benchmarking.markdown_table(records)
  assert "| clis | 8.000 | [1.000, 1.000] | 1 | 1.250× [1.000, 2.000] |" in table
  assert "| cudnn | 12.500 | [1.000, 1.000] | 1 | 0.800× |" in table
  with pytest.raises(ValueError, match="same rounds"):
    benchmarking.paired_ratio([1.0], [1.0, 2.0])
