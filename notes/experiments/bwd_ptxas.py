"""ptxas's register and spill report for each Mosaic GPU backward kernel, with and without
BlockSizes(overlap_dq=True, overlap_dkv=True): does holding dP's accumulator through P spill, and does ptxas serialize the wgmmas
(its "wgmma ... serialized" warning)? (issue 36)

Each (kernel, overlap) pair is compiled in a process of its own with Mosaic GPU's dump switches on
(MOSAIC_GPU_DUMP_TO, MOSAIC_GPU_DUMP_PTXAS), so every dump directory holds one kernel's report.

  python3 notes/experiments/bwd_ptxas.py --heads 32 8 128 --dump-dir /tmp/ptxas [--softcap 50]
"""

import argparse
import json
import os
import pathlib
import subprocess
import sys


def one(args):
  """Child: compile and run one backward kernel (args.kernel, args.overlap) once."""
  import jax
  import jax.numpy as jnp
  from clis_kernels import pallas_mgpu_vjp
  hq, hkv, d = args.heads
  dv = args.value_dim or d
  key = jax.random.PRNGKey(0)
  q = jax.random.normal(key, (1, args.seq, hq, d), jnp.bfloat16)
  k = jax.random.normal(key, (1, args.seq, hkv, d), jnp.bfloat16)
  v = jax.random.normal(key, (1, args.seq, hkv, dv), jnp.bfloat16)
  do = jax.random.normal(key, (1, args.seq, hq, dv), jnp.bfloat16)
  lse = jnp.zeros((1, hq, args.seq), jnp.float32)
  tiles = pallas_mgpu_vjp.BlockSizes(fused_dq=args.kernel == "fused", overlap_dq=args.overlap,
                                     overlap_dkv=args.overlap)
  launch = lambda q, k, v, do, lse: pallas_mgpu_vjp.Launches(q, k, v, None, do, lse, do, causal=True, scale=d ** -0.5,
                                                            kv_len=None, block_sizes=tiles, softcap=args.softcap)
  run = {"dq": lambda *a: launch(*a).dq(), "dkv": lambda *a: launch(*a).dkv(), "fused": lambda *a: launch(*a).fused()}
  jax.block_until_ready(jax.jit(run[args.kernel])(q, k, v, do, lse))


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--heads", type=int, nargs=3, default=[32, 8, 128], metavar=("HQ", "HKV", "D"))
  parser.add_argument("--value-dim", type=int, default=None)
  parser.add_argument("--softcap", type=float, default=None)
  parser.add_argument("--seq", type=int, default=2048)
  parser.add_argument("--kernels", nargs="+", default=["dq", "dkv"])
  parser.add_argument("--dump-dir", required=True)
  parser.add_argument("--out", default=None)
  parser.add_argument("--kernel", help=argparse.SUPPRESS)
  parser.add_argument("--overlap", action="store_true", help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.kernel:
    return one(args)
  report = {}
  for kernel in args.kernels:
    for overlap in (False, True):
      name = f"{kernel}{'_overlap' if overlap else ''}"
      dump = pathlib.Path(args.dump_dir) / name
      dump.mkdir(parents=True, exist_ok=True)
      env = dict(os.environ, MOSAIC_GPU_DUMP_TO=str(dump), MOSAIC_GPU_DUMP_PTXAS="1")
      cmd = [sys.executable, __file__, "--kernel", kernel, "--seq", str(args.seq), "--heads", *map(str, args.heads),
             "--dump-dir", str(dump)]
      cmd += ["--overlap"] * overlap + ([] if args.softcap is None else ["--softcap", str(args.softcap)])
      cmd += [] if args.value_dim is None else ["--value-dim", str(args.value_dim)]
      # ptxas's verbose report may land in a dump file or on the child's stderr: search both.
      child = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
      texts = [child.stdout, child.stderr]
      texts += [f.read_text(errors="replace") for f in sorted(dump.rglob("*")) if f.is_file()]
      lines = [line.strip() for text in texts for line in text.splitlines()
               if "registers" in line or "spill" in line or "wgmma" in line.lower() and "serializ" in line]
      report[name] = lines
      print(name, *lines, sep="\n  ", flush=True)
  if args.out:
    pathlib.Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
  main()
