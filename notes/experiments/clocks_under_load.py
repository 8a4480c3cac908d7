"""Each forward's time per call with the SM clock and board power it ran at, sustained for some seconds each (issue 36).

Why: under ncu (clocks free, one launch, B 1 × 8k) our Gemma 2 local-layer forward took fewer cycles than tokamax's
(1.23M against 1.37M) while executing 1.33x its instructions, yet the paired benchmark (B 4 × 8k, calls back to back)
has tokamax 1.10-1.17x faster. If the card lowers its clock under our kernel's heavier issue (power), the ratio lives
in the clock, not in the cycles: this runs each variant alone for --seconds while nvidia-smi samples clocks.sm,
power.draw and the active throttle reasons every 100 ms, in two interleaved rounds.

  python3 notes/experiments/clocks_under_load.py --heads 16 8 256 --softcap 50 --window 4096 --out clocks.json
"""

import argparse
import json
import subprocess
import time

QUERY = "clocks.sm,power.draw,clocks_throttle_reasons.active"


def forwards(args):
  import dataclasses
  import jax
  from clis_kernels import attention, pallas_mgpu, testing
  hq, hkv, d = args.heads
  q, k, v, _, _ = testing.inputs("sinks_many", args.batch, args.seq, hq, hkv, d)
  kw = {} if args.softcap is None else dict(logits_soft_cap=args.softcap)
  if args.window is not None:
    kw["local_window_size"] = (args.window, 0)
  # ours on mbarriers, as measured on 2026-12-07 (named barriers, online_named, became the default at D 256 after)
  tiles = dataclasses.replace(pallas_mgpu.default_block_sizes(d, args.seq, q.dtype), named_barriers=False)

  def ours(stabilizer, **extra):
    return jax.jit(lambda q, k, v: attention(q, k, v, causal=True, implementation="pallas_mgpu", stabilizer=stabilizer,
                                             block_sizes=tiles, **kw, **extra))

  fns = {"online": ours("online"), "clis_cap": ours("clis", bound="cap"),
         "online_named": jax.jit(lambda q, k, v: attention(
             q, k, v, causal=True, implementation="pallas_mgpu", stabilizer="online",
             block_sizes=dataclasses.replace(tiles, named_barriers=True), **kw))}
  try:
    import tokamax
    fns["tokamax"] = jax.jit(lambda q, k, v: tokamax.dot_product_attention(q, k, v, is_causal=True,
                                                                          implementation="mosaic", **kw))
  except ImportError:
    print("tokamax not installed: skipped")
  return {name: fns[name] for name in args.impls if name in fns}, (q, k, v)


def sustained(fn, inputs, seconds: float):
  """(ms per call, samples [(clock MHz, power W, throttle reasons)]) over `seconds` of calls back to back."""
  import jax
  jax.block_until_ready(fn(*inputs))
  smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits", "-lms", "100"],
                         stdout=subprocess.PIPE, text=True)
  start, calls = time.perf_counter(), 0
  while time.perf_counter() - start < seconds:
    out = None
    for _ in range(10):
      out = fn(*inputs)
    jax.block_until_ready(out)
    calls += 10
  elapsed = time.perf_counter() - start
  smi.terminate()
  lines = smi.communicate()[0].strip().splitlines()
  samples = []
  for line in lines[len(lines) // 8:]:  # the first eighth: ramp-up
    clock, power, reasons = (x.strip() for x in line.split(","))
    samples.append((float(clock), float(power), reasons))
  return 1e3 * elapsed / calls, samples


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--heads", type=int, nargs=3, default=[16, 8, 256], metavar=("HQ", "HKV", "D"))
  parser.add_argument("--softcap", type=float, default=None)
  parser.add_argument("--window", type=int, default=None)
  parser.add_argument("--seq", type=int, default=8192)
  parser.add_argument("--batch", type=int, default=4)
  parser.add_argument("--seconds", type=float, default=4.0)
  parser.add_argument("--rounds", type=int, default=2)
  parser.add_argument("--impls", nargs="+", default=["online", "clis_cap", "online_named", "tokamax"])
  parser.add_argument("--out", default=None)
  args = parser.parse_args()
  fns, inputs = forwards(args)
  rows = []
  for round_ in range(args.rounds):
    for name, fn in fns.items():
      ms, samples = sustained(fn, inputs, args.seconds)
      clocks, powers = [s[0] for s in samples], [s[1] for s in samples]
      row = dict(impl=name, round=round_, ms=ms, sm_mhz=sum(clocks) / len(clocks), sm_mhz_min=min(clocks),
                 power_w=sum(powers) / len(powers), throttle=sorted({s[2] for s in samples}), samples=len(samples))
      rows.append(row)
      print(f"| {name} | {round_} | {ms:.3f} ms | {row['sm_mhz']:.0f} MHz (min {row['sm_mhz_min']:.0f}) | "
            f"{row['power_w']:.0f} W | {' '.join(row['throttle'])} |", flush=True)
  if args.out:
    with open(args.out, "w") as f:
      json.dump(dict(args=vars(args), rows=rows, date=time.strftime("%Y-%m-%d")), f, indent=1)


if __name__ == "__main__":
  main()
