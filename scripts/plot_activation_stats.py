"""Plots scripts/activation_stats.py's JSON over training steps: certified fraction of both bounds
(mean over heads, and the worst head), key norm at document starts over the median, attention to the
document's first token, and the backward-skippable tile fraction; optionally the kernel's certified
fraction logged during training (the run's metrics.jsonl).

  python3 scripts/plot_activation_stats.py stats.json --metrics RUN/metrics.jsonl --seq-len 8192 --out stats.png
"""

from __future__ import annotations

import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("stats")
  parser.add_argument("--metrics", default=None, help="the run's metrics.jsonl (the kernel's certified fraction)")
  parser.add_argument("--seq-len", type=int, default=8192)
  parser.add_argument("--layout", default="long", choices=["long", "packed"])
  parser.add_argument("--out", default="activation_stats.png")
  args = parser.parse_args(argv)
  records = [r for r in json.load(open(args.stats))["records"]
             if r["seq_len"] == args.seq_len and r["layout"] == args.layout]
  steps = [r["step"] for r in records]
  per_layer = lambda key, reduce: np.array([[reduce(layer[key]) for layer in r["layers"]] for r in records])
  fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
  ax = axes[0, 0]
  for key, style in (("certified_radius", "-"), ("certified_blocks", "--")):
    ax.plot(steps, per_layer(key, np.mean).mean(1), style, color="C0", label=f"{key}: mean")
    ax.plot(steps, per_layer(key, np.min).min(1), style, color="C3", label=f"{key}: worst head")
  if args.metrics:
    logged = [json.loads(line) for line in open(args.metrics)]
    logged = [r for r in logged if r.get("certified_fraction") is not None]
    ax.plot([r["step"] for r in logged], [r["certified_fraction"] for r in logged], ":", color="k",
            label="kernel, during training")
  ax.set(title="certified tile fraction", xlabel="step", ylim=(-0.02, 1.02))
  ax.legend(fontsize=7)
  for ax, key, title in ((axes[0, 1], "sink_ratio", "key norm at document start / median (max head)"),
                         (axes[1, 0], "first_attention", "attention to the document's first token (max head)"),
                         (axes[1, 1], "bwd_skip_16", "backward tiles with every p < 2^-16 (max head)")):
    values = per_layer(key, np.max)
    for layer in range(values.shape[1]):
      ax.plot(steps, values[:, layer], color=plt.cm.viridis(layer / max(1, values.shape[1] - 1)),
              label=f"layer {layer}" if layer in (0, values.shape[1] - 1) else None)
    ax.set(title=title, xlabel="step")
    ax.legend(fontsize=7)
  fig.suptitle(f"{args.stats}: seq {args.seq_len}, {args.layout} rows", fontsize=9)
  fig.tight_layout()
  fig.savefig(args.out, dpi=110)


if __name__ == "__main__":
  main()
