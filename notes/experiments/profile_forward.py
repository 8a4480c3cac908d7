"""Where a Mosaic GPU forward step's time goes, per warpgroup, from Mosaic GPU's in-kernel profiler.

Runs one forward call with CLIS_MGPU_PROFILE_DIR set (mgpu_pipeline.compiler_params), reads the Chrome trace it
writes, and sums each named region of the step (turn_after_qk, qk_wait, softmax, rounded_sum, await_turn, pv) per
compute warpgroup: calls, total and mean microseconds, share of the warpgroup's traced time. Each warpgroup's trace
holds its first CLIS_MGPU_PROFILE_SPACE events (512: ~40 steps), so use rows that fit (4k causal rows: 32 steps).

  python3 notes/experiments/profile_forward.py --heads 32 8 128 --seq 4096 --batch 2 [--softcap 50] --out x.json
"""

import argparse
import collections
import json
import os
import pathlib
import tempfile

import jax

from clis_kernels import attention, testing

WARPGROUPS_PER_CTA = 3  # two compute warpgroups and the memory one: the profiler's traces per block


def region_totals(trace: dict) -> dict:
  """{(warpgroup, region): [calls, total µs]} from a Mosaic GPU profiler trace (B/E events per thread)."""
  totals = collections.defaultdict(lambda: [0, 0.0])
  open_events = collections.defaultdict(list)
  for event in trace["traceEvents"]:
    key = (event["pid"], event["tid"])
    if event["ph"] == "B":
      open_events[key].append(event)
    elif open_events[key]:
      begin = open_events[key].pop()
      warpgroup = (event["tid"] - 1) % WARPGROUPS_PER_CTA
      totals[(warpgroup, begin["name"])][0] += 1
      totals[(warpgroup, begin["name"])][1] += event["ts"] - begin["ts"]
  return totals


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--heads", type=int, nargs=3, default=[32, 8, 128], metavar=("HQ", "HKV", "D"))
  parser.add_argument("--seq", type=int, default=4096)
  parser.add_argument("--batch", type=int, default=2)
  parser.add_argument("--softcap", type=float, default=None)
  parser.add_argument("--stabilizer", default="online")
  parser.add_argument("--inputs", default="sinks_many", choices=testing.FAMILIES)
  parser.add_argument("--out", required=True)
  args = parser.parse_args()
  hq, hkv, d = args.heads
  q, k, v, _, _ = testing.inputs(args.inputs, args.batch, args.seq, hq, hkv, d)
  trace_dir = pathlib.Path(tempfile.mkdtemp(prefix="clis_profile_"))
  os.environ["CLIS_MGPU_PROFILE_DIR"] = str(trace_dir)
  cap = {} if args.softcap is None else dict(logits_soft_cap=args.softcap)
  jax.block_until_ready(attention(q, k, v, causal=True, implementation="pallas_mgpu", stabilizer=args.stabilizer,
                                  **cap))
  trace_file = max(trace_dir.glob("*trace.json"), key=lambda p: p.stat().st_mtime)
  totals = region_totals(json.loads(trace_file.read_text()))
  rows = []
  for warpgroup in range(2):
    traced = sum(total for (wg, _), (_, total) in totals.items() if wg == warpgroup)
    for (wg, name), (calls, total) in sorted(totals.items()):
      if wg == warpgroup:
        rows.append(dict(warpgroup=wg, region=name, calls=calls, total_us=total, mean_us=total / calls,
                         share=total / traced if traced else 0.0))
        print(f"wg{wg} {name:14s} calls {calls:7d}  mean {total / calls:8.3f} us  share {rows[-1]['share']:.3f}")
  record = dict(heads=args.heads, seq=args.seq, batch=args.batch, softcap=args.softcap, stabilizer=args.stabilizer,
                inputs=args.inputs, regions=rows, trace=trace_file.name, device=str(jax.devices()[0].device_kind),
                jax_version=jax.__version__)
  pathlib.Path(args.out).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
  main()
