"""MaxText's own train loop with each `attention=` value, back to back on the same synthetic data.

Each variant runs `python -m clis_train.integrations.maxtext maxtext.trainers.pre_train.train CONFIG ...`
(MaxText's train loop, our kernels installed for attention=clis / clis_online) in a fresh process with the
same seed, steps and overrides, and this script reads MaxText's own per-step metric lines (seconds,
TFLOP/s/device, Tokens/s/device, loss). Reported per variant: the median over the steps after `--skip`
(compilation and warm-up), the loss curve, and for clis variants whether the kernel ran (the adapter logs
one "[clis_train]" line per traced call). A variant that cannot run (e.g. cudnn_flash_te without
TransformerEngine) is kept with its exit status and last error line. Ratios: clis / each other variant in
tokens/s; the largest |loss difference| of each variant from dot_product.

  python scripts/bench_maxtext.py --variants clis clis_online flash dot_product cudnn_flash_te --steps 20 \\
      --out benchmarks/results/<date>-<device>-maxtext.json -- model_name=llama3-8b base_num_decoder_layers=4 ...
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import statistics
import subprocess
import sys
import tempfile

STEP_LINE = re.compile(r"completed step: (\d+), seconds: ([\d.]+), TFLOP/s/device: ([\d.]+), "
                       r"Tokens/s/device: ([\d.]+), total_weights: \d+, loss: ([\d.naif]+)")
CLIS_LINE = "[clis_train] attention="


def maxtext_config() -> str:
  import maxtext
  return str(pathlib.Path(maxtext.__file__).parent / "configs" / "base.yml")


def command(variant: str, *, config: str, steps: int, out_dir: str, overrides: list[str]) -> list[str]:
  return [sys.executable, "-m", "clis_train.integrations.maxtext", "maxtext.trainers.pre_train.train", config,
          f"run_name=bench_{variant}", f"base_output_directory={out_dir}", "dataset_type=synthetic",
          f"steps={steps}", f"attention={variant}", "enable_checkpointing=false", *overrides]


def parse(output: str) -> list[dict]:
  """MaxText's per-step metric lines -> [{step, seconds, tflops, tokens_per_s, loss}]."""
  return [dict(step=int(m[1]), seconds=float(m[2]), tflops=float(m[3]), tokens_per_s=float(m[4]), loss=float(m[5]))
          for m in STEP_LINE.finditer(output)]


def run_variant(variant: str, args, out_dir: str, log_path: pathlib.Path) -> dict:
  """Runs one variant to completion or `--timeout` (then exit status None and its steps so far); its whole
  console output goes to `log_path`."""
  cmd = command(variant, config=args.config, steps=args.steps, out_dir=out_dir, overrides=args.overrides)
  try:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=dict(os.environ))
    returncode, output = done.returncode, done.stdout + done.stderr
  except subprocess.TimeoutExpired as e:
    returncode = None
    output = "".join(x.decode(errors="replace") if isinstance(x, bytes) else (x or "") for x in (e.stdout, e.stderr))
    output += f"\n[bench_maxtext] timed out after {args.timeout:.0f} s (--timeout)\n"
  log_path.write_text(output)
  steps = parse(output)
  timed = [s for s in steps if s["step"] >= args.skip]
  record = dict(variant=variant, returncode=returncode, command=" ".join(cmd[1:]), steps=steps,
                clis_calls_logged=output.count(CLIS_LINE), log=log_path.name)
  if returncode != 0 or not timed:
    errors = [line for line in output.splitlines() if "Error" in line or "error" in line or "timed out" in line]
    record["error"] = errors[-1].strip() if errors else output.strip().splitlines()[-1:]
    return record
  record.update(step_s=statistics.median(s["seconds"] for s in timed),
                tokens_per_s=statistics.median(s["tokens_per_s"] for s in timed),
                tflops=statistics.median(s["tflops"] for s in timed))
  return record


