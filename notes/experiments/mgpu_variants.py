"""H200 experiment: where the Mosaic GPU CLiS forward spends its time (notes/kernels.md, round 3).

Run 1-3 (row_sum knob, since removed): how a certified row sums its weights — "rounded"
(Σ f32(bf16(p)) on the vector units), "mma" (Σ bf16(p) by the tensor cores, p·ones[block_kv, 16]),
"f32" (Σ p before rounding, as the online path; committed). Runs 1-3 printed NaN for rounded/f32:
an edit had overwritten their M with −inf (the timings of those runs are still the kernels' cost,
the outputs were wrong); fixed before the final run, which times the committed kernel only.
Now (round 4): where an API call's time goes. Times, interleaved, the kernel alone (online loop;
certified loop from the XLA certificate; certified loop certifying in its prologue from the K/V
pre-pass, which is what the API runs), the API calls (clis, online), and the pre-passes alone;
prints each output's relative L2 difference from the online kernel's.

  python notes/experiments/mgpu_variants.py --out $OUT/mgpu_variants.json
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp

from clis_kernels import attention, pallas_mgpu, stabilizer
from clis_kernels.plan import Mode
from clis_train import benchmarking

CASES = {"causal_S8192_H32_8": (8192, 32, 8, True), "bidir_S32768_H12": (32768, 12, 12, False)}


def case_inputs(s, hq, hkv, d=128):
  """bf16 q, k, v [1, s, heads, d]; keys share a common component, as in trained models."""
  kq, kk, kv, kc = jax.random.split(jax.random.PRNGKey(0), 4)
  q = jax.random.normal(kq, (1, s, hq, d), jnp.bfloat16)
  k = (jax.random.normal(kk, (1, s, hkv, d)) + jax.random.normal(kc, (1, 1, hkv, d))).astype(jnp.bfloat16)
  return q, k, jax.random.normal(kv, (1, s, hkv, d), jnp.bfloat16)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--out", required=True)
  parser.add_argument("--repeats", type=int, default=15)
  parser.add_argument("--inner", type=int, default=10)
  args = parser.parse_args()
  records = []
  for case, (s, hq, hkv, causal) in CASES.items():
    q, k, v = case_inputs(s, hq, hkv)
    bs = pallas_mgpu.default_block_sizes(128, s, jnp.bfloat16)
    scale = 128 ** -0.5
    certify = jax.jit(lambda q, k, v: stabilizer.certify(q, k, v, None, causal=causal, scale=scale, tau=64.0,
                                                         granularity="tile", block_q=bs.tile, seq_len=s))
    key_bounds = jax.jit(lambda k, v: stabilizer.key_bounds(k, v, None, causal=causal, tau=64.0, block_q=bs.tile,
                                                            seq_len=s))
    cert, keys = certify(q, k, v), key_bounds(k, v)
    print(case, "certified fraction", float(cert.certified.mean()), flush=True)

    def kernel(stab=None, mode=Mode.ONLINE):
      f = jax.jit(lambda q, k, v, stab: pallas_mgpu.forward(
          q, k, v, None, stab, mode=mode, causal=causal, scale=scale, kv_len=None, block_sizes=bs, seq_len=s)[0])
      return lambda: f(q, k, v, stab)

    def api(stabilizer_name):
      f = jax.jit(lambda q, k, v: attention(q, k, v, causal=causal, stabilizer=stabilizer_name,
                                            implementation="pallas_mgpu"))
      return lambda: f(q, k, v)

    # kernel alone: online loop, certified loop from the XLA certificate ("cert") or certifying in its
    # prologue from the K/V pre-pass ("keys", what the API runs); the API calls; the pre-passes alone
    fns = {"online": kernel(), "clis_cert": kernel(cert, Mode.CERTIFICATE), "clis_keys": kernel(keys, Mode.KEYS),
           "api_online": api("online"), "api_clis": api("clis"), "key_bounds": lambda: key_bounds(k, v),
           "certify": lambda: certify(q, k, v)}
    base = fns["online"]().astype(jnp.float32)
    diffs = {}
    for name, fn in fns.items():
      if name not in ("key_bounds", "certify"):
        out = fn().astype(jnp.float32)
        diffs[name] = float(jnp.linalg.norm(out - base) / jnp.linalg.norm(base))
    timings = benchmarking.interleaved_medians(fns, repeats=args.repeats, inner=args.inner)
    for name, (med, lo, hi) in timings.items():
      ratio = timings["online"][0] / med
      print(f"{case:22s} {name:18s} {med:8.3f} ms [{lo:.3f}, {hi:.3f}]  online/this {ratio:.3f}  "
            f"diff vs online {diffs.get(name, float('nan')):.2e}", flush=True)
      records.append(dict(case=case, impl=name, ms=med, ms_min=lo, ms_max=hi, rel_diff_vs_online=diffs.get(name),
                          S=s, Hq=hq, Hkv=hkv, D=128, causal=causal, repeat=args.repeats, inner=args.inner,
                          **benchmarking.device_meta()))
    with open(args.out, "w") as f:
      json.dump(records, f, indent=1)


if __name__ == "__main__":
  main()
