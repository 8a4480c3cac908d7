"""H200: the Mosaic GPU two-kernel backward at head dim 128 with 2, 3 or 4 streamed blocks in flight
(`pallas_mgpu_vjp.BlockSizes.slots`), against cuDNN's backward, interleaved in one run.

The backward's slots were never swept (the forward's were, notes/kernels.md round 3). At D 128 the dQ kernel
streams 64-key K/V blocks (32 KB a slot) beside 64 KB of Q/dO, the dK/dV kernel 64-row Q/dO blocks beside
64 KB of K/V, so 3 and 4 slots fit in the H200's 227 KB. A config that does not compile is reported and left
out. The backward alone: the forward's residuals are made once, outside the timing.

  python notes/experiments/bwd_slots.py --out $OUT/bwd_slots.json      # from the repository root
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp

from clis_kernels import attention, pallas_mgpu_vjp, testing
from clis_train import benchmarking

CASES = {"causal_S8192_B4": (4, 8192), "causal_S32768_B1": (1, 32768)}  # GQA 32/8, D 128, 32k tokens


def backward(f, q, k, v, do):
  """A zero-argument function running f's backward alone at (q, k, v) with cotangent do."""
  vjp_fn = jax.jit(lambda q, k, v: jax.vjp(f, q, k, v)[1])(q, k, v)
  run = jax.jit(lambda fn, do: fn(do))
  return lambda: run(vjp_fn, do)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--out", required=True)
  parser.add_argument("--repeats", type=int, default=7)
  parser.add_argument("--inner", type=int, default=3)
  args = parser.parse_args()
  records = []
  for case, (b, s) in CASES.items():
    q, k, v, do = testing.random_inputs(0, b, s, 32, 8, 128, jnp.bfloat16)
    fns = {"cudnn": backward(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                                          implementation="cudnn"), q, k, v, do)}
    for slots in (2, 3, 4):
      bs = pallas_mgpu_vjp.BlockSizes(slots=slots, fused_dq=False)
      fn = backward(lambda q, k, v, bs=bs: attention(q, k, v, causal=True, backward_block_sizes=bs), q, k, v, do)
      try:
        jax.block_until_ready(fn())
        fns[f"slots{slots}"] = fn
      except Exception as e:  # noqa: BLE001 — shared memory overflow shows up at compile time
        print(f"{case} slots={slots} left out: {type(e).__name__}: {str(e)[:200]}", flush=True)
    for name, (med, lo, hi) in benchmarking.interleaved_medians(fns, repeats=args.repeats, inner=args.inner).items():
      records.append(dict(case=case, impl=name, ms=med, ms_min=lo, ms_max=hi, B=b, S=s, Hq=32, Hkv=8, D=128,
                          **benchmarking.device_meta()))
      print(f"{case} {name}: {med:.3f} ms [{lo:.3f}, {hi:.3f}]", flush=True)
  with open(args.out, "w") as f:
    json.dump(records, f, indent=1)


if __name__ == "__main__":
  main()
