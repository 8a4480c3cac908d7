"""Hashes of the Mosaic GPU forward's jaxprs (kernel bodies included, source locations not) over head dims 64 / 128 /
256 / MLA's 192-128, causal, bidirectional packed, causal packed, cap + window, the online loop and the XLA
certificate's, and BlockSizes.heads_per_cta=2 where it runs (online, head dims up to 128): run before and after a
change that must leave these paths untraced-different, and compare the files (as backward_jaxpr_hashes.py does for
the backward).

  PYTHONPATH=kernels:. python3 notes/experiments/forward_jaxpr_hashes.py /tmp/before.json
"""
import dataclasses
import hashlib
import json
import sys

import jax
import jax.numpy as jnp

from clis_kernels import SegmentIds, pallas_mgpu
from clis_kernels.plan import Mode
from clis_kernels.stabilizer import Certificate

out = {}
for d, dv, hkv in ((128, 128, 2), (64, 64, 2), (256, 256, 4), (192, 128, 4)):
  for causal, packed, kw in ((True, False, {}), (False, True, {}), (True, True, {}),
                             (True, False, dict(softcap=30.0, window=(100, 0)))):
    for mode, heads in ((Mode.ONLINE, None), (Mode.BLOCKS, None), (Mode.ONLINE, 2)):
      if heads and (d > 128 or d != dv):
        continue
      q = jax.ShapeDtypeStruct((1, 512, 8, d), jnp.bfloat16); k = jax.ShapeDtypeStruct((1, 512, hkv, d), jnp.bfloat16)
      v = jax.ShapeDtypeStruct((1, 512, hkv, dv), jnp.bfloat16)
      seg = jax.ShapeDtypeStruct((1, 512), jnp.int32) if packed else None
      tiles = dataclasses.replace(pallas_mgpu.default_block_sizes(d, 512, jnp.bfloat16), heads_per_cta=heads)

      def f(q, k, v, seg):
        ids = None if seg is None else SegmentIds(seg, seg)
        cert = None
        if mode == Mode.BLOCKS:
          z = jnp.zeros((1, 8, 512), jnp.float32)
          cert = Certificate(m=z, certified=jnp.ones((1, 8, 512 // 64), bool), upper=z, lower=z,
                             threshold=jnp.zeros((1, 8), jnp.float32))
        return pallas_mgpu.forward(q, k, v, ids, cert, mode=mode, causal=causal, scale=0.1, kv_len=None,
                                   block_sizes=tiles, **kw)
      text = str(jax.make_jaxpr(f)(q, k, v, seg))
      assert "wgmma" in text, text[:500]
      name = f"{d}/{dv} causal={causal} packed={packed} {sorted(kw)} {mode}" + (f" heads={heads}" if heads else "")
      out[name] = hashlib.sha256(text.encode()).hexdigest()[:16]
json.dump(out, open(sys.argv[1], "w"), indent=1)
