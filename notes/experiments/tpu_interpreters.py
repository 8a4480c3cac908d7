"""The two Pallas TPU interpreters on one peer-suite case (tests/peer_cases.py's fa_113x203_d59_bf16: forward and
gradients of both stabilizers, the shared test base's tiles): wall time of a first and a second (compiled) run, and
cProfile's count and time of host callbacks in the second (BENCHMARKS.md §7).

  PYTHONPATH=kernels:.:tests python3 notes/experiments/tpu_interpreters.py --out /tmp/tpu_interpreters.json
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import json
import pstats
import time

import jax
from jax.experimental.pallas import tpu as pltpu

from clis_kernels import attention
from peer_cases import PEER_CASES, check_peer_case
from test_pallas_tpu import TestPallasTpu


def run(case, interpret):
  def value_and_grads(q, k, v, do, seg, **kw):
    out, vjp = jax.vjp(lambda a, b, c: attention(a, b, c, seg, implementation="pallas_tpu", interpret=interpret,
                                                 block_sizes=TestPallasTpu.block_sizes, **kw), q, k, v)
    return (out, *vjp(do))
  check_peer_case(case, value_and_grads)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--case", default="fa_113x203_d59_bf16")
  parser.add_argument("--out", default=None)
  args = parser.parse_args()
  case = next(c for c in PEER_CASES if c.name == args.case)
  record = dict(command="PYTHONPATH=kernels:.:tests python3 notes/experiments/tpu_interpreters.py", case=case.name,
                date=str(datetime.date.today()), device="CPU (2 cores)", jax=jax.__version__)
  for name, interpret in (("plain", True), ("InterpretParams", pltpu.InterpretParams())):
    t0 = time.perf_counter()
    run(case, interpret)
    first = time.perf_counter() - t0
    profile = cProfile.Profile()
    t0 = time.perf_counter()
    profile.runcall(run, case, interpret)
    second = time.perf_counter() - t0
    stats = pstats.Stats(profile).stats
    callbacks = [(v[0], v[3]) for k, v in stats.items() if k[2] == "io_callback_impl"]
    record[name] = dict(first_s=round(first, 2), second_s_profiled=round(second, 2),
                        io_callbacks=sum(c for c, _ in callbacks), io_callback_s=round(sum(t for _, t in callbacks), 2))
    print(name, record[name], flush=True)
  if args.out:
    with open(args.out, "w") as f:
      json.dump(record, f, indent=1)


if __name__ == "__main__":
  main()
