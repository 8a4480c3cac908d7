"""Hashes of make_jaxpr(forward + backward) for every backend and mode, to show that a refactor
leaves what the kernels compute unchanged (issue 15). CPU: the Pallas backends in interpret mode;
the Mosaic GPU kernels are traced for an H200 without running (tracing needs no GPU).

  python3 scripts/jaxpr_hashes.py --out before.json   # then after the change: --out after.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re

import jax
import jax.numpy as jnp

from clis_kernels import SegmentIds, attention

# (backend, interpret): the Mosaic GPU backend is only traced (interpret mode does not exist for it)
BACKENDS = [("reference", False), ("pallas_tpu", True), ("pallas_gpu", True), ("pallas_mgpu", False)]
MODES = {
    "clis_radius": dict(stabilizer="clis"),
    "clis_head": dict(stabilizer="clis", granularity="head"),
    "clis_blocks": dict(stabilizer="clis", bound="blocks"),
    "online": dict(stabilizer="online"),
}
TRACE_AS_GPU = [False]
LAYOUTS = {"causal": dict(causal=True), "causal_packed": dict(causal=True, packed=True),
           "bidirectional": dict(causal=False), "bidirectional_separate_ids": dict(causal=False, separate=True)}


def _inputs(b=1, s=256, hq=4, hkv=2, d=64):
  keys = jax.random.split(jax.random.PRNGKey(0), 4)
  q = jax.random.normal(keys[0], (b, s, hq, d), jnp.bfloat16)
  k = jax.random.normal(keys[1], (b, s, hkv, d), jnp.bfloat16)
  v = jax.random.normal(keys[2], (b, s, hkv, d), jnp.bfloat16)
  seg = jnp.where(jnp.arange(s) < s // 2, 1, 2)[None].repeat(b, 0).astype(jnp.int32)
  return q, k, v, seg


def _hash(backend, interpret, mode, layout):
  q, k, v, seg = _inputs()
  kw = dict(MODES[mode], causal=LAYOUTS[layout]["causal"], implementation=backend, interpret=interpret)
  from clis_kernels import api
  if not hasattr(api, "_platform"):  # after issue 15: the platform is a parameter
    from clis_kernels import plan
    kw["platform"] = plan.HOPPER if backend == "pallas_mgpu" else plan.Platform("cpu")
  ids = None
  if LAYOUTS[layout].get("packed"):
    ids = seg
  if LAYOUTS[layout].get("separate"):
    ids = SegmentIds(q=seg, kv=seg)

  def loss(q, k, v):
    return attention(q, k, v, ids, **kw).astype(jnp.float32).sum()

  text = str(jax.make_jaxpr(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, k, v))
  text = re.sub(r" at 0x[0-9a-f]+", "", text)  # object addresses in printed callables
  return hashlib.sha256(text.encode()).hexdigest()[:16]


def main():
  from clis_kernels import api
  if hasattr(api, "_platform"):  # before issue 15: the platform was read inside api, not passed in
    api._platform = lambda: "gpu" if TRACE_AS_GPU[0] else "cpu"
    api._gpu_is_hopper = lambda: TRACE_AS_GPU[0]
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", required=True)
  args = parser.parse_args()
  hashes = {}
  for backend, interpret in BACKENDS:
    TRACE_AS_GPU[0] = backend == "pallas_mgpu"
    for mode in MODES:
      for layout in LAYOUTS:
        name = f"{backend}/{mode}/{layout}"
        try:
          hashes[name] = _hash(backend, interpret, mode, layout)
        except Exception as e:  # a combination the backend refuses: its message is part of the record
          hashes[name] = f"error: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
        print(name, hashes[name], flush=True)
  with open(args.out, "w") as f:
    json.dump(hashes, f, indent=1, sort_keys=True)


if __name__ == "__main__":
  main()
