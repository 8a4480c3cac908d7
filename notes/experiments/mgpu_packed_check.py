"""H200 diagnosis: where the Mosaic GPU forward gives non-finite values on packed bidirectional inputs.

For a few packed cases, prints for clis and online which of (o, dq, dk, dv) has non-finite
entries, at which rows and heads, and the forward's largest difference from the Triton backend.

  python notes/experiments/mgpu_packed_check.py
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from clis_kernels import attention
from clis_kernels.testing import packed_segments, random_inputs

CASES = [("bidir_packed_mha_d64", 1, 640, 4, 4, 64, False), ("bidir_packed_mha_d128", 1, 640, 4, 4, 128, False),
         ("bidir_packed_gqa4_d128", 1, 1000, 8, 2, 128, False), ("causal_packed_mha_d64", 1, 640, 4, 4, 64, True)]

for name, b, s, hq, hkv, d, causal in CASES:
  seed = len("bidir_packed_mha_d64") if name == "bidir_packed_mha_d64" else len(name)
  q, k, v, do = random_inputs(seed, b, s, hq, hkv, d, jnp.bfloat16)
  seg = packed_segments(seed, b, s)
  print(name, "segment ids (every 32nd):", np.asarray(seg)[0, ::32].tolist())
  for stab in ("clis", "online"):
    f = lambda q, k, v, impl: attention(q, k, v, seg, causal=causal, stabilizer=stab, implementation=impl)
    out, vjp = jax.vjp(lambda q, k, v: f(q, k, v, "pallas_mgpu"), q, k, v)
    grads = vjp(do)
    triton = f(q, k, v, "pallas_gpu")
    diff = np.nanmax(np.abs(np.asarray(out, np.float32) - np.asarray(triton, np.float32)))
    report = []
    for label, x in zip(("o", "dq", "dk", "dv"), (out, *grads)):
      bad = ~np.isfinite(np.asarray(x, np.float32))
      if bad.any():
        idx = np.argwhere(bad)
        report.append(f"{label}: {bad.sum()} bad, rows {np.unique(idx[:, 1])[:12].tolist()} heads "
                      f"{np.unique(idx[:, 2]).tolist()}")
    print(f"  {stab}: max |o - triton| {diff:.3g}; " + ("; ".join(report) or "all finite"), flush=True)
