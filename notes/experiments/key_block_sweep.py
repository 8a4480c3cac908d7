"""Keys per block centre (stabilizer.KEY_BLOCK) for the block bound on a GPU: forward time of the Mosaic GPU
kernel with bound="blocks" at 16 / 32 / 64 keys per centre against its online forward, and the certified
fraction of each, on Gaussian and pretrained-like inputs. GQA 32/8, D 128, bf16, B x S = 32k tokens;
interleaved medians (ms).

  python3 notes/experiments/key_block_sweep.py --out $OUT/key_block_sweep.json
"""

import argparse
import json

import jax

from clis_train import benchmarking
from clis_kernels import attention, stabilizer, testing

KEY_BLOCKS = (16, 32, 64)


def call(key_block, stabilizer_name, causal, seg):
  """A jitted forward whose block bound uses `key_block` keys per centre (read when it is traced)."""
  def fwd(q, k, v):
    stabilizer.KEY_BLOCK = key_block
    return attention(q, k, v, seg, causal=causal, stabilizer=stabilizer_name, bound="blocks",
                     implementation="pallas_mgpu", return_stats=True)
  return jax.jit(fwd)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--seq-lens", type=int, nargs="+", default=[16384, 32768])
  parser.add_argument("--families", nargs="+", default=["gaussian", "outlier_channels", "sinks_many"])
  parser.add_argument("--out", required=True)
  args = parser.parse_args()
  records = []
  for s in args.seq_lens:
    for causal in (True, False):
      for family in args.families:
        batch = max(1, 32768 // s)
        if family == "gaussian":
          q, k, v, _ = testing.random_inputs(s, batch, s, 32, 8, 128, jax.numpy.bfloat16)
          seg = None
        else:
          q, k, v, _, seg = testing.inputs(family, batch, s, 32, 8, 128)
        fns, certified = {"online": call(16, "online", causal, seg)}, {}
        for kb in KEY_BLOCKS:
          fns[f"blocks{kb}"] = call(kb, "clis", causal, seg)
        for name, fn in fns.items():
          certified[name] = float(fn(q, k, v)[1].certified_fraction)
        times = benchmarking.interleaved_medians({n: (lambda f=f: f(q, k, v)) for n, f in fns.items()},
                                                 repeats=7, inner=5)
        for name, (med, lo, hi) in times.items():
          records.append(dict(S=s, B=batch, causal=causal, family=family, variant=name, ms=med, ms_min=lo, ms_max=hi,
                              certified=certified[name], vs_online=times["online"][0] / med))
          print(records[-1], flush=True)
  stabilizer.KEY_BLOCK = 16
  json.dump(dict(records=records, **benchmarking.device_meta()), open(args.out, "w"), indent=1)


if __name__ == "__main__":
  main()
