"""H200 experiment: where the time of one `attention(...)` forward goes, kernel by kernel.

Runs each (case, stabilizer) through the API (default implementation: pallas_mgpu on an H200)
under jax.profiler.trace, calls separated by an idle gap, and reads the GPU kernels back with
jax.profiler.ProfileData: per call the span (first kernel start to last kernel end), the sum of
kernel times, and each kernel's mean time. The difference between clis and online is the pre-pass
(XLA kernels before the attention kernel) plus the attention kernels' own difference.

  python notes/experiments/api_profile.py --out $OUT/api_profile.json      # repository root
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from clis_kernels import attention, testing
from clis_train import benchmarking

CASES = {  # name: (seq, q heads, kv heads, causal, documents or 0)
    "causal_S8192_H32_8": (8192, 32, 8, True, 0),
    "causal_packed4_S8192_H32_8": (8192, 32, 8, True, 4),
    "bidir_S32768_H12": (32768, 12, 12, False, 0),
}


def inputs(seq, hq, hkv, docs):
  kq, kk, kv, kc = jax.random.split(jax.random.PRNGKey(0), 4)
  q = jax.random.normal(kq, (1, seq, hq, 128), jnp.bfloat16)
  k = (jax.random.normal(kk, (1, seq, hkv, 128)) + jax.random.normal(kc, (1, 1, hkv, 128))).astype(jnp.bfloat16)
  v = jax.random.normal(kv, (1, seq, hkv, 128), jnp.bfloat16)
  seg = None
  if docs:
    cuts = np.sort(np.random.default_rng(0).choice(np.arange(1, seq), docs - 1, replace=False))
    seg = jnp.asarray(np.searchsorted(cuts, np.arange(seq), side="right")[None] + 1, jnp.int32)
  return q, k, v, seg


def gpu_kernels(path):
  """[(name, start_ns, duration_ns)] of every GPU kernel in the trace, by start time."""
  events, names = [], []
  for plane in jax.profiler.ProfileData.from_file(path).planes:
    if not plane.name.startswith("/device:GPU"):
      continue
    for line in plane.lines:
      names.append(line.name)
      if "stream" not in line.name.lower() or "memcpy" in line.name.lower():
        continue
      events += [(e.name, e.start_ns, e.duration_ns) for e in line.events]
  if not events:
    print("no kernels found on the GPU lines", names, flush=True)
  return sorted(events, key=lambda e: e[1])


def split_calls(events, gap_ns=2e6):
  calls, current = [], []
  for e in events:
    if current and e[1] - max(c[1] + c[2] for c in current) > gap_ns:
      calls.append(current)
      current = []
    current.append(e)
  return calls + ([current] if current else [])


def profile(fn, calls):
  fn().block_until_ready()
  with tempfile.TemporaryDirectory() as d:
    with jax.profiler.trace(d):
      for _ in range(calls):
        fn().block_until_ready()
        time.sleep(0.02)
    (path,) = glob.glob(f"{d}/**/*.xplane.pb", recursive=True)
    per_call = split_calls(gpu_kernels(path))
  spans = [(c[-1][1] + c[-1][2] - c[0][1]) / 1e3 for c in per_call]
  busy = [sum(e[2] for e in c) / 1e3 for c in per_call]
  kernels = collections.defaultdict(list)
  for c in per_call:
    for name, _, dur in c:
      kernels[name].append(dur / 1e3)
  n = len(per_call)
  table = sorted(((name, sum(d) / n, len(d) / n) for name, d in kernels.items()), key=lambda t: -t[1])
  return dict(calls=n, span_us=float(np.median(spans)), busy_us=float(np.median(busy)),
              kernels=[dict(name=name[:120], us_per_call=round(us, 2), count_per_call=cnt) for name, us, cnt in table])


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--out", required=True)
  parser.add_argument("--calls", type=int, default=8)
  parser.add_argument("--family", nargs="*", default=[], help="S,B,causal(0/1),family cases (clis_kernels.testing) "
                      "instead of the default CASES, GQA 32/8, D 128; e.g. 8192,4,1,outlier_channels")
  parser.add_argument("--variants", nargs="+", default=["clis", "online"], choices=["clis", "online", "clis_blocks"])
  args = parser.parse_args()
  records = []
  cases = {case: (causal, inputs(seq, hq, hkv, docs)) for case, (seq, hq, hkv, causal, docs) in CASES.items()}
  if args.family:
    cases = {}
    for spec in args.family:
      seq, batch, causal, family = spec.split(",")
      q, k, v, _, seg = testing.inputs(family, int(batch), int(seq), 32, 8, 128)
      cases[f"{'causal' if int(causal) else 'bidir'}_S{seq}_B{batch}_{family}"] = (bool(int(causal)), (q, k, v, seg))
  for case, (causal, (q, k, v, seg)) in cases.items():
    for stab in args.variants:
      kw = dict(stabilizer="online") if stab == "online" else dict(bound="blocks" if stab == "clis_blocks" else "radius")
      fn = jax.jit(lambda q, k, v, seg, kw=kw, causal=causal: attention(q, k, v, seg, causal=causal, **kw))
      rec = dict(case=case, stabilizer=stab, **profile(lambda: fn(q, k, v, seg), args.calls),
                 **benchmarking.device_meta())
      records.append(rec)
      print(f"{case} {stab}: span {rec['span_us']:.1f} us, kernels {rec['busy_us']:.1f} us, "
            f"{sum(x['count_per_call'] for x in rec['kernels']):.0f} kernels", flush=True)
      for x in rec["kernels"][:14]:
        print(f"   {x['us_per_call']:9.2f} us  x{x['count_per_call']:.0f}  {x['name']}", flush=True)
  with open(args.out, "w") as f:
    json.dump(records, f, indent=1)


if __name__ == "__main__":
  main()
