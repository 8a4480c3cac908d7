"""H200 sweep: tiles of the Mosaic GPU forward (block_kv, slots, pingpong), certified vs online loop.

Round 3 swept (block_kv, slots); round 5 adds pingpong=False (no schedule barrier: both compute
warpgroups issue wgmma when ready), whose fixed loop has a short softmax that may not need the turns,
and overlap=True (the certified loop issues block i+1's Q·Kᵀ before block i's exp2).
For each case and each BlockSizes that fits in shared memory, times the kernel
alone with the XLA certificate (clis) and without (online), all interleaved in one run; prints each
config's output difference from the default online kernel's. The tuned ratio is
best clis / best online (each loop gets its own best tiles).

  python notes/experiments/mgpu_tune.py --out $OUT/mgpu_tune.json      # from the repository root
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp

from clis_kernels import pallas_mgpu, stabilizer
from clis_kernels.plan import Mode
from clis_train import benchmarking
from notes.experiments.mgpu_variants import case_inputs  # same inputs as the variants runs

CASES = {"bidir_S32768_H12": (32768, 12, 12, False), "causal_S8192_H32_8": (8192, 32, 8, True)}
# (block_kv, slots, pingpong, overlap); overlap applies to the certified loop only
CONFIGS = [(128, 2, True, False), (64, 2, True, False), (64, 3, True, False), (128, 2, False, False),
           (64, 3, False, False), (128, 2, False, True), (64, 2, False, True), (64, 3, False, True)]


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--out", required=True)
  parser.add_argument("--repeats", type=int, default=10)
  parser.add_argument("--inner", type=int, default=5)
  args = parser.parse_args()
  records = []
  for case, (s, hq, hkv, causal) in CASES.items():
    q, k, v = case_inputs(s, hq, hkv)
    scale = 128 ** -0.5
    cert = jax.jit(lambda q, k, v: stabilizer.certify(q, k, v, None, causal=causal, scale=scale, tau=64.0,
                                                      granularity="tile", block_q=64, seq_len=s))(q, k, v)
    fns, outs = {}, {}
    for bkv, slots, pingpong, overlap in CONFIGS:
      bs = pallas_mgpu.BlockSizes(block_kv=bkv, slots=slots, pingpong=pingpong, overlap=overlap)
      for name, c in (("clis", cert), ("online", None)):
        if overlap and name == "online":  # the online loop ignores overlap
          continue
        f = jax.jit(lambda q, k, v, c, bs=bs: pallas_mgpu.forward(q, k, v, None, c, mode=Mode.CERTIFICATE if c is not None else Mode.ONLINE, causal=causal, scale=scale,
                                                                  kv_len=None, block_sizes=bs)[0])
        key = f"{name}_kv{bkv}_s{slots}{'' if pingpong else '_nopp'}{'_ovl' if overlap else ''}"
        try:
          outs[key] = f(q, k, v, c).astype(jnp.float32)
          fns[key] = lambda f=f, c=c: f(q, k, v, c)
        except Exception as e:  # noqa: BLE001 — a config over the shared-memory limit fails to compile
          print(case, key, "failed:", type(e).__name__, str(e)[:200], flush=True)
    base = outs["online_kv128_s2"]
    timings = benchmarking.interleaved_medians(fns, repeats=args.repeats, inner=args.inner)
    best = {n: min((t[0], key) for key, t in timings.items() if key.startswith(n)) for n in ("clis", "online")}
    for key, (med, lo, hi) in sorted(timings.items(), key=lambda kv: kv[1][0]):
      diff = float(jnp.linalg.norm(outs[key] - base) / jnp.linalg.norm(base))
      print(f"{case:20s} {key:18s} {med:8.3f} ms [{lo:.3f}, {hi:.3f}]  diff vs online default {diff:.2e}", flush=True)
      records.append(dict(case=case, impl=key, ms=med, ms_min=lo, ms_max=hi, rel_diff_vs_online=diff, S=s, Hq=hq,
                          Hkv=hkv, D=128, causal=causal, repeat=args.repeats, inner=args.inner,
                          **benchmarking.device_meta()))
    print(f"{case}: best clis {best['clis'][1]} {best['clis'][0]:.3f} ms, best online {best['online'][1]} "
          f"{best['online'][0]:.3f} ms, tuned ratio {best['online'][0] / best['clis'][0]:.3f}x", flush=True)
    with open(args.out, "w") as f:
      json.dump(records, f, indent=1)


if __name__ == "__main__":
  main()
