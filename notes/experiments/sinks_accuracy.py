"""Learned sinks on the Mosaic GPU kernels: errors against float64 of o, dq, dk, dv and dsinks for the online and the
certified path, seed by seed (GQA 8/2, D 64, bf16, 2 × 1024 rows): whether the certified path's dsinks error differs
from the online path's by more than seed-to-seed spread. dsinks is 8 numbers, each a sum over 2048 rows of sink
weight · rowsum(dO∘o), so its error is a random projection of o's; "dsinks_units" takes it in units of each head's
own spread (the GPU test's measure, `dsinks_scale64`). Run on the H200:
  PYTHONPATH=tests:$PYTHONPATH python3 notes/experiments/sinks_accuracy.py --out sinks_accuracy.json
"""

import argparse
import json

import jax
import numpy as np
from test_sinks_and_split_heads import dense64, dsinks_scale64, grads64, inputs, rel  # the test's float64 truth

from clis_kernels import attention

NAMES = ("o", "dq", "dk", "dv", "dsinks", "dsinks_units")  # dsinks_units: in units of each head's spread


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--seeds", type=int, default=8)
  parser.add_argument("--out", default=None)
  parser.add_argument("--implementation", default="pallas_mgpu")  # "reference" runs it on a CPU
  args = parser.parse_args()
  rows = []
  for causal in (False, True):
    runs = {}
    for stabilizer in ("online", "clis"):
      fn = lambda q, k, v, sinks, stabilizer=stabilizer: attention(
          q, k, v, causal=causal, sinks=sinks, stabilizer=stabilizer, implementation=args.implementation)

      def run(q, k, v, sinks, do, fn=fn):
        out, vjp = jax.vjp(fn, q, k, v, sinks)
        return (out, *vjp(do))
      runs[stabilizer] = jax.jit(run)
    for seed in range(args.seeds):
      q, k, v, do, sinks = inputs(100 + seed, 2, 1024, 8, 2, 64, dtype=jax.numpy.bfloat16)
      want = (dense64(q, k, v, None, sinks, causal=causal), *grads64(q, k, v, None, sinks, do, causal=causal))
      unit = dsinks_scale64(q, k, None, sinks, want[0], causal=causal)
      errs = {}
      for s, run in runs.items():
        got = run(q, k, v, sinks, do)
        errs[s] = [rel(g, w) for g, w in zip(got, want)] + [rel(np.asarray(got[4], np.float64) / unit, want[4] / unit)]
      row = dict(causal=causal, seed=seed, online=dict(zip(NAMES, errs["online"])),
                 clis=dict(zip(NAMES, errs["clis"])))
      rows.append(row)
      print(f"causal={causal} seed {seed}: " + "  ".join(
          f"{n} {c:.2e}/{o:.2e} ({c / o:.2f}x)" for n, c, o in zip(NAMES, errs["clis"], errs["online"])), flush=True)
    for n in NAMES:
      ratios = [r["clis"][n] / r["online"][n] for r in rows if r["causal"] == causal]
      print(f"causal={causal} {n}: clis/online error ratio median {np.median(ratios):.3f} "
            f"[{min(ratios):.3f}, {max(ratios):.3f}] over {len(ratios)} seeds")
  if args.out:
    with open(args.out, "w") as f:
      json.dump(dict(device=str(jax.devices()[0]), rows=rows), f, indent=1)


if __name__ == "__main__":
  main()
