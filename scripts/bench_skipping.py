"""Does the skip kernel's time track the fraction of tiles skipped, at video lengths?

Bidirectional attention (B 1, H heads, D 128) at each sequence length; for each fraction f,
a skip state marking f of the kv tiles of every (head, q tile) at random, then each skip kernel
through diffusion.attention — `mgpu_skip` (kernels/clis_kernels/diffusion/pallas_mgpu_skip.py, Hopper's default) and
`triton_skip` (pallas_gpu_skip.py), thr = −inf so no marking work; and with marking, `*_track` — timed
round-robin with the dense kernels of the same call (clis, online, clis_mgpu, online_mgpu, cuDNN).
Records the median ms with [min, max]; the markdown table adds each skip variant's time relative to its
f = 0 time, to set beside 1 − f.

  python scripts/bench_skipping.py --seq-lens 32768 75600 --out benchmarks/results/<date>-<device>-skipping.json
  python scripts/bench_skipping.py --quick --out /tmp/skip.json      # tiny case, CPU, interpret mode
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp

from clis_kernels import attention, diffusion, plan
from clis_train import benchmarking


def random_marks(key, state: diffusion.SkipState, fraction: float) -> diffusion.SkipState:
  """The state with round(fraction · nk) random kv tiles marked in every (batch, head, q tile)."""
  nk = state.skip.shape[-1]
  rank = jnp.argsort(jax.random.uniform(key, state.skip.shape), axis=-1).argsort(axis=-1)
  return diffusion.SkipState(rank < round(fraction * nk), state.calls)


def variants(q, k, v, fractions, *, quick: bool, kernels=("mgpu", "triton")):
  """{name: zero-argument timed call} for the dense kernels and the skip kernel at each fraction."""
  kw = dict(causal=False, **(dict(implementation="pallas_gpu", interpret=True) if quick else {}))
  dense = {
      "clis": functools.partial(attention, stabilizer="clis", **kw),
      "online": functools.partial(attention, stabilizer="online", **kw),
  }
  if not quick:
    dense["clis_mgpu"] = functools.partial(attention, causal=False, stabilizer="clis", implementation="pallas_mgpu")
    dense["online_mgpu"] = functools.partial(attention, causal=False, stabilizer="online", implementation="pallas_mgpu")
    dense["cudnn"] = functools.partial(jax.nn.dot_product_attention, is_causal=False, implementation="cudnn")
  fns = {name: functools.partial(jax.jit(f), q, k, v) for name, f in dense.items()}
  for kernel, implementation in (("triton", "pallas_gpu"),) if quick else [k for k in SKIP_KERNELS if k[0] in kernels]:
    bs = plan.make_plan(dtype=q.dtype, head_dim=q.shape[-1], seq_len=q.shape[1], causal=False, skipping=True,
                        implementation=implementation, interpret=quick).block_sizes
    empty = diffusion.init_state(q.shape[0], q.shape[2], q.shape[1], bs)
    for i, f in enumerate(fractions):
      state = random_marks(jax.random.PRNGKey(i), empty, f)
      for name, thr in ((f"{kernel}_skip", -float("inf")), (f"{kernel}_skip_track", -1e4)):
        run = jax.jit(lambda q, k, v, s, thr=thr, implementation=implementation: diffusion.attention(
            q, k, v, s, thr=thr, implementation=implementation, interpret=quick)[0])
        fns[f"{name}@{f:.2f}"] = functools.partial(run, q, k, v, state)
  return fns


SKIP_KERNELS = (("mgpu", "pallas_mgpu"), ("triton", "pallas_gpu"))


def plot_sweep(records, path, value=None):
  """Time against the fraction skipped, one panel per sequence length: the skip kernel (with and
  without marking) as lines, each dense kernel as a dashed level, and the ideal (f = 0 time × kept)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  cases = sorted({r["case"] for r in records}, key=lambda c: int(c.rsplit("S", 1)[1]))
  fig, axes = plt.subplots(1, len(cases), figsize=(5.5 * len(cases), 4), squeeze=False)
  for ax, case in zip(axes[0], cases):
    rows = [r for r in records if r["case"] == case]
    for impl in sorted({r["impl"].partition("@")[0] for r in rows if "@" in r["impl"]}):
      pts = sorted((r["skipped"], r["ms"]) for r in rows if r["impl"].partition("@")[0] == impl)
      ax.plot(*zip(*pts), marker="o", label=impl)
      if not impl.endswith("_track"):
        ax.plot([f for f, _ in pts], [pts[0][1] * (1 - f) for f, _ in pts], ":", color="grey")
    for i, r in enumerate(r for r in rows if "@" not in r["impl"]):
      ax.axhline(r["ms"], ls="--", lw=1, color=plt.get_cmap("tab10").colors[(i + 2) % 10], label=r["impl"])
    ax.set_title(case, fontsize=9)
    ax.set_xlabel("fraction of kv tiles skipped")
    ax.set_ylabel("ms")
    ax.legend(fontsize=7)
  benchmarking.save_figure(fig, path, records[0])


