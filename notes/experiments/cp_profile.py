"""Where the context-parallel CLiS forward spends its time (BENCHMARKS.md §8): the ring's clis and online forwards
on one GPU timed interleaved, then one call of each under jax.profiler, GPU kernels summed by name (top N).

  PYTHONPATH=kernels:. python3 notes/experiments/cp_profile.py --seq 32768 --heads 32 8 128 --out /tmp/cp.json
"""

from __future__ import annotations

import argparse
import collections
import functools
import glob
import gzip
import json
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from clis_kernels import context_parallel as cp
from clis_kernels import testing
from clis_train import benchmarking


def kernel_times(fn, top):
  """{kernel name: total ms} of the GPU events of one call of fn, from a Perfetto trace."""
  with tempfile.TemporaryDirectory() as tmp:
    with jax.profiler.trace(tmp, create_perfetto_trace=True):
      jax.block_until_ready(fn())
    path = glob.glob(f"{tmp}/**/perfetto_trace.json.gz", recursive=True)[0]
    events = json.load(gzip.open(path))["traceEvents"]
  threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
  pids = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
  totals = collections.Counter()
  for e in events:
    if e.get("ph") == "X" and "/device:GPU" in pids.get(e["pid"], "") and "Stream" in threads.get(
        (e["pid"], e["tid"]), ""):
      totals[e["name"][:90]] += e["dur"] / 1e3
  return dict(totals.most_common(top)), sum(totals.values())


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--seq", type=int, default=32768)
  parser.add_argument("--heads", type=int, nargs=3, default=[32, 8, 128])
  parser.add_argument("--family", default="sinks_many")
  parser.add_argument("--top", type=int, default=15)
  parser.add_argument("--out", default=None)
  args = parser.parse_args()
  hq, hkv, d = args.heads
  q, k, v, _, _ = testing.inputs(args.family, 1, args.seq, hq, hkv, d, dtype=jnp.bfloat16)
  ids = jnp.ones((1, args.seq), jnp.int32)
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("context",))
  spec = P(None, "context")
  zq, zk, zv, zids = (jax.device_put(cp.to_zigzag(x, 1), NamedSharding(mesh, spec)) for x in (q, k, v, ids))

  def ring(stabilizer):
    @jax.jit
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=(spec,) * 4, out_specs=spec)
    def run(q, k, v, ids):
      return cp.context_parallel_attention(q, k, v, ids, axis_name="context", stabilizer=stabilizer,
                                           combine=stabilizer)
    return functools.partial(run, zq, zk, zv, zids)

  fns = {name: ring(name) for name in ("clis", "online")}
  timed = benchmarking.interleaved_medians(fns, repeats=5, inner=3)
  record = {"seq": args.seq, "heads": args.heads, "family": args.family, **benchmarking.device_meta()}
  for name, fn in fns.items():
    kernels, total = kernel_times(fn, args.top)
    record[name] = dict(ms=timed[name], gpu_kernel_ms=total, top=kernels)
    print(f"== ring {name}: {timed[name][0]:.2f} ms [{timed[name][1]:.2f}, {timed[name][2]:.2f}], GPU kernels "
          f"{total:.2f} ms")
    for kname, ms in kernels.items():
      print(f"  {ms:8.3f} ms  {kname}")
  if args.out:
    with open(args.out, "w") as f:
      json.dump(record, f, indent=1)


if __name__ == "__main__":
  main()
