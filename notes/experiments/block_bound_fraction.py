"""Certified fraction of the one-radius bound (stabilizer.certify) against the block bound
(stabilizer.certify_blocks: block centres, exceptional keys, the own block scored exactly) on the
pretrained-like families (clis_kernels.testing), at the issue-16 shapes: causal 8k (B 2, GQA 32/8,
D 128) and bidirectional 32k (B 1, H 12, D 128), bf16, tiles of 64 (the Mosaic GPU kernel's).
The certificate is pure JAX, so this runs anywhere (it ran on the CPU).

  python3 notes/experiments/block_bound_fraction.py --out block_bound_fraction.json [--taus 64 96 128]
"""

from __future__ import annotations

import argparse
import datetime
import json
import time

import jax
import numpy as np

from clis_kernels import stabilizer, testing
from clis_kernels.stabilizer import LOG2E

CASES = [("causal_8k", True, 2, 8192, 32, 8), ("bidirectional_32k", False, 1, 32768, 12, 12)]


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default="block_bound_fraction.json")
  parser.add_argument("--families", nargs="*", default=list(testing.FAMILIES))
  parser.add_argument("--taus", type=float, nargs="+", default=[64.0], help="the block bound's tau (nats), each")
  args = parser.parse_args()
  records = []
  for name, causal, b, s, hq, hkv in CASES:
    for family in args.families:
      q, k, v, _, seg = testing.inputs(family, b, s, hq, hkv, 128)
      kw = dict(causal=causal, scale=128 ** -0.5, tau=64.0, granularity="tile", block_q=64, seq_len=s)
      t0 = time.time()
      radius = jax.jit(lambda q, k, v, seg: stabilizer.certify(q, k, v, seg, **kw))(q, k, v, seg)
      by_tau = {tau: jax.jit(lambda q, k, v, seg, tau=tau: stabilizer.certify_blocks(q, k, v, seg, **{**kw, "tau": tau}))(
          q, k, v, seg) for tau in args.taus}
      blocks = by_tau[args.taus[0]]
      gap = lambda c: np.asarray(c.upper - c.lower, np.float64) / LOG2E
      records.append(dict(case=name, family=family, radius_certified=float(radius.certified.mean()),
                          blocks_certified=float(blocks.certified.mean()),
                          blocks_certified_by_tau={str(t): float(c.certified.mean()) for t, c in by_tau.items()},
                          radius_gap_nats_p50=float(np.median(gap(radius))),
                          blocks_gap_nats_p50=float(np.median(gap(blocks))),
                          blocks_gap_nats_p99=float(np.percentile(gap(blocks), 99)), seconds=time.time() - t0))
      print(json.dumps(records[-1]), flush=True)
  with open(args.out, "w") as f:
    json.dump(dict(command=f"python3 notes/experiments/block_bound_fraction.py --taus {' '.join(map(str, args.taus))}", device=jax.devices()[0].device_kind,
                   jax_version=jax.__version__, date=datetime.date.today().isoformat(), records=records), f, indent=1)


if __name__ == "__main__":
  main()
