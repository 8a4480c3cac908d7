"""The machine code of a Mosaic GPU forward's step loops: ours against tokamax's, by opcode (issue 36).

Why: the profiler says our D 128 forward step is bound by its vector work (softmax 1.33 µs of a step, 1.69 with cap 50,
against ~0.7 µs of matmuls), and tokamax's forward is 2-6% faster at the same tiles. Counting each step loop's
instructions by opcode says where the extra work is (or that there is none, and the gap is in scheduling).

`run` (on the H200) compiles and runs one forward with Mosaic GPU's dump switches on (MOSAIC_GPU_DUMP_TO, _SASS,
_PTXAS) and writes the dumps into --dump-dir: the PTX and ptxas's register and spill report (the SASS only where
nvdisasm is on the PATH, which the H200's image lacks). `sass` (anywhere with ptxas and nvdisasm, e.g. pip's
nvidia-cuda-nvdisasm) assembles each dumped .ptx for sm_90a and disassembles it beside it. `count` reads a dump
directory and prints, for every loop (a backward branch) holding wgmma instructions, its instructions by opcode; with
--timeline also the loop in order, runs of arithmetic collapsed, so that one sees where the barriers' arrives and
waits sit against the softmax (ptxas moves register-only work across an arrive); --out keeps them as JSON.

  python3 notes/experiments/sass_forward.py run --impl ours --softcap 50 --dump-dir /tmp/d
  python3 notes/experiments/sass_forward.py sass /tmp/d --nvdisasm nvidia/cu13/bin/nvdisasm
  python3 notes/experiments/sass_forward.py count /tmp/d --timeline --out counts.json
"""

import argparse
import ast
import collections
import dataclasses
import json
import os
import pathlib
import re
import subprocess

INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)((?:\.[A-Za-z0-9_]+)*)(.*?);")
LABEL = re.compile(r"^\s*(\.L_x_\d+|\.L_\w+):")
TARGET = re.compile(r"`?\(?(\.L_x_\d+|\.L_\w+)\)?`?")


def parse_sass(text: str) -> tuple[list[tuple[int, str, str]], dict[str, int]]:
  """Instructions as (address, opcode, modifiers + operands) and labels as {name: address of the next instruction}."""
  instructions, labels, pending = [], {}, []
  for line in text.splitlines():
    label = LABEL.match(line)
    if label:
      pending.append(label.group(1))
      continue
    match = INSTRUCTION.search(line)
    if match:
      address = int(match.group(1), 16)
      for name in pending:
        labels[name] = address
      pending = []
      instructions.append((address, match.group(2), match.group(3) + match.group(4)))
  return instructions, labels


def loops(instructions, labels) -> list[tuple[int, int]]:
  """(first, last) addresses of every backward branch's range: the loops of the code."""
  found = set()
  for address, opcode, rest in instructions:
    if opcode in ("BRA", "JMP"):
      target = TARGET.search(rest)
      if target and target.group(1) in labels and labels[target.group(1)] <= address:
        found.add((labels[target.group(1)], address))
  return sorted(found)


KEEP_MODIFIER = ("MUFU", "F2FP", "HGMMA", "FMNMX", "WARPGROUP", "BAR", "SYNCS")


def opcode_counts(instructions, first, last) -> collections.Counter:
  """Instructions between two addresses by opcode; those in KEEP_MODIFIER keep their first modifier (MUFU.EX2)."""
  counts = collections.Counter()
  for address, opcode, rest in instructions:
    if first <= address <= last:
      if opcode in KEEP_MODIFIER and rest.startswith("."):
        opcode += "." + rest[1:].split(".")[0].split()[0]
      counts[opcode] += 1
  return counts


ARITHMETIC = ("FMUL", "FADD", "FFMA", "FMNMX", "MUFU", "F2FP", "FSEL", "ISETP", "LOP3", "IMAD", "MOV", "UMOV", "UIADD3",
              "SHF", "IADD3", "ULOP3", "USHF", "ULEA", "UISETP", "PLOP3", "UIMAD", "CS2R", "R2UR", "LEA", "VIADD")


