"""Accuracy on testing.hull_escaping (bf16, S 384, MQA 2/1, D 64, bidirectional): the reference's certified
forward and backward with the old centre (the sampled median of block means, rebuilt by asking key_bounds for a
window over every key and certifying without it) and the new one (the exact key mean), against float64 and the
online path; and the saved lse's error against float64's.

  python3 notes/experiments/hull_accuracy.py --out hull_accuracy.json
"""

from __future__ import annotations

import argparse
import datetime
import json

import jax
import numpy as np

from clis_kernels import reference, stabilizer, testing
from clis_kernels import reference_f64 as ref
from clis_kernels.plan import Mode

S, BLOCK = 384, reference.BlockSizes(32, 16)


def run(q, k, v, do, cert):
  mode = Mode.ONLINE if cert is None else Mode.CERTIFICATE
  o, lse, _ = reference.forward(q, k, v, None, cert, mode=mode, causal=False, scale=1 / 8, kv_len=S, block_sizes=BLOCK)
  grads = reference.backward(q, k, v, None, o, lse, do, causal=False, scale=1 / 8, kv_len=S, block_sizes=BLOCK)
  return (o, *grads), lse


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default="hull_accuracy.json")
  args = parser.parse_args()
  records = []
  for seed in range(3):
    q, k, v, do = testing.hull_escaping(1, S, 2, 1, 64, magnitude=60.0, seed=seed)
    want = ref.attention(q, k, v, do, None, causal=False)
    s = np.einsum("bqhd,bkhd->bhqk", np.asarray(q, np.float64), np.repeat(np.asarray(k, np.float64), 2, 2)) / 8
    s = s * stabilizer.LOG2E
    lse64 = np.log2(np.exp2(s - s.max(-1, keepdims=True)).sum(-1)) + s.max(-1)
    kw = dict(causal=False, tau=128.0, block_q=BLOCK.block_q, seq_len=S)
    rows = dict(causal=False, scale=1 / 8, granularity="tile", block_q=BLOCK.block_q, seq_len=S)
    certs = {"online": None,
             "clis_mean": stabilizer.certify_rows(q, k, None, stabilizer.key_bounds(k, v, None, **kw), **rows),
             "clis_median": stabilizer.certify_rows(q, k, None, stabilizer.key_bounds(k, v, None, **kw, window=(S, S)),
                                                    **rows)}
    record = dict(seed=seed)
    for name, cert in certs.items():
      got, lse = run(q, k, v, do, cert)
      record[name] = dict(rel_err_out_dq_dk_dv=[ref.rel_err(g, w) for g, w in zip(got, want)],
                          lse_max_abs_err_log2=float(np.abs(np.asarray(lse, np.float64) - lse64).max()),
                          certified=None if cert is None else float(cert.certified.mean()))
    records.append(record)
    print(json.dumps(record), flush=True)
  with open(args.out, "w") as f:
    json.dump(dict(command="python3 notes/experiments/hull_accuracy.py", date=str(datetime.date.today()),
                   device="CPU (AMD EPYC, 2 cores)", jax=jax.__version__, records=records), f, indent=1)


if __name__ == "__main__":
  main()
