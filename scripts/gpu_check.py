"""Correctness and first timings of the Triton kernels on an NVIDIA GPU.

0. shard_map with check_vma=True on the compiled kernels, and an attention sink's fallback.
1. A sweep of small cases (D 64/128/256, GQA, packed segments, odd lengths, bf16/f32):
   forward and dq/dk/dv of `clis` and `online` against a float32 XLA reference.
2. The issue's case, B=1 S=8192 Hq=32 Hkv=8 D=128 causal bf16: errors of both
   stabilizers against the f32 XLA reference, forward and backward.
3. Forward and forward+backward times of clis, online and cuDNN, interleaved
   (A B C A B C ...), each sample = `--inner` back-to-back calls, median of `--repeats`.
Writes one JSON file (list of records) to --out.

  python scripts/gpu_check.py --out benchmarks/results/<date>-h200-gpu_check.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from clis_kernels import attention, pallas_gpu, stabilizer, testing


def rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def make(key, b, s, hq, hkv, d, dtype):
  kq, kk, kv, kd = jax.random.split(key, 4)
  q = jax.random.normal(kq, (b, s, hq, d), jnp.float32)
  k = jax.random.normal(kk, (b, s, hkv, d), jnp.float32) + 0.5 * jax.random.normal(kd, (1, 1, hkv, d))
  v = jax.random.normal(kv, (b, s, hkv, d), jnp.float32)
  do = jax.random.normal(kd, (b, s, hq, d), jnp.float32)
  return [x.astype(dtype) for x in (q, k, v, do)]


def value_and_grads(impl, stab, q, k, v, do, seg, causal):
  def f(q, k, v):
    kw = dict(causal=causal, implementation=impl)
    if impl != "xla":
      kw["stabilizer"] = stab
    return attention(q, k, v, seg, **kw)
  out, vjp = jax.vjp(f, q, k, v)
  return (out, *vjp(do))


def check_case(name, b, s, hq, hkv, d, dtype, causal, packed, seed):
  q, k, v, do = make(jax.random.PRNGKey(seed), b, s, hq, hkv, d, dtype)
  seg = None
  if packed:
    cuts = np.sort(np.random.default_rng(seed).choice(np.arange(1, s), 3, replace=False))
    seg = jnp.asarray(np.searchsorted(cuts, np.arange(s), side="right")[None].repeat(b, 0) + 1, jnp.int32)
    seg = seg.at[:, -5:].set(0)  # a padded tail
  with jax.default_matmul_precision("highest"):  # a true f32 reference, not tf32
    ref = jax.jit(value_and_grads, static_argnums=(0, 1, 7))("xla", None, *(x.astype(jnp.float32) for x in (q, k, v, do)),
                                                            seg, causal)
  records = []
  for stab in ("clis", "online"):
    got = jax.jit(value_and_grads, static_argnums=(0, 1, 7))("pallas_gpu", stab, q, k, v, do, seg, causal)
    errs = {n: rel(g, r) for n, g, r in zip(("out", "dq", "dk", "dv"), got, ref)}
    finite = all(bool(jnp.isfinite(g.astype(jnp.float32)).all()) for g in got)
    _, stats = attention(q, k, v, seg, causal=causal, implementation="pallas_gpu", stabilizer=stab, return_stats=True)
    records.append(dict(case=name, impl="pallas_gpu", stabilizer=stab, pass_="check", B=b, S=s, Hq=hq, Hkv=hkv, D=d,
                        dtype=str(jnp.dtype(dtype)), causal=causal, packed=packed, finite=finite,
                        certified_fraction=float(stats.certified_fraction), **{f"rel_err_{n}": e for n, e in errs.items()}))
    print(f"{name:28s} {stab:6s} finite={finite} cert={records[-1]['certified_fraction']:.2f} "
          + " ".join(f"{n}={e:.2e}" for n, e in errs.items()), flush=True)
  return records


def check_shard_map_and_sink():
  """shard_map (check_vma=True) over a 1x1 mesh, and an attention sink, on the compiled kernels."""
  q, k, v, do = make(jax.random.PRNGKey(7), 2, 512, 8, 2, 128, jnp.bfloat16)
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "tensor"))
  spec = jax.sharding.PartitionSpec("data", None, "tensor")
  plain = lambda q, k, v: attention(q, k, v, implementation="pallas_gpu")
  sharded = jax.shard_map(plain, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec, check_vma=True)
  want = jax.vjp(plain, q, k, v)
  got = jax.vjp(jax.jit(sharded), q, k, v)
  errs = [rel(a, b) for a, b in zip((got[0], *got[1](do)), (want[0], *want[1](do)))]
  print(f"shard_map check_vma=True vs plain: {errs}", flush=True)
  records = [dict(case="shard_map_check_vma", impl="pallas_gpu", pass_="check", B=2, S=512, Hq=8, Hkv=2, D=128,
                  causal=True, **{f"rel_err_{n}": e for n, e in zip(("out", "dq", "dk", "dv"), errs)})]
  sink = k.at[:, 300].multiply(300.0)
  with jax.default_matmul_precision("highest"):
    exact = attention(*(x.astype(jnp.float32) for x in (q, sink, v)), implementation="xla")
  out, stats = attention(q, sink, v, implementation="pallas_gpu", return_stats=True)
  tiles = np.asarray(stats.certified_tiles[0, 0]).astype(int).tolist()
  err = rel(out, exact)
  print(f"attention sink at 300: certified tiles of (batch 0, head 0) {tiles}, rel err {err:.2e}", flush=True)
  records.append(dict(case="attention_sink_pos300", impl="pallas_gpu", stabilizer="clis", pass_="check", B=2, S=512,
                      Hq=8, Hkv=2, D=128, causal=True, certified_tiles_b0h0=tiles,
                      certified_fraction=float(stats.certified_fraction), rel_err_out=err,
                      finite=bool(jnp.isfinite(out.astype(jnp.float32)).all())))
  return records


def timed(fn, args, inner):
  t0 = time.perf_counter()
  out = None
  for _ in range(inner):
    out = fn(*args)
  jax.block_until_ready(out)
  return (time.perf_counter() - t0) / inner * 1e3


def bench(b, s, hq, hkv, d, causal, repeats, inner):
  q, k, v, do = make(jax.random.PRNGKey(0), b, s, hq, hkv, d, jnp.bfloat16)
  variants = {
      "clis": lambda q, k, v: attention(q, k, v, causal=causal, implementation="pallas_gpu", stabilizer="clis"),
      "online": lambda q, k, v: attention(q, k, v, causal=causal, implementation="pallas_gpu", stabilizer="online"),
      "cudnn": lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn"),
  }
  fns = {("clis_prepass", "fwd"): jax.jit(lambda q, k, v: stabilizer.certify(
      q, k, v, None, causal=causal, scale=d**-0.5, tau=64.0, granularity="tile",
      block_q=pallas_gpu.default_block_sizes(d, s, q.dtype).tile, seq_len=s))}
  for name, f in variants.items():
    fns[(name, "fwd")] = jax.jit(f)
    fns[(name, "fwd_bwd")] = jax.jit(lambda q, k, v, do, f=f: jax.vjp(f, q, k, v)[1](do))
  args = {"fwd": (q, k, v), "fwd_bwd": (q, k, v, do)}
  for key, fn in fns.items():  # compile and warm up
    for _ in range(3):
      jax.block_until_ready(fn(*args[key[1]]))
  samples = {key: [] for key in fns}
  for _ in range(repeats):  # interleaved: every variant once per round
    for key, fn in fns.items():
      samples[key].append(timed(fn, args[key[1]], inner))
  flops_fwd = 4 * b * hq * s * s * d * (0.5 if causal else 1.0)
  records = []
  for (name, pass_), ms in samples.items():
    med = statistics.median(ms)
    flops = flops_fwd * (3.5 if pass_ == "fwd_bwd" else 1.0)
    tflops = None if name == "clis_prepass" else flops / med / 1e9
    records.append(dict(case=f"{'causal' if causal else 'bidir'}_S{s}_H{hq}_{hkv}", impl=name, pass_=pass_, ms=med,
                        ms_min=min(ms), ms_max=max(ms), tflops=tflops, B=b, S=s, Hq=hq, Hkv=hkv, D=d,
                        causal=causal, repeat=repeats, inner=inner))
  base = {r["pass_"]: r["ms"] for r in records if r["impl"] == "online"}
  for r in records:
    r["speedup_vs_online"] = base[r["pass_"]] / r["ms"]
    rate = "   pre-pass  " if r["tflops"] is None else f"{r['tflops']:6.1f} TFLOP/s"
    print(f"{r['case']:22s} {r['impl']:12s} {r['pass_']:8s} {r['ms']:8.3f} ms  [{r['ms_min']:.3f}, {r['ms_max']:.3f}]  "
          f"{rate}  x{r['speedup_vs_online']:.3f} vs online", flush=True)
  return records


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--out", required=True, help="JSON file to write")
  parser.add_argument("--repeats", type=int, default=25)
  parser.add_argument("--inner", type=int, default=10)
  parser.add_argument("--skip-sweep", action="store_true")
  args = parser.parse_args()
  device = jax.devices()[0]
  meta = dict(device=device.device_kind, jax_version=jax.__version__, date=datetime.date.today().isoformat())
  print(meta, flush=True)
  records = []
  if not args.skip_sweep:
    for i, (b, s, hq, hkv, d, dt, causal, packed) in enumerate([
        (2, 300, 4, 4, 64, jnp.bfloat16, True, False),
        (2, 300, 8, 2, 128, jnp.bfloat16, True, True),
        (1, 1000, 8, 1, 128, jnp.bfloat16, False, False),
        (1, 777, 4, 1, 256, jnp.bfloat16, True, False),
        (2, 520, 8, 1, 64, jnp.float32, True, True),
        (1, 640, 8, 8, 128, jnp.float32, False, True),
    ]):
      name = f"{'causal' if causal else 'bidir'}{'_packed' if packed else ''}_S{s}_D{d}_G{hq // hkv}_{jnp.dtype(dt).name}"
      records += check_case(name, b, s, hq, hkv, d, dt, causal, packed, seed=i)
  records += check_shard_map_and_sink()
  records += check_case("issue_causal_S8192_H32_8_D128", 1, 8192, *testing.LLM_HEADS, jnp.bfloat16, True, False, seed=99)
  records += bench(1, 8192, *testing.LLM_HEADS, True, args.repeats, args.inner)
  for r in records:
    r.update(meta)
    r["pass"] = r.pop("pass_")
  with open(args.out, "w") as f:
    json.dump(records, f, indent=1)
  print("wrote", args.out)


if __name__ == "__main__":
  main()
