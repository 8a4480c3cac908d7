"""H200, one short call: the split-dQ fused backward (pallas_mgpu_vjp.BlockSizes(fused_dq=True, split_dq=True))
against the two-kernel backward (float64-tested) on small causal and bidirectional cases, then the backward's time
at causal B 4 x 8k (GQA 32/8, D 128) against the two kernels and the unsplit fused kernel, interleaved.
The full float64 test is tests/test_pallas_mgpu.py::test_mosaic_backward_matches_float64_on_gpu.

  python3 notes/experiments/split_dq_check.py --out $OUT/split_dq_check.json      # from the repository root
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp

from clis_kernels import attention, pallas_mgpu_vjp, testing
from clis_train import benchmarking
from notes.experiments.bwd_slots import backward

VARIANTS = {"two_kernel": pallas_mgpu_vjp.BlockSizes(fused_dq=False),
            "fused": pallas_mgpu_vjp.BlockSizes(fused_dq=True),
            "split": pallas_mgpu_vjp.BlockSizes(fused_dq=True, split_dq=True)}


def grads(bs, q, k, v, do, causal):
  f = lambda q, k, v: attention(q, k, v, causal=causal, implementation="pallas_mgpu", backward_block_sizes=bs)
  return jax.jit(lambda q, k, v, do: jax.vjp(f, q, k, v)[1](do))(q, k, v, do)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--out", required=True)
  args = parser.parse_args()
  records = []
  for causal in (True, False):
    q, k, v, do = testing.random_inputs(1, 1, 1000, 8, 2, 128, jnp.bfloat16)
    want = grads(VARIANTS["two_kernel"], q, k, v, do, causal)
    got = grads(VARIANTS["split"], q, k, v, do, causal)
    errs = [float(jnp.linalg.norm((g.astype(jnp.float32) - w.astype(jnp.float32)).ravel())
                  / jnp.linalg.norm(w.astype(jnp.float32).ravel())) for g, w in zip(got, want)]
    finite = all(bool(jnp.isfinite(g.astype(jnp.float32)).all()) for g in got)
    records.append(dict(check="split vs two kernels, S 1000", causal=causal, rel_diff_dq_dk_dv=errs, finite=finite))
    print(records[-1], flush=True)
  q, k, v, do = testing.random_inputs(0, 4, 8192, 32, 8, 128, jnp.bfloat16)
  fns = {name: backward(lambda q, k, v, bs=bs: attention(q, k, v, causal=True, backward_block_sizes=bs), q, k, v, do)
         for name, bs in VARIANTS.items()}
  for name, (med, lo, hi) in benchmarking.interleaved_medians(fns, repeats=5, inner=3).items():
    records.append(dict(case="causal_S8192_B4_H32-8_D128", impl=name, pass_="bwd", ms=med, ms_min=lo, ms_max=hi,
                        **benchmarking.device_meta()))
    print(f"bwd {name}: {med:.3f} ms [{lo:.3f}, {hi:.3f}]", flush=True)
  with open(args.out, "w") as f:
    json.dump(records, f, indent=1)


if __name__ == "__main__":
  main()
