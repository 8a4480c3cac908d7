"""Hashes of the Mosaic GPU backward's jaxprs (kernel bodies included, source locations not) over head dims 64 / 128 /
256 / MLA's 192-128, causal, bidirectional packed, causal packed, cap + window, and each backward choice in each step
order (BlockSizes.overlap_dq and overlap_dkv off, then both on, then each with dv_with_dp where the kernel takes it): run before and after a refactor that must change nothing traced,
and compare the two files (the lowered text cannot serve: the serialized kernels carry source line numbers).

  PYTHONPATH=kernels:. python3 notes/experiments/backward_jaxpr_hashes.py /tmp/before.json
"""
import dataclasses
import hashlib
import json
import sys

import jax
import jax.numpy as jnp

from clis_kernels import SegmentIds, pallas_mgpu_vjp
B = pallas_mgpu_vjp.BlockSizes
cases = []
for d, dv, hkv in ((128, 128, 2), (64, 64, 2), (256, 256, 4), (192, 128, 4)):
  for causal, packed, kw in ((True, False, {}), (False, True, {}), (True, True, {}),
                             (True, False, dict(softcap=30.0, window=(100, 0)))):
    tiles = [B()]
    if d == 128:
      tiles += [B(fused_dq=True), B(fused_dq=True, split_dq=True)]
    if d == 64:
      tiles = [B(), B(fused_dq=True)]
    overlapped = [dataclasses.replace(t, overlap_dq=True, overlap_dkv=True) for t in tiles]
    # dV behind dP (dv_with_dp) where the kernel takes it: with overlap, the order overlap_dkv alone had until 2026-12-07
    moved = [dataclasses.replace(t, dv_with_dp=True) for t in tiles + overlapped if not t.fused_dq]
    for t in tiles + overlapped + moved:
      cases.append((d, dv, hkv, causal, packed, kw, t))
out = {}
for d, dv, hkv, causal, packed, kw, t in cases:
  q = jax.ShapeDtypeStruct((1, 512, 8, d), jnp.bfloat16); k = jax.ShapeDtypeStruct((1, 512, hkv, d), jnp.bfloat16)
  v = jax.ShapeDtypeStruct((1, 512, hkv, dv), jnp.bfloat16); o = jax.ShapeDtypeStruct((1, 512, 8, dv), jnp.bfloat16)
  lse = jax.ShapeDtypeStruct((1, 8, 512), jnp.float32)
  seg = jax.ShapeDtypeStruct((1, 512), jnp.int32) if packed else None
  def f(q, k, v, o, lse, do, seg):
    ids = None if seg is None else SegmentIds(seg, seg)
    return pallas_mgpu_vjp.backward(q, k, v, ids, o, lse, do, causal=causal, scale=0.1, kv_len=None, block_sizes=t, **kw)
  text = str(jax.make_jaxpr(f)(q, k, v, o, lse, o, seg))
  assert "wgmma" in text, text[:500]
  out[f"{d}/{dv} causal={causal} packed={packed} {sorted(kw)} {t}"] = hashlib.sha256(text.encode()).hexdigest()[:16]
json.dump(out, open(sys.argv[1], "w"), indent=1)
print(len(out), "cases")
