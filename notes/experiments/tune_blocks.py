"""H200 sweep of pallas_gpu.BlockSizes for the forward, through the public API (pre-pass included).

Every configuration of both stabilizers is timed round-robin in one run per case, so the
online baseline gets the same tuning as clis (issue 4: "the tuned online-softmax baseline").

  python notes/experiments/tune_blocks.py --out $OUT/tune.json
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json

import jax
import jax.numpy as jnp

from clis_kernels import attention, pallas_gpu
from clis_train import benchmarking

CONFIGS = [  # (block_q, block_k, block_k_fixed, num_warps, num_stages)
    (128, 128, 64, 8, 3), (128, 128, 128, 8, 2), (128, 64, 64, 8, 3), (128, 128, 32, 8, 3),
    (128, 128, 64, 4, 3), (64, 128, 64, 4, 3), (128, 64, 128, 8, 3),
]


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--out", required=True)
  p.add_argument("--repeats", type=int, default=10)
  p.add_argument("--inner", type=int, default=5)
  args = p.parse_args()
  meta = benchmarking.device_meta()
  records = []
  for case, s, h, hkv, causal in [("causal_S8192", 8192, 32, 8, True), ("bidir_H12_S32768", 32768, 12, 12, False)]:
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    q = jax.random.normal(keys[0], (1, s, h, 128), jnp.bfloat16)
    k = (jax.random.normal(keys[1], (1, s, hkv, 128)) + jax.random.normal(keys[3], (1, 1, hkv, 128))).astype(jnp.bfloat16)
    v = jax.random.normal(keys[2], (1, s, hkv, 128), jnp.bfloat16)
    want = jax.jit(functools.partial(attention, causal=causal, implementation="xla"))(q, k, v).astype(jnp.float32) \
        if s <= 8192 else None
    fns = {}
    for cfg in CONFIGS:
      bs = dataclasses.replace(pallas_gpu.default_block_sizes(128, s, jnp.bfloat16), block_q=cfg[0], block_k=cfg[1],
                               block_k_fixed=cfg[2], num_warps=cfg[3], num_stages=cfg[4])
      for stab in ("clis", "online"):
        name = f"{stab}|bq={cfg[0]}|bk={cfg[1]}|bkf={cfg[2]}|w={cfg[3]}|s={cfg[4]}"
        fn = jax.jit(functools.partial(attention, causal=causal, stabilizer=stab, block_sizes=bs, return_stats=True))
        try:
          out, stats = fn(q, k, v)
        except Exception as e:  # noqa: BLE001 — a tile that does not fit shared memory
          print("FAILED", case, name, type(e).__name__, str(e)[:160], flush=True)
          continue
        err = None if want is None else float(jnp.max(jnp.abs(out.astype(jnp.float32) - want)))
        records.append(dict(case=case, impl=name, max_abs_err_vs_xla=err, certified=float(stats.certified_fraction)))
        fns[name] = functools.partial(fn, q, k, v)
    timings = benchmarking.interleaved_medians(fns, repeats=args.repeats, inner=args.inner)
    for r in records:
      if r["case"] == case:
        r.update(zip(("ms", "ms_min", "ms_max"), timings[r["impl"]]), **meta)
    for r in sorted((r for r in records if r["case"] == case), key=lambda r: r["ms"]):
      print(f"{case:18s} {r['ms']:8.3f} [{r['ms_min']:.3f}, {r['ms_max']:.3f}] {r['impl']:40s} "
            f"cert={r['certified']:.2f} err={r['max_abs_err_vs_xla']}", flush=True)
  with open(args.out, "w") as f:
    json.dump(records, f, indent=1)


if __name__ == "__main__":
  main()
