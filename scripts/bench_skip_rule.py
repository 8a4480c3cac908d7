"""A video-shaped attention call skipped at the sparsity the marking rule itself reaches (LiteAttention's ~42%
on Wan2.1-14B), timed against the dense kernels.

Inputs: tokens on a (frames, height, width) grid in raster order, as a video DiT flattens them; q and k are
random Fourier features of the grid position (a Gaussian kernel of length `--length` tokens per axis, so a
token attends mostly to its neighbourhood in space and time) times `--sharpness`, plus noise; v random. The
marks come from diffusion.attention's rule (thr bisected until the marked fraction is within 1% of
`--target`), not from a random draw. Then, interleaved: the skip kernel with those marks (no marking work),
the same with marking (`_track`), the dense Mosaic GPU kernels (CLiS and online), the API's default and cuDNN.
Also recorded: thr, the fraction marked, and the skipped call's relative L1 error against the dense one.

  python scripts/bench_skip_rule.py --grid 21 45 80 --heads 40 --target 0.42 --out benchmarks/results/<date>-<device>-skip_rule.json
  python scripts/bench_skip_rule.py --quick --out /tmp/skip_rule.json      # tiny grid, CPU, interpret mode
"""

from __future__ import annotations

import argparse
import functools
import math

import jax
import jax.numpy as jnp

from clis_kernels import attention, diffusion, plan
from clis_train import benchmarking


def video_inputs(key, grid, heads: int, head_dim: int, *, length: float, sharpness: float, dtype):
  """q, k, v [1, T·H·W, heads, head_dim]: q and k share random Fourier features of the grid position (their
  dot product falls off as a Gaussian of the distance, `length` tokens wide), each head its own features."""
  pos = jnp.stack(jnp.meshgrid(*(jnp.arange(n, dtype=jnp.float32) for n in grid), indexing="ij"), -1).reshape(-1, 3)
  kw, kb, kq, kk, kv = jax.random.split(key, 5)
  omega = jax.random.normal(kw, (heads, 3, head_dim)) / length
  phase = jax.random.uniform(kb, (heads, 1, head_dim), maxval=2 * math.pi)
  base = jnp.sqrt(2.0) * jnp.cos(jnp.einsum("sa,had->hsd", pos, omega) + phase)  # [heads, S, D]
  base = sharpness * jnp.moveaxis(base, 0, 1)[None]
  noise = lambda k_: 0.3 * jax.random.normal(k_, base.shape)
  q, k = base + noise(kq), base + noise(kk)
  v = jax.random.normal(kv, base.shape)
  return tuple(x.astype(dtype) for x in (q, k, v))


def rule_marks(q, k, v, *, target: float, implementation, interpret: bool, iters: int = 14):
  """(state, thr): the marks the rule makes from a fresh state at the thr whose marked fraction is closest to
  `target` (bisection; thr ≤ the largest value whose skip budget 2^(−thr−1) still allows `target` of a row)."""
  empty = diffusion.init_state(q.shape[0], q.shape[2], q.shape[1], _block_sizes(q, implementation, interpret))
  mark = jax.jit(lambda q, k, v, s, thr: diffusion.attention(q, k, v, s, thr=thr, implementation=implementation,
                                                             interpret=interpret)[1])
  nk = empty.skip.shape[-1]
  lo, hi = -60.0, min(-1.0, -1.0 - math.ceil(math.log2(max(1.0, target * nk))))
  best = None
  for _ in range(iters):
    mid = (lo + hi) / 2
    state = mark(q, k, v, empty, jnp.float32(mid))
    frac = float(state.skip.mean())
    if best is None or abs(frac - target) < abs(best[2] - target):
      best = (state, mid, frac)
    if abs(frac - target) <= 0.01:
      break
    lo, hi = (mid, hi) if frac < target else (lo, mid)
  return best


def _block_sizes(q, implementation, interpret):
  return plan.make_plan(dtype=q.dtype, head_dim=q.shape[-1], seq_len=q.shape[1], causal=False, skipping=True,
                        implementation=implementation, interpret=interpret).block_sizes


