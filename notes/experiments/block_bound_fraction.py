"""Certified fraction of the one-radius bound (stabilizer.certify) against the block bound
(stabilizer.certify_blocks: block centres, exceptional keys, the own block scored exactly) on the
pretrained-like families (clis_kernels.testing), at the issue-16 shapes: causal 8k (B 2, GQA 32/8,
D 128) and bidirectional 32k (B 1, H 12, D 128), bf16, tiles of 64 (the Mosaic GPU kernel's).
The certificate is pure JAX, so this runs anywhere (it ran on the CPU).

  python3 notes/experiments/block_bound_fraction.py --out block_bound_fraction.json [--taus 64 96 128]
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import sys
import time

import jax
import numpy as np

from clis_kernels import stabilizer, testing
from clis_kernels.stabilizer import LOG2E

CASES = [("causal_8k", True, 2, 8192, 32, 8), ("bidirectional_32k", False, 1, 32768, 12, 12)]


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default="block_bound_fraction.json")
  parser.add_argument("--families", nargs="*", default=list(testing.FAMILIES))
  parser.add_argument("--taus", type=float, nargs="+", default=[64.0], help="the block bound's tau (nats), each")
  parser.add_argument("--key-blocks", type=int, nargs="*", default=[], help="also: the block bound at these keys "
                      "per centre (stabilizer.KEY_BLOCK is the default), each")
  parser.add_argument("--real", action="store_true", help="also the real-activation sample (tests/data), 768 tokens")
  args = parser.parse_args()
  records = []
  for name, causal, b, s, hq, hkv in CASES:
    for family in args.families:
      q, k, v, _, seg = testing.inputs(family, b, s, hq, hkv, 128)
      kw = dict(causal=causal, scale=128 ** -0.5, tau=64.0, granularity="tile", block_q=64, seq_len=s)
      t0 = time.time()
      radius = jax.jit(lambda q, k, v, seg: stabilizer.certify(q, k, v, seg, **kw))(q, k, v, seg)
      by_tau = {tau: jax.jit(lambda q, k, v, seg, tau=tau: stabilizer.certify_blocks(q, k, v, seg, **{**kw, "tau": tau}))(
          q, k, v, seg) for tau in args.taus}
      blocks = by_tau[args.taus[0]]
      by_key_block = {kb: float(jax.jit(lambda q, k, v, seg, kb=kb: stabilizer.certify_blocks(
          q, k, v, seg, key_block=kb, **kw))(q, k, v, seg).certified.mean()) for kb in args.key_blocks}
      gap = lambda c: np.asarray(c.upper - c.lower, np.float64) / LOG2E
      records.append(dict(case=name, family=family, radius_certified=float(radius.certified.mean()),
                          blocks_certified=float(blocks.certified.mean()),
                          blocks_certified_by_tau={str(t): float(c.certified.mean()) for t, c in by_tau.items()},
                          blocks_certified_by_key_block={str(kb): f for kb, f in by_key_block.items()},
                          radius_gap_nats_p50=float(np.median(gap(radius))),
                          blocks_gap_nats_p50=float(np.median(gap(blocks))),
                          blocks_gap_nats_p99=float(np.percentile(gap(blocks), 99)), seconds=time.time() - t0))
      print(json.dumps(records[-1]), flush=True)
  if args.real:
    records += real_sample(args.key_blocks)
  with open(args.out, "w") as f:
    json.dump(dict(command="python3 notes/experiments/block_bound_fraction.py " + " ".join(sys.argv[1:]),
                   device=jax.devices()[0].device_kind,
                   jax_version=jax.__version__, date=datetime.date.today().isoformat(), records=records), f, indent=1)


def real_sample(key_blocks):
  """Certified fractions (radius; blocks at the default and each key block) on the trained layers' q, k, v
  (tests/data/real_small_qkv.safetensors: 768 tokens of one source file, GQA 3, D 64), causal."""
  from safetensors.numpy import load_file
  tensors = load_file(str(pathlib.Path(__file__).parents[2] / "tests" / "data" / "real_small_qkv.safetensors"))
  records = []
  for layer in sorted({int(name.split(".")[0].removeprefix("layer_")) for name in tensors if name.startswith("layer_")}):
    q, k, v = (jax.numpy.asarray(tensors[f"layer_{layer}.{x}"], jax.numpy.bfloat16) for x in "qkv")
    kw = dict(causal=True, scale=q.shape[-1] ** -0.5, tau=64.0, granularity="tile", block_q=64, seq_len=q.shape[1])
    record = dict(case=f"real_layer{layer}_S{q.shape[1]}", family="real",
                  radius_certified=float(stabilizer.certify(q, k, v, None, **kw).certified.mean()),
                  blocks_certified=float(stabilizer.certify_blocks(q, k, v, None, **kw).certified.mean()),
                  blocks_certified_by_key_block={str(kb): float(stabilizer.certify_blocks(
                      q, k, v, None, key_block=kb, **kw).certified.mean()) for kb in key_blocks})
    records.append(record)
    print(json.dumps(record), flush=True)
  return records


if __name__ == "__main__":
  main()
