"""Plots one or several training runs from their metrics.jsonl: loss and eval loss, tokens/s, and the
certified fraction (runs with a certifying attention), one line per run.

  python3 scripts/plot_run.py runs/cpt_tiny runs/sft_tiny --out runs.png
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def read_metrics(run_dir: str) -> list[dict]:
  path = pathlib.Path(run_dir) / "metrics.jsonl"
  if not path.is_file():
    raise SystemExit(f"plot_run.py: {str(run_dir)!r} has no metrics.jsonl (is it a run_dir of clis-train?)")
  return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("runs", nargs="+", help="run folders")
  parser.add_argument("--out", default="run.png")
  args = parser.parse_args(argv)
  fig, axes = plt.subplots(1, 3, figsize=(14, 4))
  for i, run in enumerate(args.runs):
    records = read_metrics(run)
    train = [r for r in records if r.get("loss") is not None and "event" not in r]
    evals = [r for r in records if "eval_loss" in r]
    color, name = f"C{i}", pathlib.Path(run).name
    axes[0].plot([r["step"] for r in train], [r["loss"] for r in train], color=color, label=f"{name} train")
    if evals:
      axes[0].plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o--", color=color, label=f"{name} eval")
    axes[1].plot([r["step"] for r in train], [r["tokens_per_s"] for r in train], color=color, label=name)
    certified = [r for r in train if r.get("certified_fraction") is not None]
    if certified:
      axes[2].plot([r["step"] for r in certified], [r["certified_fraction"] for r in certified], color=color, label=name)
  for ax, title in zip(axes, ("loss (nats per token)", "tokens/s", "certified fraction")):
    ax.set(title=title, xlabel="step")
    ax.legend(fontsize=8)
  axes[2].set_ylim(-0.02, 1.02)
  fig.tight_layout()
  fig.savefig(args.out, dpi=110)
  print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
  main()
