"""Where a kernel's warps wait, instruction by instruction: ncu's source view (PC sampling) of one launch, read back.

Why: ncu's stall reasons per issued instruction (bench_kernels.sh `stalls`) total the waits of every warp, so they
say that our Gemma 2 forward waits on the long scoreboard where tokamax's does not, but not which wait it is (a turn,
a K/V slot's release, a block's arrival) or whether it sits on the critical path. PC sampling puts each sample on
the instruction the warp was stalled at; summed by SASS opcode and by the kind of wait, the logs of two kernels
compare directly.

Input: the CSV of `ncu -i REPORT.ncu-rep --page source --csv --print-source sass` (profiled with
`--section SourceCounters`). Its header names the columns; this reads the address, the SASS text and every column
whose name holds "Sampling" (all samples, not-issued samples) or starts with "stall_" (per reason, where ncu prints
them). Prints, per file: the instructions with the most samples, then samples by opcode and by wait kind.

  python3 notes/experiments/stall_sources.py sources_ours.csv sources_tokamax.csv --top 25
"""

import argparse
import collections
import csv
import io
import pathlib
import re

# The instruction a sampled warp sits at, by what it waits for (Hopper SASS).
WAIT_KINDS = (
    ("mbarrier wait", re.compile(r"^SYNCS\.(PHASECHK|ARRIVE)")),
    ("named barrier", re.compile(r"^BAR\.")),
    ("wgmma wait", re.compile(r"^WARPGROUP\.(DEPBAR|ARRIVE)|^WARPSYNC")),
    ("wgmma issue", re.compile(r"^HGMMA")),
    ("shared memory", re.compile(r"^(LDS|STS|LDSM|STSM)")),
    ("MUFU", re.compile(r"^MUFU")),
)


def opcode(sass: str) -> str:
  """The opcode with its modifiers of one SASS line, its predicate dropped: '@!P0 BAR.SYNC.DEFER_BLOCKING 0x4' ->
  'BAR.SYNC.DEFER_BLOCKING'."""
  words = sass.split()
  if words and words[0].startswith("@"):
    words = words[1:]
  return words[0].rstrip(";") if words else ""


def wait_kind(op: str) -> str:
  return next((name for name, pattern in WAIT_KINDS if pattern.search(op)), "other")


def rows(text: str) -> tuple[list[str], list[dict[str, str]]]:
  """The sampling columns and the rows of an ncu source-page CSV (lines before its header skipped)."""
  lines = text.splitlines()
  start = next((i for i, line in enumerate(lines) if "Address" in line and "Source" in line), None)
  if start is None:
    raise ValueError("no header with 'Address' and 'Source': pass the output of `ncu -i REPORT --page source --csv "
                     "--print-source sass`")
  table = list(csv.DictReader(io.StringIO("\n".join(lines[start:]))))
  columns = [c for c in (table[0] if table else {}) if "Sampling" in c or c.lower().startswith("stall_")]
  if not columns:
    raise ValueError("no sampling columns (profile with `--section SourceCounters`)")
  return columns, table


def number(value: str) -> float:
  try:
    return float(value.replace(",", ""))
  except (AttributeError, ValueError):
    return 0.0


def summarise(path: pathlib.Path, top: int) -> str:
  columns, table = rows(path.read_text())
  total_column = next((c for c in columns if "All" in c), columns[0])
  address = next(c for c in table[0] if "Address" in c)
  source = next(c for c in table[0] if c.strip() == "Source")
  total = sum(number(r[total_column]) for r in table) or 1.0
  sums = {c: sum(number(r[c]) for r in table) for c in columns}
  reasons = sorted((c for c in columns if c.lower().startswith("stall_") and sums[c] > 0), key=lambda c: -sums[c])
  columns = [c for c in columns if not c.lower().startswith("stall_")] + reasons[:5]  # the five largest reasons
  out = [f"## {path.name}: {total:.0f} samples ({total_column})", ""]
  if reasons:
    out += ["| reason | share |", "|---|---|"] + [f"| {c} | {sums[c] / total:.1%} |" for c in reasons] + [""]
  out += [
         "| address | SASS | " + " | ".join(columns) + " | share |", "|" + "---|" * (len(columns) + 3)]
  for r in sorted(table, key=lambda r: -number(r[total_column]))[:top]:
    out.append(f"| {r[address]} | `{r[source].strip()}` | " + " | ".join(f"{number(r[c]):.0f}" for c in columns)
               + f" | {number(r[total_column]) / total:.1%} |")
  by_kind, by_opcode = collections.Counter(), collections.Counter()
  for r in table:
    op = opcode(r[source])
    by_kind[wait_kind(op)] += number(r[total_column])
    by_opcode[op] += number(r[total_column])
  out += ["", "| wait kind | share |", "|---|---|"]
  out += [f"| {k} | {v / total:.1%} |" for k, v in by_kind.most_common()]
  out += ["", "| opcode | share |", "|---|---|"]
  out += [f"| {k} | {v / total:.1%} |" for k, v in by_opcode.most_common(top)]
  return "\n".join(out)


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("csvs", nargs="+", type=pathlib.Path)
  parser.add_argument("--top", type=int, default=25, help="instructions and opcodes listed, most samples first")
  args = parser.parse_args()
  print("\n\n".join(summarise(p, args.top) for p in args.csvs))


if __name__ == "__main__":
  main()
