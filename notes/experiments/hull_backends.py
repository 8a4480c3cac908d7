"""Certified (radius bound) against online accuracy on testing.hull_escaping (bf16, S 384, MQA 2/1, D 64,
bidirectional, magnitude 60) through the API on each CPU-runnable backend (reference; TPU and Triton kernels in
interpret mode): each of out, dq, dk, dv's relative error against float64, and clis's over online's, per seed.
Run on a checkout before and after a change to compare (the accurate lse: BENCHMARKS.md §3).

  python3 notes/experiments/hull_backends.py --out hull_backends.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess

import jax

from clis_kernels import attention, testing
from clis_kernels import reference_f64 as ref

BACKENDS = ("reference", "pallas_tpu", "pallas_gpu")


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--seeds", type=int, default=3)
  parser.add_argument("--out", default="hull_backends.json")
  args = parser.parse_args()
  records = []
  for implementation in BACKENDS:
    for seed in range(args.seeds):
      q, k, v, do = testing.hull_escaping(1, 384, 2, 1, 64, magnitude=60.0, seed=seed)
      want = ref.attention(q, k, v, do, None, causal=False)
      errors = {}
      for stabilizer in ("clis", "online"):
        run = lambda q, k, v: attention(q, k, v, causal=False, stabilizer=stabilizer, bound="radius",
                                        implementation=implementation, interpret=implementation != "reference")
        out, vjp = jax.vjp(run, q, k, v)
        errors[stabilizer] = [ref.rel_err(g, w) for g, w in zip((out, *vjp(do)), want)]
      ratio = [c / o for c, o in zip(errors["clis"], errors["online"])]
      records.append(dict(implementation=implementation, seed=seed, rel_err_out_dq_dk_dv=errors,
                          clis_over_online=ratio))
      print(implementation, seed, [round(r, 3) for r in ratio], flush=True)
  commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
  with open(args.out, "w") as f:
    json.dump(dict(command="python3 notes/experiments/hull_backends.py", commit=commit, date=str(datetime.date.today()),
                   device="CPU (2 cores)", jax=jax.__version__, records=records), f, indent=1)


if __name__ == "__main__":
  main()
