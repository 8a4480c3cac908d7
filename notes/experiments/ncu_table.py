"""Side-by-side tables of ncu command-line metrics from several logs (bench_kernels.sh's opcodes and stalls words).

Reads each log (plain or .gz) for `--metrics` output: per-instance metrics printed with `--print-metric-instances
details` (e.g. sass__inst_executed_per_opcode: "total (NAME: value; ...)") become one row per instance, plain
metrics (e.g. smsp__average_warps_issue_stalled_<reason>_per_issue_active.ratio, sm__cycles_elapsed.max) one row
each; columns are the logs, in millions where a value is above 10^5.

  python3 notes/experiments/ncu_table.py benchmarks/results/2026-12-07-h100-opcodes_*.log.gz [--top 30]
"""

import argparse
import gzip
import pathlib
import re

METRIC = re.compile(r"^\s{4}([a-z][\w.]+)\s+(\S+)?\s+([\d,.]+)(?: \((.*?)\))?\s*$", re.S | re.M)


def read(path: pathlib.Path) -> str:
  return gzip.open(path, "rt").read() if path.suffix == ".gz" else path.read_text()


def metrics(text: str) -> dict[str, float]:
  """{metric or metric/instance: value} of the first profiled kernel's command-line metrics section."""
  section = text.split("Section: Command line profiler metrics", 1)[-1]
  # instance lists wrap over lines: join each "(...)" onto its metric's line first
  section = re.sub(r"\(([^)]*)\)", lambda m: "(" + " ".join(m.group(1).split()) + ")", section)
  out = {}
  for name, _unit, value, instances in METRIC.findall(section):
    out[name] = float(value.replace(",", ""))
    for inst, inst_value in re.findall(r"([A-Za-z0-9_]+): ([\d,.]+)", instances or ""):
      out[f"{name}/{inst}"] = float(inst_value.replace(",", ""))
  return out


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("logs", nargs="+", type=pathlib.Path)
  parser.add_argument("--top", type=int, default=40, help="rows, largest first")
  args = parser.parse_args()
  names = [re.sub(r"(\.log)?(\.gz)?$", "", p.name) for p in args.logs]
  tables = [metrics(read(p)) for p in args.logs]
  keys = sorted(set().union(*tables), key=lambda k: -max(t.get(k, 0.0) for t in tables))[:args.top]
  short = lambda k: k.split("/", 1)[1] if "/" in k else k.replace("smsp__average_warps_issue_stalled_", "stall ")
  width = max(len(short(k)) for k in keys)
  print("| " + "metric".ljust(width) + " | " + " | ".join(names) + " |")
  print("|" + "---|" * (len(names) + 1))
  fmt = lambda v: "—" if v is None else (f"{v / 1e6:.2f}M" if v > 1e5 else f"{v:.3g}")
  for k in keys:
    print("| " + short(k).ljust(width) + " | " + " | ".join(fmt(t.get(k)) for t in tables) + " |")


if __name__ == "__main__":
  main()