def summarize(records: list[dict]) -> dict:
  ok = {r["variant"]: r for r in records if "tokens_per_s" in r}
  ratios = {f"{a}/{b}": ok[a]["tokens_per_s"] / ok[b]["tokens_per_s"]
            for a in ok if a.startswith("clis") for b in ok if b != a}
  dloss = {}
  if "dot_product" in ok:
    base = {s["step"]: s["loss"] for s in ok["dot_product"]["steps"]}
    for name, r in ok.items():
      shared = [abs(s["loss"] - base[s["step"]]) for s in r["steps"] if s["step"] in base]
      if name != "dot_product" and shared:
        dloss[name] = max(shared)
  return dict(ratios=ratios, max_abs_dloss_vs_dot_product=dloss)


def markdown(result: dict) -> str:
  lines = ["| attention | exit | step s (median) | tokens/s/device | TFLOP/s/device | final loss | clis lines |",
           "|---|---|---|---|---|---|---|"]
  for r in result["variants"]:
    final = r["steps"][-1]["loss"] if r["steps"] else None
    if "tokens_per_s" in r:
      lines.append(f"| {r['variant']} | {r['returncode']} | {r['step_s']:.4f} | {r['tokens_per_s']:.1f} | "
                   f"{r['tflops']:.2f} | {final:.4f} | {r['clis_calls_logged']} |")
    else:
      lines.append(f"| {r['variant']} | {r['returncode']} | — | — | — | — | {r.get('error')} |")
  lines += ["", *(f"- {k}: {v:.3f}×" for k, v in result["summary"]["ratios"].items()),
            *(f"- max |Δloss| {k} vs dot_product: {v:.4f}" for k, v in result["summary"]["max_abs_dloss_vs_dot_product"].items())]
  return "\n".join(lines) + "\n"


def plot(result: dict, path: pathlib.Path) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  from clis_train import benchmarking
  ran = [r for r in result["variants"] if r["steps"]]
  fig, (loss_ax, speed_ax) = plt.subplots(1, 2, figsize=(10, 4))
  for r in ran:
    loss_ax.plot([s["step"] for s in r["steps"]], [s["loss"] for s in r["steps"]], label=r["variant"])
  loss_ax.set_xlabel("step")
  loss_ax.set_ylabel("loss")
  loss_ax.legend(fontsize=8)
  timed = [r for r in ran if "tokens_per_s" in r]
  speed_ax.bar([r["variant"] for r in timed], [r["tokens_per_s"] for r in timed])
  speed_ax.set_ylabel("tokens/s/device (median)")
  speed_ax.tick_params(axis="x", labelsize=8)
  benchmarking.save_figure(fig, path, result)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--variants", nargs="+", default=["clis", "clis_online", "flash", "dot_product"])
  parser.add_argument("--steps", type=int, default=20)
  parser.add_argument("--skip", type=int, default=2, help="first steps left out of the medians (compile, warm-up)")
  parser.add_argument("--config", default=None, help="MaxText YAML (default: its configs/base.yml)")
  parser.add_argument("--timeout", type=float, default=1800, help="seconds per variant")
  parser.add_argument("--out", required=True, help="JSON path (.md table and .png plot beside it)")
  parser.add_argument("overrides", nargs="*", help="MaxText key=value overrides, the same for every variant")
  args = parser.parse_args(argv)
  args.config = args.config or maxtext_config()
  import jax
  from clis_train import benchmarking
  path = pathlib.Path(args.out)
  path.parent.mkdir(parents=True, exist_ok=True)
  records = []
  with tempfile.TemporaryDirectory() as out_dir:
    for v in args.variants:
      records.append(run_variant(v, args, out_dir, path.with_name(f"{path.stem}-{v}.log")))
      result = dict(variants=records, summary=summarize(records), argv=sys.argv[1:] if argv is None else argv)
      path.write_text(json.dumps(result, indent=1))  # after each variant, so a killed run keeps what finished
  result.update(**benchmarking.device_meta(), device_count=jax.device_count())
  path.write_text(json.dumps(result, indent=1))
  path.with_suffix(".md").write_text(markdown(result))
  plot(result, path.with_suffix(".png"))
  print(markdown(result))
  return result


if __name__ == "__main__":
  main()
