"""How much of the causal attention grid packed documents leave: for a few of the trainer's packed batches,
the documents' lengths and the fraction of causal (128 x 128) block pairs that hold a visible pair.

  .venv/bin/python notes/experiments/packed_block_fraction.py recipes/cpt.yaml data.seq_len=8192 [--batches 3]
"""

import argparse

import numpy as np

from clis_kernels import masks
from clis_train import data
from clis_train.config import load_config


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("config")
  p.add_argument("overrides", nargs="*")
  p.add_argument("--batches", type=int, default=3)
  p.add_argument("--block", type=int, default=128)
  args = p.parse_args()
  cfg = load_config(args.config, args.overrides)
  seq = cfg.data.seq_len
  examples = data.build_examples(cfg.data, data.make_tokenizer(cfg.data.tokenizer))
  batches = data.packed_batches(examples.train, seq_len=seq, batch_size=1, seed=0, packing_bins=cfg.data.packing_bins)
  n = seq // args.block
  causal = np.tril(np.ones((n, n), bool))
  for _ in range(args.batches):
    seg = np.asarray(next(batches)["segment_ids"])
    first, last = (np.asarray(x)[0] for x in masks.segment_block_ranges(seg, seg, row_block=args.block,
                                                                        col_block=args.block))
    cols = np.arange(n)
    inside = causal & (cols[None, :] >= first[:, None]) & (cols[None, :] <= last[:, None])
    _, lengths = np.unique(seg[seg > 0], return_counts=True)
    print(f"documents {len(lengths)}, length mean {lengths.mean():.0f} median {np.median(lengths):.0f} max "
          f"{lengths.max()}; causal block pairs holding a visible pair {inside.sum()}/{causal.sum()} = "
          f"{inside.sum() / causal.sum():.3f}")


if __name__ == "__main__":
  main()
