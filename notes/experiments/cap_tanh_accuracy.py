"""Soft cap on the Mosaic GPU kernels: errors against float64 of the forward and gradients with each
BlockSizes.soft_cap_tanh ("exp2": float32-accurate; "approx": tanh.approx.f32) and of the Triton kernels (jnp.tanh),
on causal GQA inputs scaled so that logits capped at 50 saturate. Run on the H200:
  python3 notes/experiments/cap_tanh_accuracy.py
"""

import jax
import jax.numpy as jnp

from clis_kernels import attention, pallas_mgpu, pallas_mgpu_vjp
from clis_kernels import reference_f64 as ref
from clis_kernels.testing import random_inputs

for cap, scale in ((50.0, 4.0), (30.0, 4.0), (50.0, 1.0)):
  q, k, v, do = random_inputs(7, 1, 2048, 8, 2, 128, jnp.bfloat16)
  q, k = q * scale, k * scale
  want = ref.attention(q, k, v, do, None, causal=True, softcap=cap)
  variants = {"triton": dict(implementation="pallas_gpu")}
  for tanh in pallas_mgpu.TANHS:
    variants[f"mgpu_{tanh}"] = dict(implementation="pallas_mgpu", block_sizes=pallas_mgpu.BlockSizes(soft_cap_tanh=tanh),
                                    backward_block_sizes=pallas_mgpu_vjp.BlockSizes(soft_cap_tanh=tanh))
  for name, kw in variants.items():
    for stabilizer in ("clis", "online"):
      f = lambda q, k, v: attention(q, k, v, causal=True, logits_soft_cap=cap, stabilizer=stabilizer, **kw)
      out, vjp = jax.vjp(f, q, k, v)
      errs = [ref.rel_err(x, w) for x, w in zip((out, *vjp(do)), want)]
      print(f"cap {cap:g} x{scale:g} {name:12s} {stabilizer:6s} o/dq/dk/dv rel err " + " ".join(f"{e:.2e}" for e in errs))
