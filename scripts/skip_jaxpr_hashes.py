"""Hashes of make_jaxpr(diffusion.attention) per backend x stabilizer x marking, to show a refactor of the
skip path changes nothing traced: run before and after, compare the JSON files."""

import argparse
import hashlib
import json
import math

import jax
import jax.numpy as jnp

from clis_kernels import diffusion
from clis_kernels import plan as plan_lib

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
args = parser.parse_args()
q = jax.ShapeDtypeStruct((1, 200, 4, 64), jnp.bfloat16)
k = jax.ShapeDtypeStruct((1, 200, 2, 64), jnp.bfloat16)
hashes = {}
for implementation, platform in (("reference", None), ("pallas_gpu", plan_lib.HOPPER), ("pallas_tpu", None),
                                 (None, plan_lib.HOPPER), (None, plan_lib.Platform("tpu"))):
  interpret = implementation in ("pallas_gpu", "pallas_tpu")
  for stabilizer in ("clis", "online"):
    for thr in (-math.inf, "traced"):
      def fn(q, k, v, t):
        plan = plan_lib.make_plan(dtype=q.dtype, head_dim=64, seq_len=200, skipping=True,
                                  implementation=implementation, interpret=interpret, platform=platform)
        state = diffusion.init_state(1, 4, 200, plan.block_sizes)
        return diffusion.attention(q, k, v, state, thr=t if thr == "traced" else thr, stabilizer_name=stabilizer,
                                   implementation=implementation, interpret=interpret, platform=platform)
      text = str(jax.make_jaxpr(fn)(q, k, k, jnp.float32(-10.0)))
      hashes[f"{implementation or 'auto-' + (platform.name if platform else 'cpu')}/{stabilizer}/{thr}"] = \
          hashlib.sha256(text.encode()).hexdigest()[:16]
json.dump(hashes, open(args.out, "w"), indent=1)
print(json.dumps(hashes, indent=1))
