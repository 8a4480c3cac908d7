"""Where the block bound's pre-pass spends its time on a GPU: the pass over K (stabilizer.block_bounds, XLA),
the (U, L) kernel (pallas_gpu_bounds) at several BlockSizes, the whole certify_blocks, and the radius bound's
K/V pass for scale.
Causal, GQA 32/8, D 128, bf16, B x S = 32k tokens, outlier_channels inputs; interleaved medians (ms).

  python3 notes/experiments/blocks_prepass_profile.py --out $OUT/blocks_prepass.json
"""

import argparse
import functools
import json

import jax

from clis_train import benchmarking
from clis_kernels import pallas_gpu_bounds, stabilizer, testing


TILES = [pallas_gpu_bounds.BlockSizes(rows=r, heads=h, centres=c, num_warps=w, num_stages=st) for r, h, c, w, st in
         [(64, 4, 64, 4, 2), (64, 4, 128, 4, 2), (128, 4, 64, 8, 2), (128, 4, 128, 8, 2), (64, 1, 64, 4, 2)]]


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--seq-lens", type=int, nargs="+", default=[2048, 8192, 32768])
  parser.add_argument("--key-block", type=int, default=16)
  parser.add_argument("--out", required=True)
  args = parser.parse_args()
  scale, records = 128 ** -0.5, []
  for s in args.seq_lens:
    for causal in (True, False):
      q, k, v, _, _ = testing.inputs("outlier_channels", max(1, 32768 // s), s, 32, 8, 128)
      bounds_fn = jax.jit(functools.partial(stabilizer.block_bounds, segment_ids=None, block=args.key_block, seq_len=s))
      bounds = bounds_fn(k)
      kernel = jax.jit(lambda q, k, b, tiles: pallas_gpu_bounds.row_bounds(
          q, k, None, b, causal=causal, scale=scale, block=args.key_block, kv_len=s, block_sizes=tiles), static_argnums=3)
      cert = jax.jit(lambda q, k, v: stabilizer.certify_blocks(
          q, k, v, None, causal=causal, scale=scale, tau=128.0, granularity="tile", block_q=64, seq_len=s, key_block=args.key_block,
          row_bounds_kernel=pallas_gpu_bounds.row_bounds))
      keys = jax.jit(lambda k, v: stabilizer.key_bounds(k, v, None, causal=causal, tau=64.0, block_q=64, seq_len=s))
      fns = {"block_bounds": lambda: bounds_fn(k), "certify_blocks": lambda: cert(q, k, v),
             "key_bounds": lambda: keys(k, v)}
      for tiles in TILES:
        fns[f"row_bounds_kernel{tiles}"] = functools.partial(kernel, q, k, bounds, tiles)
      for name, (med, lo, hi) in benchmarking.interleaved_medians(fns, repeats=9, inner=5).items():
        records.append(dict(S=s, B=q.shape[0], causal=causal, key_block=args.key_block, part=name, ms=med, ms_min=lo, ms_max=hi))
        print(records[-1], flush=True)
  json.dump(dict(records=records, **benchmarking.device_meta()), open(args.out, "w"), indent=1)


if __name__ == "__main__":
  main()
