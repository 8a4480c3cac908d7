"""The Hopper backward split into its parts, each timed alone against cuDNN's whole backward: Δ = rowsum(dO ∘ O)
and the kernels' arguments (XLA), the dQ kernel, the dK/dV kernel, and our whole backward (all of it), each in
TFLOP/s, variants interleaved (clis_train/benchmarking.py). Work counts each part's matmuls, 2·B·Hq·S² times the
head dim each contracts or produces (half when causal): dQ kernel S, dP, dQ (2·D + Dv), dK/dV kernel S, dP, dV, dK
(2·D + 2·Dv), whole backward 3·D + 2·Dv; with Dv = D these are 1.5, 2 and 2.5 forward's worth. --value-dim gives v
and dO their own head dim (MLA: --heads 16 16 192 --value-dim 128), compared with tokamax's backward where cuDNN
refuses it.

  python scripts/profile_backward.py --seq-lens 8192 16384 32768 --tokens 32768 --out benchmarks/results/x.json
"""

from __future__ import annotations

import argparse
import dataclasses
import functools

import jax
import jax.numpy as jnp

from clis_kernels import masks, pallas_mgpu_vjp, plan as plan_lib
from clis_train import benchmarking


def _case(b, s, hq, hkv, d, causal, packed, fused, seed=0, dv=None, softcap=None, overlap=False):
  """{part: zero-argument callable} for one shape, the forward's o and lse made once beforehand; the backward and its
  kernels at the library's default tiles (fused or not as asked). With overlap, each kernel in every step order
  instead: serial (overlap_dq, overlap_dkv, dv_with_dp off), overlapped (*_overlap: S and dP issued together, dV with
  dK), and the dK/dV kernel with dV's wgmma behind dP's in each (*_dv_with_dp: tokamax's order;
  *_overlap_dv_with_dp)."""
  dv = d if dv is None else dv
  kq, kk, kv, kd, kc = jax.random.split(jax.random.PRNGKey(seed), 5)
  q = jax.random.normal(kq, (b, s, hq, d), jnp.bfloat16)
  k = (jax.random.normal(kk, (b, s, hkv, d)) + jax.random.normal(kc, (1, 1, hkv, d))).astype(jnp.bfloat16)
  v = jax.random.normal(kv, (b, s, hkv, dv), jnp.bfloat16)
  do = jax.random.normal(kd, (b, s, hq, dv), jnp.bfloat16)
  seg = None
  if packed:  # documents of ~1000 tokens, as bench_attention's --doc-len 1000
    ids = jnp.cumsum(jax.random.bernoulli(kc, 1e-3, (b, s)).astype(jnp.int32), axis=1) + 1
    seg = masks.SegmentIds(ids, ids)
  default = pallas_mgpu_vjp.default_block_sizes(d, s, q.dtype, softcap=softcap)
  default = dataclasses.replace(default, fused_dq=fused, dv_with_dp=default.dv_with_dp and not fused)
  plan = plan_lib.make_plan(dtype=q.dtype, head_dim=d, value_head_dim=dv, seq_len=s, stabilizer="online", causal=causal,
                            packed=packed, implementation="pallas_mgpu", backward_block_sizes=default)
  scale = d ** -0.5
  o, lse, _ = jax.jit(lambda q, k, v, seg: plan.backend.forward(
      q, k, v, seg, None, mode=plan.mode, causal=causal, scale=scale, kv_len=None, block_sizes=plan.block_sizes,
      window=None, softcap=softcap, interpret=False))(q, k, v, seg)
  bs = plan.backward_block_sizes
  launches = lambda q, k, v, seg, o, lse, do, bs=bs: pallas_mgpu_vjp.Launches(
      q, k, v, seg, o, lse, do, causal=causal, scale=scale, kv_len=None, block_sizes=bs, softcap=softcap)
  args = (q, k, v, seg, o, lse, do)
  parts = {
      "delta_and_args": jax.jit(lambda *a: (launches(*a).dq_args, launches(*a).dkv_args)),
      "backward": jax.jit(lambda *a: pallas_mgpu_vjp.backward(*a, causal=causal, scale=scale, kv_len=None,
                                                               block_sizes=bs, softcap=softcap)),
  }
  for name, (method, tiles) in kernel_parts(bs, fused=fused, overlap=overlap).items():
    parts[name] = jax.jit(lambda *a, t=tiles, m=method: getattr(launches(*a, bs=t), m)())
  fns = {name: functools.partial(f, *args) for name, f in parts.items()}
  if not packed and softcap is None:  # cuDNN's backward alone (tokamax's where cuDNN takes no such v), from its own
    # forward's residuals
    if dv == d:
      other, name = (lambda a, b_, c: jax.nn.dot_product_attention(a, b_, c, is_causal=causal,
                                                                   implementation="cudnn")), "cudnn_backward"
    else:
      import tokamax  # optional: scripts/h200/env.sh installs it from .whl/
      other, name = (lambda a, b_, c: tokamax.dot_product_attention(a, b_, c, is_causal=causal,
                                                                    implementation="mosaic")), "tokamax_backward"
    vjp = jax.jit(lambda q, k, v: jax.vjp(other, q, k, v)[1])(q, k, v)
    fns[name] = functools.partial(jax.jit(lambda fn, do: fn(do)), vjp, do)
  return fns


