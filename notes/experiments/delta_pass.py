"""Δ = rowsum(dO ∘ O), the backward's one XLA pass before its kernels, two ways, timed interleaved on the shapes the
backward profiles ran (scripts/profile_backward.py's "delta_and_args": ~1.0 ms at B·S = 32k, GQA 32/8, D 128, where
reading O and dO once is ~0.14 ms at 4 TB/s). einsum: the kernels' formulation until 2026-12-03 (a dot_general
with batch dims b, s, h and contraction d); product_sum: multiply and reduce over the head dim, then the [B, H, S]
transpose. The second is checked against the first. (profile_backward's "delta_and_args" also returns the kernels'
arguments, so it copies q, k, v, dO and lse too: this times Δ alone.)

  PYTHONPATH=kernels:. python3 notes/experiments/delta_pass.py --out /tmp/delta_pass.json
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp

from clis_train import benchmarking

SHAPES = {"gqa32_d128_8k": (4, 8192, 32, 128), "gqa32_d128_32k": (1, 32768, 32, 128), "d256_8k": (4, 8192, 16, 256),
          "mla_v128_8k": (4, 8192, 16, 128)}
WAYS = {
    "einsum": lambda o, do: jnp.einsum("bshd,bshd->bhs", o.astype(jnp.float32), do.astype(jnp.float32)),
    "product_sum": lambda o, do: jnp.swapaxes(jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32), -1), 1, 2),
}


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--repeats", type=int, default=7)
  parser.add_argument("--inner", type=int, default=5)
  parser.add_argument("--out", required=True)
  args = parser.parse_args()
  records = []
  for case, shape in SHAPES.items():
    ko, kd = jax.random.split(jax.random.PRNGKey(0))
    o, do = (jax.random.normal(key, shape, jnp.bfloat16) for key in (ko, kd))
    fns = {name: jax.jit(way) for name, way in WAYS.items()}
    want = fns["einsum"](o, do)
    for name, fn in fns.items():
      err = float(jnp.max(jnp.abs(fn(o, do) - want)) / jnp.max(jnp.abs(want)))
      assert err < 1e-5, (case, name, err)
    times = benchmarking.interleaved_medians({n: (lambda f=f: f(o, do)) for n, f in fns.items()},
                                             repeats=args.repeats, inner=args.inner)
    gb = 2 * o.size * o.dtype.itemsize / 1e9
    for name, (ms, lo, hi) in times.items():
      records.append(dict(case=case, impl=name, ms=ms, ms_min=lo, ms_max=hi, read_gb_per_s=gb / (ms / 1e3)))
      print(f"{case:16s} {name:14s} {ms:7.3f} ms [{lo:.3f}, {hi:.3f}]  {gb / (ms / 1e3):7.0f} GB/s of O and dO")
  with open(args.out, "w") as f:
    json.dump(dict(meta=benchmarking.device_meta(), records=records), f, indent=1)


if __name__ == "__main__":
  main()
