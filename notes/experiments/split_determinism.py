"""Are the fused backward's split dQ gradients (BlockSizes(fused_dq=True, split_dq=True)) the same run to run? dK and
dV should be (each summed by one warpgroup in a fixed order); dQ is not (TMA reduce-adds in no fixed order). Runs each
step order three times on the GPU test's bidirectional packed case and prints which gradients differ from the first
run. (The overlapped-vs-default GPU test failed once on dK at 1 bf16 ulp, 2026-12-07.)

  PYTHONPATH=kernels:. python3 notes/experiments/split_determinism.py
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from clis_kernels import attention, pallas_mgpu_vjp
from clis_kernels.testing import packed_segments, random_inputs

q, k, v, do = random_inputs(23, 1, 1024, 8, 2, 128, jnp.bfloat16)  # seed: the GPU test case name's length
seg = packed_segments(23, 1, 1024)
base = pallas_mgpu_vjp.BlockSizes(fused_dq=True, split_dq=True)
for overlap in (False, True):
  tiles = dataclasses.replace(base, overlap_dq=overlap, overlap_dkv=overlap)
  f = jax.jit(lambda q, k, v, do: jax.vjp(lambda q, k, v: attention(
      q, k, v, seg, causal=False, implementation="pallas_mgpu", backward_block_sizes=tiles), q, k, v)[1](do))
  runs = [[np.asarray(g.astype(jnp.float32)) for g in f(q, k, v, do)] for _ in range(3)]
  for r, run in enumerate(runs[1:], 1):
    diff = [int((a != b).sum()) for a, b in zip(run, runs[0])]
    print(f"overlap={overlap} run {r} against run 0: elements differing in dq, dk, dv = {diff}", flush=True)