def timeline(instructions, first, last) -> list[str]:
  """The loop in order: control, memory and barrier instructions as they are, runs of ARITHMETIC as one
  "[opcode count ...]" line."""
  lines, run = [], collections.Counter()
  for address, opcode, rest in instructions:
    if not first <= address <= last:
      continue
    if opcode in ARITHMETIC:
      run[opcode] += 1
      continue
    if run:
      lines.append("[" + " ".join(f"{op} {n}" for op, n in run.most_common()) + "]")
      run.clear()
    lines.append(f"{opcode}{rest.split()[0] if rest.startswith('.') else ''}")
  if run:
    lines.append("[" + " ".join(f"{op} {n}" for op, n in run.most_common()) + "]")
  return lines


def disassemble(dump_dir: pathlib.Path, nvdisasm: str, ptxas: str = "ptxas"):
  """Writes NAME.sass beside each NAME.ptx (ptxas -arch=sm_90a -O3, then nvdisasm)."""
  for ptx in sorted(dump_dir.glob("*.ptx")):
    cubin = ptx.with_suffix(".cubin")
    subprocess.run([ptxas, "-arch=sm_90a", "-O3", str(ptx), "-o", str(cubin)], check=True)
    sass = subprocess.run([nvdisasm, "-c", str(cubin)], check=True, capture_output=True, text=True).stdout
    ptx.with_suffix(".sass").write_text(sass)
    cubin.unlink()
    print("wrote", ptx.with_suffix(".sass"))


def count(dump_dir: pathlib.Path) -> list[dict]:
  """Each SASS file's wgmma loops with their opcode counts, and ptxas's report lines."""
  records = []
  for path in sorted(dump_dir.iterdir()):
    text = path.read_text(errors="replace")
    if "ptxas" in path.name or "Used" in text[:20000] and "registers" in text[:20000] and "/*0000*/" not in text:
      records.append(dict(file=path.name, ptxas=[line for line in text.splitlines()
                                                  if "registers" in line or "spill" in line or "stack" in line]))
      continue
    instructions, labels = parse_sass(text)
    if not instructions:
      continue
    kernel_loops = []
    for first, last in loops(instructions, labels):
      counts = opcode_counts(instructions, first, last)
      if any(op.startswith("HGMMA") for op in counts):
        kernel_loops.append(dict(first=hex(first), last=hex(last), instructions=sum(counts.values()),
                                 opcodes=dict(counts.most_common()),
                                 timeline=timeline(instructions, first, last)))
    records.append(dict(file=path.name, instructions=len(instructions), loops=kernel_loops))
  return records


