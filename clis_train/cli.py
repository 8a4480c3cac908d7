"""`clis-train RECIPE.yaml [key=value ...]`: train with a recipe and MaxText-style overrides.

Every error prints as one line, `clis-train: ...` (exit 2 for a bad config, 1 otherwise); Ctrl-C or
SIGTERM stops cleanly with exit 130. `--debug` (or CLIS_TRAIN_DEBUG=1) shows tracebacks.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

from clis_train.errors import ConfigError, Interrupted, UserError


def _raise_interrupt(signum, frame):
  raise KeyboardInterrupt


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="clis-train", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("recipe", help="YAML recipe, e.g. recipes/cpt_tiny.yaml")
  parser.add_argument("overrides", nargs="*", help="key=value, e.g. attention=online train.steps=50")
  parser.add_argument("--debug", action="store_true", help="print tracebacks (also CLIS_TRAIN_DEBUG=1)")
  args = parser.parse_args(argv)
  debug = args.debug or os.environ.get("CLIS_TRAIN_DEBUG", "") not in ("", "0")
  signal.signal(signal.SIGTERM, _raise_interrupt)  # preemption stops like Ctrl-C
  try:
    from clis_train.config import load_config
    cfg = load_config(args.recipe, args.overrides)
    from clis_train.train import train  # imports JAX: after the config is known to be good
    records = train(cfg)
  except (KeyboardInterrupt, Interrupted) as e:
    print(f"clis-train: {e or 'interrupted before training started'}", file=sys.stderr)
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(130)  # skips interpreter teardown, where C++ worker threads abort on a pending signal
  except Exception as e:
    if debug:
      raise
    where = "" if isinstance(e, UserError) else f"{type(e).__name__}: "
    hint = "" if isinstance(e, UserError) else " (--debug or CLIS_TRAIN_DEBUG=1 shows the traceback)"
    print(f"clis-train: {where}{e}{hint}", file=sys.stderr)
    return 2 if isinstance(e, ConfigError) else 1
  last = next((r for r in reversed(records) if "loss" in r), None)
  if last:
    print(f"done: step {last['step']} loss {last['loss']:.4f} tokens/s {last['tokens_per_s']:.0f} "
          f"run_dir {cfg.run_dir}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
