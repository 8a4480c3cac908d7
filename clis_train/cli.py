"""`clis-train RECIPE.yaml [key=value ...]`: train with a recipe and MaxText-style overrides."""

from __future__ import annotations

import argparse
import sys

from clis_train.config import ConfigError, load_config


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="clis-train", description=__doc__)
  parser.add_argument("recipe", help="YAML recipe, e.g. recipes/cpt_tiny.yaml")
  parser.add_argument("overrides", nargs="*", help="key=value, e.g. attention=online train.steps=50")
  args = parser.parse_args(argv)
  try:
    cfg = load_config(args.recipe, args.overrides)
  except ConfigError as e:
    print(f"clis-train: {e}", file=sys.stderr)
    return 2
  from clis_train.train import train  # imports JAX: after the config is known to be good
  records = train(cfg)
  last = next((r for r in reversed(records) if "loss" in r), None)
  if last:
    print(f"done: step {last['step']} loss {last['loss']:.4f} tokens/s {last['tokens_per_s']:.0f} "
          f"run_dir {cfg.run_dir}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
