"""Context-parallel attention against one device, and the CLiS combination against an online-softmax ring.

Variants, timed round-robin in one run (clis_train.benchmarking.interleaved_medians):
  one_device           clis_kernels.attention on the first device (--no-one-device where it does not fit)
  <strategy>_clis      clis_kernels.context_parallel over --context devices: certified kernels, partials added
  <strategy>_online    the same ring with the online softmax in the kernels and the online combination
for each --strategies entry. Inputs: one family of clis_kernels.testing.inputs (pretrained-shaped: sinks, RoPE,
outlier channels) or Gaussian. Per variant: median ms [min, max], the speed-up over one device, the scaling
efficiency t_one / (n · t_cp), and the certified fraction.

  python scripts/bench_context_parallel.py --seq 75600 --heads 40 40 128 --bidirectional --context 2 \\
      --out benchmarks/results/<date>-<device>-context_parallel_dit.json
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from clis_kernels import attention
from clis_kernels import context_parallel as cp
from clis_kernels import testing
from clis_train import benchmarking


def _inputs(family, batch, seq, hq, hkv, d):
  if family == "gaussian":
    q, k, v, do = testing.random_inputs(0, batch, seq, hq, hkv, d, jnp.bfloat16)
    return q, k, v, do
  q, k, v, do, _ = testing.inputs(family, batch, seq, hq, hkv, d, dtype=jnp.bfloat16)
  return q, k, v, do


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--seq", type=int, default=75600)
  parser.add_argument("--batch", type=int, default=1)
  parser.add_argument("--heads", type=int, nargs=3, default=[40, 40, 128], metavar=("HQ", "HKV", "D"))
  parser.add_argument("--bidirectional", action="store_true", help="default: causal")
  parser.add_argument("--context", type=int, default=None, help="devices on the context axis (default: all)")
  parser.add_argument("--strategies", nargs="+", default=list(cp.STRATEGIES), choices=cp.STRATEGIES)
  parser.add_argument("--family", default="sinks_many", help="gaussian or a clis_kernels.testing.inputs family")
  parser.add_argument("--passes", nargs="+", default=["fwd", "fwd_bwd"], choices=["fwd", "fwd_bwd"])
  parser.add_argument("--no-one-device", action="store_true", help="leave out the single-device variant")
  parser.add_argument("--implementation", default=None, help="the kernels' backend (default: the platform's)")
  parser.add_argument("--interpret", action="store_true", help="Pallas interpret mode (CPU smoke runs)")
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--inner", type=int, default=3)
  parser.add_argument("--out", default=None)
  args = parser.parse_args()

  n = args.context or jax.device_count()
  hq, hkv, d = args.heads
  causal = not args.bidirectional
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:n]), ("context",))
  q, k, v, do = _inputs(args.family, args.batch, args.seq, hq, hkv, d)
  # bf16's exact zig-zag needs a length of whole chunk pairs: pad with padding tokens (segment id 0) if not
  seq = -(-args.seq // (2 * n)) * 2 * n
  ids = (jnp.arange(seq) < args.seq).astype(jnp.int32)[None].repeat(args.batch, 0)
  q, k, v, do = (jnp.pad(x, ((0, 0), (0, seq - args.seq), (0, 0), (0, 0))) for x in (q, k, v, do))
  spec = P(None, "context")
  zig = lambda x: jax.device_put(cp.to_zigzag(x, n), NamedSharding(mesh, spec))
  zq, zk, zv, zdo, zids = (zig(x) for x in (q, k, v, do, ids))
  kw = dict(implementation=args.implementation, interpret=args.interpret)

  def context_parallel(strategy, stabilizer):
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=(spec,) * 4, out_specs=(spec, P()))
    def run(q, k, v, ids):
      out, stats = cp.context_parallel_attention(q, k, v, ids, axis_name="context", causal=causal,
                                                 stabilizer=stabilizer, combine=stabilizer, strategy=strategy,
                                                 return_stats=True, **kw)
      return out, jax.lax.pmean(stats.certified_fraction, "context")
    return run

  variants = {}
  if not args.no_one_device:
    one = lambda q, k, v, ids: attention(q, k, v, ids, causal=causal, return_stats=True, **kw)
    single = tuple(jax.device_put(x, jax.devices()[0]) for x in (q, k, v, do, ids))
    variants["one_device"] = (lambda q, k, v, ids: (lambda o, s: (o, s.certified_fraction))(*one(q, k, v, ids)),
                              single)
  for strategy in args.strategies:
    for stabilizer in ("clis", "online"):
      variants[f"{strategy}_{stabilizer}"] = (context_parallel(strategy, stabilizer), (zq, zk, zv, zdo, zids))

  records = []
  for pass_ in args.passes:
    fns, certified = {}, {}
    for name, (fn, (a, b, c, g, i)) in variants.items():
      if pass_ == "fwd":
        step = jax.jit(fn)
        fns[name] = functools.partial(step, a, b, c, i)
      else:
        def grads(a, b, c, g, i, fn=fn):
          out, vjp = jax.vjp(lambda a, b, c: fn(a, b, c, i)[0], a, b, c)
          return vjp(g)
        fns[name] = functools.partial(jax.jit(grads), a, b, c, g, i)
      certified[name] = float(jax.jit(fn)(a, b, c, i)[1])
    timed = benchmarking.interleaved_medians(fns, repeats=args.repeats, inner=args.inner)
    for name, (ms, lo, hi) in timed.items():
      records.append(dict(case=f"{'causal' if causal else 'bidir'}_{args.family}_S{args.seq}", impl=name,
                          **{"pass": pass_}, ms=ms, ms_min=lo, ms_max=hi, B=args.batch, S=args.seq, Hq=hq, Hkv=hkv,
                          D=d, causal=causal, devices=1 if name == "one_device" else n, context=n,
                          certified=certified[name], repeat=args.repeats, **benchmarking.device_meta()))
  for r in records:
    one = next((x["ms"] for x in records if x["impl"] == "one_device" and x["pass"] == r["pass"]), None)
    online = next((x["ms"] for x in records if x["pass"] == r["pass"] and
                   x["impl"] == r["impl"].replace("_clis", "_online")), None)
    r["speedup_vs_one_device"] = None if one is None else one / r["ms"]
    r["scaling_efficiency"] = None if one is None else one / (r["devices"] * r["ms"])
    r["speedup_vs_online_ring"] = None if online is None or r["impl"] == "one_device" else online / r["ms"]
    print(f"{r['case']} {r['pass']:8s} {r['impl']:18s} {r['ms']:9.2f} ms [{r['ms_min']:.2f}, {r['ms_max']:.2f}] "
          f"vs one device {r['speedup_vs_one_device'] or float('nan'):.3f}  "
          f"efficiency {r['scaling_efficiency'] or float('nan'):.3f}  "
          f"vs online ring {r['speedup_vs_online_ring'] or float('nan'):.3f}  certified {r['certified']:.3f}",
          flush=True)
  out = args.out or benchmarking.default_output(f"context_parallel_{records[0]['case']}")
  benchmarking.write_report(records, out, value="ms")
  print("wrote", out)


if __name__ == "__main__":
  main()
