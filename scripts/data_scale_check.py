"""Does training's memory or time to the first step grow with the corpus? Writes synthetic JSONL corpora (a small
and a big one), prepares each with `clis-train prepare-data` (byte tokenizer; throughput in MB/s), trains the same
steps from each through `clis-train` (--repeats times: the peak varies by about 5% from run to run on one
corpus) and records the trainer's peak resident memory (GNU time's %M) and
the time from the command to the end of its first step (the trainer's own "first step done at unix time" line).
Then the preparation throughput with a BPE tokenizer.json trained on a sample (Hugging Face `tokenizers`).

  python scripts/data_scale_check.py --big-gb 5 --small-mb 50 --work /tmp/scale --out benchmarks/results/x.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import re
import subprocess
import sys
import time

import numpy as np

WORDS = ("attention kernel softmax certified tile bound query key value row block bidirectional causal packed "
         "document shard corpus token stream mixture replay domain gradient optimizer schedule warmup").split()


def write_corpus(path: pathlib.Path, nbytes: int, seed: int = 0) -> int:
  """JSONL of ~1 KB documents (a pool of distinct random texts, each line with its own id) up to nbytes."""
  rng = np.random.default_rng(seed)
  pool = [" ".join(rng.choice(WORDS, size=int(rng.integers(40, 260)))) for _ in range(4096)]
  written, i = 0, 0
  with open(path, "w") as f:
    while written < nbytes:
      block = "".join(json.dumps({"text": f"d{i + j} {pool[(i + j) * 7919 % len(pool)]}"}) + "\n" for j in range(4096))
      f.write(block)
      written += len(block)
      i += 4096
  return written


def run(cmd: list[str], log: pathlib.Path) -> tuple[float, str]:
  """(seconds, output) of a child process; raises with its tail when it fails."""
  t0 = time.time()
  result = subprocess.run(cmd, capture_output=True, text=True)
  log.write_text(result.stdout + result.stderr)
  if result.returncode:
    raise SystemExit(f"{' '.join(cmd)} failed:\n{(result.stdout + result.stderr)[-2000:]}")
  return time.time() - t0, result.stdout + result.stderr


def train(folder: pathlib.Path, work: pathlib.Path, steps: int, tag: str) -> dict:
  """Trains `steps` from a prepared folder in a fresh process; its peak RSS and command-to-first-step time."""
  run_dir = work / f"run_{tag}"
  subprocess.run(["rm", "-rf", str(run_dir)], check=True)
  t0 = time.time()
  seconds, out = run(["/usr/bin/time", "-f", "maxrss_kb %M", sys.executable, "-m", "clis_train.cli",
                      "recipes/cpt_tiny.yaml", f"run_dir={run_dir}", f"data.train_path={folder}", f"train.steps={steps}",
                      "train.progress_bar=false", "train.eval_every=1000000", "checkpoint.every=1000000"],
                     work / f"train_{tag}.log")
  peak_kb = int(re.search(r"maxrss_kb (\d+)", out).group(1))  # GNU time: the trainer process's own peak
  first = float(re.search(r"first step done at unix time ([0-9.]+)", out).group(1))
  return dict(peak_rss_mb=peak_kb / 1024, seconds=seconds, command_to_first_step_s=first - t0, steps=steps)


def bpe_tokenizer(sample: pathlib.Path, out: pathlib.Path, vocab: int = 8192) -> pathlib.Path:
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  lines = (json.loads(line)["text"] for _, line in zip(range(20000), open(sample)))
  tok.train_from_iterator(lines, trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<s>", "</s>"]))
  tok.save(str(out))
  return out


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--big-gb", type=float, default=5.0)
  parser.add_argument("--small-mb", type=float, default=50.0)
  parser.add_argument("--bpe-mb", type=float, default=200.0)
  parser.add_argument("--steps", type=int, default=20)
  parser.add_argument("--repeats", type=int, default=3, help="training runs per corpus (peak RSS varies ~5% run to run)")
  parser.add_argument("--workers", type=int, default=None)
  parser.add_argument("--work", default="/tmp/clis_data_scale")
  parser.add_argument("--keep", action="store_true", help="keep the corpora and shards")
  parser.add_argument("--out", required=True)
  args = parser.parse_args()
  work = pathlib.Path(args.work)
  work.mkdir(parents=True, exist_ok=True)
  record = dict(date=datetime.date.today().isoformat(), cpus=os.cpu_count(), steps=args.steps,
                command=" ".join(sys.argv))
  for tag, nbytes in (("small", int(args.small_mb * 1e6)), ("big", int(args.big_gb * 1e9))):
    raw = work / f"{tag}.jsonl"
    t0 = time.time()
    size = write_corpus(raw, nbytes)
    print(f"{tag}: wrote {size / 1e6:.0f} MB in {time.time() - t0:.0f} s", flush=True)
    folder = work / f"{tag}_prepared"
    subprocess.run(["rm", "-rf", str(folder)], check=True)
    cmd = [sys.executable, "-m", "clis_train.cli", "prepare-data", str(raw), "--out", str(folder), "--no-progress"]
    if args.workers:
      cmd += ["--workers", str(args.workers)]
    _, out = run(cmd, work / f"prepare_{tag}.log")
    prep = json.loads(out.strip().splitlines()[-1])
    print(f"{tag}: prepared {prep['bytes'] / 1e6:.0f} MB, {prep['tokens']} tokens, {prep['mb_per_s']:.1f} MB/s",
          flush=True)
    runs = [train(folder, work, args.steps, f"{tag}{r}") for r in range(args.repeats)]
    trained = dict(runs=runs, **{k: float(np.median([r[k] for r in runs]))
                                 for k in ("peak_rss_mb", "command_to_first_step_s")})
    print(f"{tag}: trained {args.steps} steps {args.repeats} times, peak RSS "
          f"{', '.join(f'{r['peak_rss_mb']:.0f}' for r in runs)} MB, first step "
          f"{', '.join(f'{r['command_to_first_step_s']:.1f}' for r in runs)} s after the command", flush=True)
    record[tag] = dict(corpus_bytes=size, prepare=prep, train=trained)
    if tag == "small":
      sample = raw
    elif not args.keep:
      raw.unlink()
      subprocess.run(["rm", "-rf", str(folder)], check=True)
  bpe_raw = work / "bpe.jsonl"
  write_corpus(bpe_raw, int(args.bpe_mb * 1e6), seed=1)
  tok = bpe_tokenizer(sample, work / "tokenizer.json")
  subprocess.run(["rm", "-rf", str(work / "bpe_prepared")], check=True)
  cmd = [sys.executable, "-m", "clis_train.cli", "prepare-data", str(bpe_raw), "--out", str(work / "bpe_prepared"),
         "--tokenizer", str(tok), "--no-progress"] + (["--workers", str(args.workers)] if args.workers else [])
  _, out = run(cmd, work / "prepare_bpe.log")
  record["bpe"] = dict(corpus_bytes=bpe_raw.stat().st_size, vocab=8192, prepare=json.loads(out.strip().splitlines()[-1]))
  print(f"bpe: {record['bpe']['prepare']['mb_per_s']:.1f} MB/s", flush=True)
  small, big = record["small"]["train"], record["big"]["train"]
  record["rss_ratio_big_to_small"] = big["peak_rss_mb"] / small["peak_rss_mb"]
  print(json.dumps({k: record[k] for k in ("rss_ratio_big_to_small",)}), flush=True)
  pathlib.Path(args.out).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
  main()