def run(args):
  dump_dir = pathlib.Path(args.dump_dir)
  dump_dir.mkdir(parents=True, exist_ok=True)
  if not args.no_dump:
    os.environ.update(MOSAIC_GPU_DUMP_TO=str(dump_dir), MOSAIC_GPU_DUMP_SASS="1", MOSAIC_GPU_DUMP_PTXAS="1")
  import jax
  from clis_kernels import attention, testing
  hq, hkv, d = args.heads
  q, k, v, _, _ = testing.inputs("sinks_many", args.batch, args.seq, hq, hkv, d)
  if args.value_dim is not None:  # MLA: v narrower than q·k
    v = v[..., :args.value_dim]
  cap = {} if args.softcap is None else dict(logits_soft_cap=args.softcap)
  if args.window is not None:
    cap["local_window_size"] = (args.window, 0)
  if args.impl.startswith("ours"):
    from clis_kernels import pallas_mgpu
    changes = {key: ast.literal_eval(value) for key, value in (t.split("=", 1) for t in args.tiles)}
    tiles = dataclasses.replace(pallas_mgpu.default_block_sizes(d, args.seq, q.dtype),
                                one_memory_warp=args.impl != "ours_four_warps", **changes)
    bound = {} if args.bound is None else dict(bound=args.bound)
    forward = jax.jit(lambda q, k, v: attention(q, k, v, causal=True, implementation="pallas_mgpu",
                                                stabilizer=args.stabilizer, block_sizes=tiles, **cap, **bound))
  else:
    import tokamax
    forward = jax.jit(lambda q, k, v: tokamax.dot_product_attention(q, k, v, is_causal=True, implementation="mosaic",
                                                                    **cap))
  if args.backward:  # the forward and its VJP: the backward's kernels run too (ncu -k regex:clis_mgpu_bwd_dkv)
    step = jax.jit(lambda q, k, v: jax.vjp(forward, q, k, v)[1](forward(q, k, v)))
  else:
    step = forward
  for _ in range(args.calls):
    jax.block_until_ready(step(q, k, v))
  print("dumped:", sorted(p.name for p in dump_dir.iterdir()))


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  sub = parser.add_subparsers(dest="command", required=True)
  r = sub.add_parser("run")
  r.add_argument("--impl", choices=("ours", "ours_four_warps", "tokamax"), required=True,
                 help="ours_four_warps: BlockSizes(one_memory_warp=False)")
  r.add_argument("--stabilizer", choices=("online", "clis"), default="online", help="ours only")
  r.add_argument("--tiles", nargs="*", default=[], metavar="KEY=VALUE",
                 help="ours: BlockSizes fields changed from the head dim's defaults, e.g. exact_sum=False")
  r.add_argument("--bound", default=None, help="ours with --stabilizer clis: the API's bound (e.g. cap)")
  r.add_argument("--softcap", type=float, default=None)
  r.add_argument("--heads", type=int, nargs=3, default=[32, 8, 128], metavar=("HQ", "HKV", "D"))
  r.add_argument("--window", type=int, default=None, help="keys to the left a query sees (causal local window)")
  r.add_argument("--value-dim", type=int, default=None, help="v's head dim where it is narrower than q·k's (MLA)")
  r.add_argument("--seq", type=int, default=8192)
  r.add_argument("--batch", type=int, default=1)
  r.add_argument("--calls", type=int, default=1, help="forward calls (ncu profiles the kernel's launches)")
  r.add_argument("--backward", action="store_true", help="run the backward too (its kernels for ncu's -k)")
  r.add_argument("--dump-dir", required=True)
  r.add_argument("--no-dump", action="store_true", help="run without the dump switches (under ncu)")
  d = sub.add_parser("sass")
  d.add_argument("dump_dir")
  d.add_argument("--nvdisasm", default="nvdisasm")
  d.add_argument("--ptxas", default="ptxas")
  c = sub.add_parser("count")
  c.add_argument("dump_dir")
  c.add_argument("--timeline", action="store_true", help="also print each wgmma loop in order")
  c.add_argument("--out", default=None)
  args = parser.parse_args()
  if args.command == "run":
    run(args)
    return
  if args.command == "sass":
    disassemble(pathlib.Path(args.dump_dir), args.nvdisasm, args.ptxas)
    return
  records = count(pathlib.Path(args.dump_dir))
  for record in records:
    if "ptxas" in record:
      print(record["file"], *record["ptxas"][:6], sep="\n  ")
      continue
    print(f"{record['file']}: {record['instructions']} instructions, {len(record['loops'])} wgmma loops")
    for loop in record["loops"]:
      top = ", ".join(f"{op} {n}" for op, n in list(loop["opcodes"].items())[:18])
      print(f"  loop {loop['first']}-{loop['last']}: {loop['instructions']} instructions: {top}")
      if args.timeline:
        print(*(f"      {line}" for line in loop["timeline"]), sep="\n")
  if args.out:
    pathlib.Path(args.out).write_text(json.dumps(records, indent=1))


if __name__ == "__main__":
  main()
