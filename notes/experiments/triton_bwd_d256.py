"""Tiles of the Triton backward at head dim 256 (what runs after the Mosaic GPU forward above 128 on Hopper): forward +
backward of `implementation="pallas_mgpu_triton_bwd"` with several backward BlockSizes, timed interleaved, each
variant's gradients checked against the default tiles' (BENCHMARKS.md §1, head dim 256).

  PYTHONPATH=kernels:. python3 notes/experiments/triton_bwd_d256.py --out /tmp/triton_bwd_d256.json
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json

import jax
import jax.numpy as jnp

from clis_kernels import attention, pallas_gpu, testing
from clis_kernels import reference_f64 as ref
from clis_train import benchmarking

# name: (block_q_dq, block_k_dq, block_q_dkv, block_k_dkv, num_warps_bwd, num_stages_bwd)
VARIANTS = {
    "default_32_4w_1s": None,
    "dq64x32_dkv32x64_8w_1s": (64, 32, 32, 64, 8, 1),
    "dq64x32_dkv32x64_8w_2s": (64, 32, 32, 64, 8, 2),
    "all64_8w_1s": (64, 64, 64, 64, 8, 1),
    "all32_8w_2s": (32, 32, 32, 32, 8, 2),
    "dq128x32_dkv32x128_8w_1s": (128, 32, 32, 128, 8, 1),
}
# The second sweep (--sweep 2): around the first one's best
VARIANTS_2 = {
    "default_32_4w_1s": None,
    "all64_8w_1s": (64, 64, 64, 64, 8, 1),
    "all64_4w_1s": (64, 64, 64, 64, 4, 1),
    "dq64x64_dkv32x64_8w_1s": (64, 64, 32, 64, 8, 1),
    "dq64x64_dkv64x32_8w_1s": (64, 64, 64, 32, 8, 1),
}
FIELDS = ("block_q_dq", "block_k_dq", "block_q_dkv", "block_k_dkv", "num_warps_bwd", "num_stages_bwd")


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--seq", type=int, default=8192)
  parser.add_argument("--batch", type=int, default=4)
  parser.add_argument("--heads", type=int, nargs=2, default=[16, 8])
  parser.add_argument("--sweep", type=int, default=1, choices=[1, 2])
  parser.add_argument("--out", default=None)
  args = parser.parse_args()
  variants = VARIANTS if args.sweep == 1 else VARIANTS_2
  hq, hkv = args.heads
  q, k, v, do, _ = testing.inputs("sinks_many", args.batch, args.seq, hq, hkv, 256, dtype=jnp.bfloat16)
  default = pallas_gpu.default_block_sizes(256, args.seq, jnp.bfloat16)
  fns, grads = {}, {}
  for name, tiles in variants.items():
    bwd = default if tiles is None else dataclasses.replace(default, **dict(zip(FIELDS, tiles)))

    @jax.jit
    def step(q, k, v, do, bwd=bwd):
      out, vjp = jax.vjp(lambda a, b, c: attention(a, b, c, causal=True, implementation="pallas_mgpu_triton_bwd",
                                                    backward_block_sizes=bwd), q, k, v)
      return vjp(do)
    try:
      grads[name] = jax.block_until_ready(step(q, k, v, do))
    except Exception as e:  # noqa: BLE001 — a tile that does not fit is reported and left out
      print(f"{name}: {type(e).__name__}: {str(e)[:200]}")
      continue
    fns[name] = functools.partial(step, q, k, v, do)
  timed = benchmarking.interleaved_medians(fns, repeats=5, inner=2)
  base = timed["default_32_4w_1s"][0]
  records = []
  for name, (ms, lo, hi) in timed.items():
    err = max(ref.rel_err(g, w) for g, w in zip(grads[name], grads["default_32_4w_1s"]))
    records.append(dict(variant=name, tiles=variants[name], fwd_bwd_ms=ms, ms_min=lo, ms_max=hi, speedup=base / ms,
                        max_rel_diff_vs_default=err, S=args.seq, B=args.batch, Hq=hq, Hkv=hkv, D=256,
                        **benchmarking.device_meta()))
    print(f"{name:28s} {ms:8.2f} ms [{lo:.2f}, {hi:.2f}]  {base / ms:.3f}x default  grads vs default {err:.2e}")
  if args.out:
    with open(args.out, "w") as f:
      json.dump(records, f, indent=1)


if __name__ == "__main__":
  main()
