"""H200 experiment: where the K/V pre-pass (stabilizer.key_bounds) spends its time.

Times, interleaved, the whole pre-pass and its parts on the two benchmark cases (padded as the
Mosaic GPU API pads, tile 64): the centre as the median of block means (committed at the time) or as a
plain mean, the radius (deviation norms, per-block max, causal prefix max), the headroom.

  python notes/experiments/prepass_profile.py --out $OUT/prepass_profile.json
"""

from __future__ import annotations

import argparse
import functools
import json

import jax
import jax.numpy as jnp

from clis_kernels import stabilizer
from clis_train import benchmarking
from notes.experiments.mgpu_variants import CASES, case_inputs


def parts(k, v, causal, block_q=64):
  """{name: f(k, v)}."""
  batch, sk, hkv, d = k.shape
  nb = sk // block_q

  def median_centre(kf):
    return jnp.nanmedian(kf.reshape(batch, nb, block_q, hkv, d).mean(2), axis=1, keepdims=True)

  def mean_centre(kf):
    return kf.mean(1, keepdims=True)

  def radius(kf, centre):
    per_block = jnp.linalg.norm(kf - centre, axis=-1).reshape(batch, nb, block_q, hkv).max(2).transpose(0, 2, 1)
    if causal:
      return jax.lax.cummax(per_block, axis=2)
    return per_block.max(-1, keepdims=True)

  return {
      "key_bounds": lambda k, v: stabilizer.key_bounds(k, v, None, causal=causal, tau=64.0, block_q=block_q,
                                                       seq_len=sk),
      "centre_median": lambda k, v: median_centre(k.astype(jnp.float32)),
      "centre_mean": lambda k, v: mean_centre(k.astype(jnp.float32)),
      "radius_cummax": lambda k, v: radius(k.astype(jnp.float32), mean_centre(k.astype(jnp.float32))),
      "mean_centre_bounds": lambda k, v: (radius(k.astype(jnp.float32), mean_centre(k.astype(jnp.float32))),
                                          stabilizer.headroom_and_floor(v, segment_ids=None, seq_len=sk)[0]),
      "headroom": lambda k, v: stabilizer.headroom_and_floor(v, segment_ids=None, seq_len=sk)[0],
  }


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--out", required=True)
  args = parser.parse_args()
  records = []
  for case, (s, hq, hkv, causal) in CASES.items():
    _, k, v = case_inputs(s, hq, hkv)
    fns = {name: functools.partial(jax.jit(f), k, v) for name, f in parts(k, v, causal).items()}
    timings = benchmarking.interleaved_medians(fns, repeats=15, inner=20)
    for name, (med, lo, hi) in timings.items():
      records.append(dict(case=case, part=name, ms=med, ms_min=lo, ms_max=hi, **benchmarking.device_meta()))
      print(f"{case:22s} {name:14s} {med:.4f} ms [{lo:.4f}, {hi:.4f}]", flush=True)
  with open(args.out, "w") as f:
    json.dump(records, f, indent=1)


if __name__ == "__main__":
  main()