def kernel_parts(bs: pallas_mgpu_vjp.BlockSizes, *, fused: bool, overlap: bool):
  """{part name: (the Launches method that runs it, its BlockSizes)}: the kernels at `bs`; with overlap, each kernel in
  every step order instead (see `_case`)."""
  orders = [("", bs)]
  if overlap:
    orders = [(name, dataclasses.replace(bs, overlap_dq=on, overlap_dkv=on, dv_with_dp=False))
              for name, on in (("", False), ("_overlap", True))]
  parts = {}
  for suffix, order in orders:
    if fused:
      parts["fused_kernel" + suffix] = ("fused", order)
      continue
    parts["dq_kernel" + suffix] = ("dq", order)
    parts["dkv_kernel" + suffix] = ("dkv", order)
    if overlap:  # dV's wgmma behind dP's (BlockSizes.dv_with_dp)
      parts[f"dkv_kernel{suffix}_dv_with_dp"] = ("dkv", dataclasses.replace(order, dv_with_dp=True))
  return parts


def work_dims(name: str, d: int, dv: int) -> int | None:
  """The head dims a part's matmuls sum to (each matmul is 2·B·Hq·S² times its dim, half when causal)."""
  return {"delta_and_args": None, "dq_kernel": 2 * d + dv, "dkv_kernel": 2 * d + 2 * dv}.get(
      name.removesuffix("_dv_with_dp").removesuffix("_overlap"), 3 * d + 2 * dv)


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--seq-lens", type=int, nargs="+", default=[8192, 16384, 32768])
  parser.add_argument("--tokens", type=int, default=32768, help="batch = tokens // S")
  parser.add_argument("--heads", type=int, nargs=3, default=[32, 8, 128], metavar=("HQ", "HKV", "D"))
  parser.add_argument("--value-dim", type=int, default=None, metavar="DV", help="v's head dim (MLA), default D")
  parser.add_argument("--causal", choices=["yes", "no"], default="yes")
  parser.add_argument("--packed", action="store_true", help="documents of ~1000 tokens (no cuDNN comparison)")
  parser.add_argument("--fused", action="store_true", help="the one-kernel backward instead of the two kernels")
  parser.add_argument("--softcap", type=float, default=None, help="logits soft cap c (no cuDNN comparison)")
  parser.add_argument("--overlap", action="store_true",
                      help="also time each kernel with BlockSizes(overlap_dq=True, overlap_dkv=True), interleaved")
  parser.add_argument("--repeats", type=int, default=9)
  parser.add_argument("--inner", type=int, default=3)
  parser.add_argument("--out", default=None)
  args = parser.parse_args()
  hq, hkv, d = args.heads
  dv = args.value_dim or d
  causal = args.causal == "yes"
  meta, records = benchmarking.device_meta(), []
  for s in args.seq_lens:
    b = max(1, args.tokens // s)
    fns = _case(b, s, hq, hkv, d, causal, args.packed, args.fused, dv=dv, softcap=args.softcap, overlap=args.overlap)
    samples = benchmarking.interleaved_samples(fns, repeats=args.repeats, inner=args.inner)
    per_dim = 2 * b * hq * s * s * (0.5 if causal else 1.0)  # one matmul's FLOPs per unit of head dim
    case = (f"bwd_parts_{'causal' if causal else 'bidir'}{'_packed' if args.packed else ''}_H{hq}-{hkv}_D{d}"
            f"{'' if dv == d else f'_Dv{dv}'}{'' if args.softcap is None else f'_cap{args.softcap:g}'}_S{s}")
    for name, ms in samples.items():  # each round's samples stay in the JSON: orders compare round by round
      med, lo, hi = benchmarking.spread(ms)
      dims = work_dims(name, d, dv)
      tflops = None if dims is None else dims * per_dim / med / 1e9
      records.append(dict(case=case, impl=name, **{"pass": "bwd"}, ms=med, ms_min=lo, ms_max=hi, tflops=tflops, B=b,
                          S=s, Hq=hq, Hkv=hkv, D=d, Dv=dv, causal=causal, packed=args.packed, fused=args.fused,
                          repeat=args.repeats, inner=args.inner, samples_ms=ms, **meta))
      print(f"{case} {name}: {med:.3f} ms [{lo:.3f}, {hi:.3f}]" + ("" if tflops is None else f"  {tflops:.0f} TFLOP/s"),
            flush=True)
  out = args.out or benchmarking.default_output("profile_backward")
  benchmarking.write_report(records, out)
  print(benchmarking.markdown_table(records))


if __name__ == "__main__":
  main()