def main():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--grid", type=int, nargs=3, default=[21, 45, 80], help="frames, height, width (Wan2.1 720p latents)")
  p.add_argument("--heads", type=int, default=40)
  p.add_argument("--head-dim", type=int, default=128)
  p.add_argument("--target", type=float, default=0.42, help="fraction of tiles the rule should mark")
  p.add_argument("--length", type=float, default=6.0, help="the attention's reach, in tokens per axis")
  p.add_argument("--sharpness", type=float, default=2.0)
  p.add_argument("--implementation", default=None, help="skip kernel (default: the platform's, via plan.py)")
  p.add_argument("--repeats", type=int, default=5)
  p.add_argument("--inner", type=int, default=2)
  p.add_argument("--quick", action="store_true", help="tiny grid on the CPU, the Triton kernel in interpret mode")
  p.add_argument("--out", default=None)
  args = p.parse_args()
  if not 0.0 < args.target < 1.0:
    raise SystemExit(f"--target={args.target} must be in (0, 1)")
  interpret = args.quick
  if args.quick:
    args.grid, args.heads, args.head_dim, args.repeats, args.inner = [2, 8, 16], 2, 64, 2, 1
    args.length, args.sharpness = 1.0, 3.0  # a reach of a few tokens: some 64-token tiles are negligible
    args.implementation = "pallas_gpu"
  q, k, v = video_inputs(jax.random.PRNGKey(0), args.grid, args.heads, args.head_dim, length=args.length,
                         sharpness=args.sharpness, dtype=jnp.float32 if args.quick else jnp.bfloat16)
  state, thr, frac = rule_marks(q, k, v, target=args.target, implementation=args.implementation, interpret=interpret)
  # q, k, v are arguments, never closed over: captured, they become gigabytes of constants in every compile
  skip_call = lambda q, k, v, s, thr: diffusion.attention(q, k, v, s, thr=thr, implementation=args.implementation,
                                                          interpret=interpret)[0]
  dense = diffusion.attention(q, k, v, diffusion.SkipState(jnp.zeros_like(state.skip), state.calls), thr=-math.inf,
                              implementation=args.implementation, interpret=interpret)[0].astype(jnp.float32)
  skipped = skip_call(q, k, v, state, -math.inf).astype(jnp.float32)
  rel_l1 = float(jnp.mean(jnp.abs(skipped - dense)) / jnp.mean(jnp.abs(dense)))
  dense_kw = dict(causal=False, **(dict(implementation="pallas_gpu", interpret=True) if args.quick else {}))
  fns = {"clis": functools.partial(jax.jit(functools.partial(attention, stabilizer="clis", **dense_kw)), q, k, v),
         "skip@rule": functools.partial(jax.jit(skip_call, static_argnums=4), q, k, v, state, -math.inf),
         "skip_track@rule": functools.partial(jax.jit(skip_call), q, k, v, state, jnp.float32(-1e4))}
  if not args.quick:
    for name, stab in (("clis_mgpu", "clis"), ("online_mgpu", "online")):
      fns[name] = functools.partial(jax.jit(functools.partial(attention, causal=False, stabilizer=stab,
                                                              implementation="pallas_mgpu")), q, k, v)
    fns["cudnn"] = functools.partial(jax.jit(functools.partial(jax.nn.dot_product_attention, implementation="cudnn")),
                                     q, k, v)
  timings = benchmarking.interleaved_medians(fns, repeats=args.repeats, inner=args.inner)
  seq = q.shape[1]
  meta = benchmarking.device_meta()
  records = [dict(case=f"video_{'x'.join(map(str, args.grid))}_H{args.heads}_S{seq}", impl=name, **{"pass": "fwd"},
                  ms=med, ms_min=lo, ms_max=hi, B=1, S=seq, Hq=args.heads, Hkv=args.heads, D=args.head_dim,
                  causal=False, skipped=frac if "@" in name else 0.0, thr=thr, rel_l1_vs_dense=rel_l1,
                  length=args.length, sharpness=args.sharpness, repeat=args.repeats, inner=args.inner, **meta)
             for name, (med, lo, hi) in timings.items()]
  out = args.out or benchmarking.default_output("skip_rule_quick" if args.quick else "skip_rule")
  benchmarking.write_report(records, out)
  print(benchmarking.markdown_table(records))
  print(f"rule: thr {thr:.2f} marks {frac:.3f} of the tiles; skipped vs dense relative L1 {rel_l1:.2e}")
  for name in fns:
    if name != "skip@rule":
      print(f"skip@rule / {name}: {timings['skip@rule'][0] / timings[name][0]:.3f} of its time")
  print("wrote", out)


if __name__ == "__main__":
  main()
