"""`clis-train`: train, look at the config, generate text, evaluate and export a trained model.

  clis-train [train] RECIPE.yaml [key=value ...]        train (MaxText-style overrides)
  clis-train show-config RECIPE.yaml [key=value ...]    print the resolved config as YAML
  clis-train generate RUN_DIR --prompt TEXT             sample text from a run's newest checkpoint
  clis-train eval RUN_DIR_OR_RECIPE [--data PATH]       loss, perplexity, bits per byte (JSON)
  clis-train export RUN_DIR --hf OUT_DIR                Llama-format safetensors + config.json
  clis-train prepare-data INPUT... --out DIR [--tokenizer T]   tokenise a corpus once into shards on disk

Every error prints as one line, `clis-train: ...` (exit 2 for a bad config or argument, 1
otherwise); Ctrl-C or SIGTERM stops cleanly with exit 130. `--debug` (or CLIS_TRAIN_DEBUG=1)
shows tracebacks.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import signal
import sys

from clis_train.errors import ConfigError, GracefulStop, Interrupted, UserError

COMMANDS = ("train", "show-config", "generate", "eval", "export", "prepare-data")


def _recipes() -> str:
  folder = pathlib.Path("recipes") if pathlib.Path("recipes").is_dir() else pathlib.Path(__file__).parent.parent / "recipes"
  lines = []
  for path in sorted(folder.glob("*.yaml")):
    first = path.read_text().splitlines()[0] if path.read_text() else ""
    lines.append(f"  {path}: {first.lstrip('# ')}")
  return "\n".join(lines) or "  (no recipes/ folder here)"


def _epilog() -> str:
  from clis_train.config import ATTENTIONS, default_keys
  attention = "\n".join(f"  {name:<12} {about}" for name, about in ATTENTIONS.items())
  keys = "\n".join(f"  {key}={value}" for key, value in default_keys())
  return (f"recipes:\n{_recipes()}\n\nattention= values:\n{attention}\n\n"
          f"keys (defaults; a recipe sets its own, `show-config` prints them resolved):\n{keys}")


def _parser() -> argparse.ArgumentParser:
  fmt = argparse.RawDescriptionHelpFormatter
  parser = argparse.ArgumentParser(prog="clis-train", description=__doc__, formatter_class=fmt, epilog=_epilog())
  parser.add_argument("--debug", action="store_true", help="print tracebacks (also CLIS_TRAIN_DEBUG=1)")
  sub = parser.add_subparsers(dest="command", metavar="COMMAND")
  overrides = dict(nargs="*", help="key=value overrides, e.g. attention=online train.steps=50")

  p = sub.add_parser("train", help="train with a recipe (the default command)", formatter_class=fmt,
                     description="Train with a recipe; resumes from run_dir's newest checkpoint.", epilog=_epilog())
  p.add_argument("recipe", help="YAML recipe, e.g. recipes/cpt_tiny.yaml")
  p.add_argument("overrides", **overrides)

  p = sub.add_parser("show-config", help="print the resolved config as YAML", formatter_class=fmt, epilog=_epilog())
  p.add_argument("recipe")
  p.add_argument("overrides", **overrides)

  weights = dict(help="where the weights come from instead: a run folder, an orbax checkpoint, or a Hugging Face "
                      "safetensors folder")
  p = sub.add_parser("generate", help="sample text from a trained run", formatter_class=fmt, description=(
      "Sample text from a run (its newest checkpoint, or --step) with a K/V cache. SFT runs wrap the\n"
      "prompt in their chat template. Decode steps use dense XLA attention over the cache: one query row\n"
      "has nothing to tile, so the CLiS kernels serve training and prefill-sized work, not decoding."))
  p.add_argument("run", help="run folder (or recipe YAML whose run_dir holds the checkpoints)")
  p.add_argument("overrides", **overrides)
  p.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
  p.add_argument("--prompts-file", help="a text file with one prompt per line")
  p.add_argument("--max-tokens", type=int, default=64)
  p.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy")
  p.add_argument("--top-k", type=int, default=0, help="keep the k likeliest tokens (0: off)")
  p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1: off)")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the newest)")
  p.add_argument("--checkpoint", **weights)
  p.add_argument("--json", action="store_true", help="print one JSON record per prompt")

  p = sub.add_parser("eval", help="loss / perplexity of a checkpoint (JSON)", formatter_class=fmt, description=(
      "Loss (nats per target token), perplexity, bits per token and, with the byte tokenizer, bits per\n"
      "byte of a checkpoint on --data (a file or folder read with the run's data settings) or on the\n"
      "run's held-out split. Prints JSON (and writes it with --out)."))
  p.add_argument("run", help="run folder, or a recipe YAML (its run_dir or checkpoint.init_from has the weights)")
  p.add_argument("overrides", **overrides)
  p.add_argument("--data", default=None, help="file or folder to score (default: the run's held-out split)")
  p.add_argument("--step", type=int, default=None)
  p.add_argument("--checkpoint", **weights)
  p.add_argument("--batch-size", type=int, default=8)
  p.add_argument("--out", default=None, help="also write the JSON here")

  p = sub.add_parser("export", help="write a Hugging Face Llama folder", formatter_class=fmt, description=(
      "Write model.safetensors (float32) and config.json in Hugging Face Llama format, plus tokenizer.json\n"
      "when the run used one, so transformers (LlamaForCausalLM.from_pretrained) loads the model. The byte\n"
      "tokenizer has no tokenizer.json: ids 0-255 are UTF-8 bytes, 256 BOS, 257 EOS."))
  p.add_argument("run", help="run folder")
  p.add_argument("--hf", required=True, help="output folder (must not exist, or be empty)")
  p.add_argument("--step", type=int, default=None)

  p = sub.add_parser("prepare-data", help="tokenise a corpus once into shards on disk", formatter_class=fmt,
                     description=(
      "Tokenise text files, JSONL or Parquet (or folders of them) once, in worker processes, into shards of token\n"
      "ids under --out (clis_train/corpus.py). Train from the folder with data.train_path=DIR, or mix several with\n"
      "data.sources. Interrupted, it resumes when run again with the same arguments; training refuses a folder\n"
      "prepared with another tokenizer. Prints a JSON summary (documents, tokens, MB/s)."))
  p.add_argument("inputs", nargs="+", help="files or folders")
  p.add_argument("--out", required=True, help="the folder to write (new, empty, or an unfinished preparation)")
  p.add_argument("--tokenizer", default="byte", help="byte, or a Hugging Face tokenizer.json (training's data.tokenizer)")
  p.add_argument("--kind", default="cpt", choices=["cpt", "sft"])
  p.add_argument("--format", default="auto", choices=["auto", "text", "jsonl", "parquet"])
  p.add_argument("--text-field", default="text")
  p.add_argument("--file-suffixes", default=None, help="a folder's files to read, e.g. .py,.md (default: known ones)")
  p.add_argument("--skip-bad-lines", action="store_true", help="skip and count malformed JSONL lines")
  p.add_argument("--workers", type=int, default=None, help="worker processes (default: one per CPU)")
  p.add_argument("--unit-mb", type=float, default=64.0, help="input megabytes per shard")
  p.add_argument("--no-progress", action="store_true")
  return parser


def main(argv=None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  first = next((a for a in argv if a != "--debug"), None)
  if first is not None and first not in COMMANDS and not first.startswith("-"):
    argv.insert(argv.index(first), "train")  # `clis-train RECIPE ...` still trains
  parser = _parser()
  args = parser.parse_args(argv)
  if args.command is None:
    parser.print_help()
    return 2
  debug = args.debug or os.environ.get("CLIS_TRAIN_DEBUG", "") not in ("", "0")
  stop = GracefulStop()
  for signum in (signal.SIGINT, signal.SIGTERM):  # preemption stops like Ctrl-C: at a step boundary
    signal.signal(signum, stop.handler)
  try:
    return COMMAND_FUNCTIONS[args.command](args, stop)
  except (KeyboardInterrupt, Interrupted) as e:
    print(f"clis-train: {e or 'interrupted before training started'}", file=sys.stderr)
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(130)  # skips interpreter teardown, where C++ worker threads abort on a pending signal
  except Exception as e:
    if debug:
      raise
    where = "" if isinstance(e, (UserError, FileExistsError)) else f"{type(e).__name__}: "
    hint = "" if isinstance(e, (UserError, FileExistsError)) else " (--debug or CLIS_TRAIN_DEBUG=1 shows the traceback)"
    print(f"clis-train: {where}{e}{hint}", file=sys.stderr)
    return 2 if isinstance(e, (ConfigError, FileExistsError)) else 1


def _train(args, stop) -> int:
  from clis_train.config import load_config
  cfg = load_config(args.recipe, args.overrides)
  from clis_train.train import train  # imports JAX: after the config is known to be good
  records = train(cfg, stop=stop)
  last = next((r for r in reversed(records) if "loss" in r), None)
  if last:
    print(f"done: step {last['step']} loss {last['loss']:.4f} tokens/s {last['tokens_per_s']:.0f} "
          f"run_dir {cfg.run_dir}")
  return 0


def _show_config(args, stop) -> int:
  import yaml
  from clis_train.config import load_config, to_dict
  print(yaml.safe_dump(to_dict(load_config(args.recipe, args.overrides)), sort_keys=False), end="")
  return 0


def _generate(args, stop) -> int:
  prompts = list(args.prompt)
  if args.prompts_file:
    path = pathlib.Path(args.prompts_file)
    if not path.is_file():
      raise ConfigError(f"--prompts-file={args.prompts_file!r} does not exist")
    prompts += [line for line in path.read_text().splitlines() if line.strip()]
  if not prompts:
    raise ConfigError("give a --prompt TEXT (repeatable) or a --prompts-file with one prompt per line")
  from clis_train.generate import Generator, Sampling
  from clis_train.runs import load_run
  sampling = Sampling(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                      top_p=args.top_p, seed=args.seed)
  run = load_run(args.run, step=args.step, overrides=args.overrides, checkpoint_path=args.checkpoint)
  generator = Generator(run, sampling)
  for prompt in prompts:
    text = generator.generate(prompt)
    if args.json:
      print(json.dumps({"prompt": prompt, "completion": text, "step": run.step}))
    else:
      print(f"{prompt}{text}" if run.cfg.data.kind == "cpt" else f"> {prompt}\n{text}")
  return 0


def _eval(args, stop) -> int:
  from clis_train.evaluate import evaluate, examples_for
  from clis_train.runs import load_run
  run = load_run(args.run, step=args.step, overrides=args.overrides, checkpoint_path=args.checkpoint)
  result = {"run": args.run, "checkpoint": args.checkpoint or None, "step": run.step,
            "data": args.data or "held-out split", **evaluate(run, examples_for(run, args.data),
                                                              batch_size=args.batch_size)}
  text = json.dumps(result, indent=1)
  print(text)
  if args.out:
    pathlib.Path(args.out).write_text(text + "\n")
  return 0


def _export(args, stop) -> int:
  from clis_train import hf
  from clis_train.runs import load_run
  run = load_run(args.run, step=args.step)
  tokenizer = None if run.cfg.data.tokenizer == "byte" else run.cfg.data.tokenizer
  written = hf.save_llama_safetensors(run.params, run.dims, pathlib.Path(args.hf),
                                      max_positions=max(run.cfg.data.seq_len, 2048), tokenizer_path=tokenizer,
                                      bos_id=run.tokenizer.bos_id, eos_id=run.tokenizer.eos_id)
  print(f"exported step {run.step} of {args.run} to {args.hf}: {', '.join(p.name for p in written)}")
  return 0


def _prepare_data(args, stop) -> int:
  from clis_train import corpus
  from clis_train.config import parse_suffixes
  summary = corpus.prepare(args.inputs, args.out, tokenizer=args.tokenizer, kind=args.kind, fmt=args.format,
                           text_field=args.text_field, suffixes=parse_suffixes(args.file_suffixes),
                           skip_bad_lines=args.skip_bad_lines, workers=args.workers,
                           unit_bytes=int(args.unit_mb * 2**20), progress=not args.no_progress, stop=stop)
  print(json.dumps(summary))
  return 0


COMMAND_FUNCTIONS = {"train": _train, "show-config": _show_config, "generate": _generate, "eval": _eval,
                     "export": _export, "prepare-data": _prepare_data}


if __name__ == "__main__":
  sys.exit(main())