def main():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--heads", type=int, default=12)
  p.add_argument("--seq-lens", type=int, nargs="+", default=[32768, 75600])
  p.add_argument("--fractions", type=float, nargs="+", default=[0.0, 0.25, 0.5, 0.75])
  p.add_argument("--repeats", type=int, default=10)
  p.add_argument("--inner", type=int, default=3)
  p.add_argument("--kernels", nargs="+", default=["mgpu", "triton"], choices=[k for k, _ in SKIP_KERNELS],
                 help="skip kernels to time (--quick: triton, in interpret mode)")
  p.add_argument("--quick", action="store_true", help="tiny case on the CPU, Pallas in interpret mode")
  p.add_argument("--out", default=None)
  args = p.parse_args()
  if any(not 0.0 <= f < 1.0 for f in args.fractions):
    raise SystemExit(f"--fractions={args.fractions} must each be in [0, 1)")
  if args.quick:
    args.heads, args.seq_lens, args.repeats, args.inner = 2, [200], 2, 1
  meta, records = benchmarking.device_meta(), []
  for s in args.seq_lens:
    q, k, v = (jax.random.normal(key, (1, s, args.heads, 128), jnp.bfloat16)
               for key in jax.random.split(jax.random.PRNGKey(s), 3))
    timings = benchmarking.interleaved_medians(variants(q, k, v, args.fractions, quick=args.quick,
                                                        kernels=args.kernels),
                                               repeats=args.repeats, inner=args.inner)
    flops = 4 * args.heads * s * s * 128
    for name, (med, lo, hi) in timings.items():
      impl, _, frac = name.partition("@")
      f = float(frac) if frac else 0.0
      base = timings.get(f"{impl}@{args.fractions[0]:.2f}", (None,))[0] if frac else None
      records.append(dict(case=f"dit_bidir_H{args.heads}_S{s}", impl=name, **{"pass": "fwd"}, ms=med, ms_min=lo,
                          ms_max=hi, tflops=flops * (1 - f) / med / 1e9, skipped=f,
                          vs_unskipped=None if base is None else med / base, B=1, S=s, Hq=args.heads,
                          Hkv=args.heads, D=128, causal=False, repeat=args.repeats, inner=args.inner, **meta))
  out = args.out or benchmarking.default_output("skipping_quick" if args.quick else "skipping")
  benchmarking.write_report(records, out, plotter=plot_sweep)
  print(benchmarking.markdown_table(records))
  for r in records:
    if r["vs_unskipped"] is not None:
      print(f"{r['case']} {r['impl']:22s} {r['ms']:8.3f} ms  time/unskipped {r['vs_unskipped']:.3f}  "
            f"kept {1 - r['skipped']:.2f}")
  print("wrote", out)


if __name__ == "__main__":
  main()
