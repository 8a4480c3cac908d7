"""Primitive counts of each KV-step body in the Mosaic GPU forward kernels' jaxprs, ours against tokamax's sm90
forward, at Gemma 2's local layer (D 256, cap 50, window 4096, GQA 16/8, 8k) or another shape; on a machine without
a GPU (tokamax's GPU checks are bypassed for tracing only; its grid is one CTA per q tile, its tiles its heuristics').
A step body is a sub-jaxpr holding one exp2 over a [block_q, block_kv] tile; the counts say what each step issues
besides its two wgmmas (barrier operations, reductions, conversions, barriers to the compiler).

  PYTHONPATH=kernels:. python3 notes/experiments/step_jaxpr_ops.py [--heads 16 8 256] [--softcap 50] [--window 4096]
"""
import argparse
import collections
import re

import jax
import jax.numpy as jnp


def tokamax_text(q, k, block_kv, softcap, window):
  from tokamax._src import config as tokamax_config, gpu_utils
  from tokamax._src.ops.attention import base, pallas_mosaic_gpu as tk, pallas_mosaic_gpu_kernel_sm90 as sm90
  tk._get_kernel_module = lambda: sm90  # trace the Hopper kernel on the CPU
  gpu_utils.is_sm90 = lambda device=None: True
  config = tk.ConfigSM90(block_q=64, block_kv=block_kv, num_stages=2, persistent=False)
  mask = base.Mask(None, is_causal=True)
  if window is not None:
    mask &= base.CausalMask(offset=0, window_size=window + 1)
  with tokamax_config.cross_compile(True):
    op = tk.PallasMosaicGpuFlashAttention(config=config)
    return str(jax.make_jaxpr(lambda q, k, v: op(q, k, v, mask=mask, logits_soft_cap=softcap))(q, k, k))


def ours_text(q, k, softcap, window, stabilizer):
  from clis_kernels import attention
  from clis_kernels.plan import HOPPER
  kw = {**({} if softcap is None else dict(logits_soft_cap=softcap)),
        **({} if window is None else dict(local_window_size=(window, 0)))}
  return str(jax.make_jaxpr(lambda q, k, v: attention(q, k, v, causal=True, implementation="pallas_mgpu",
                                                      platform=HOPPER, stabilizer=stabilizer, **kw))(q, k, k))


def _counts(body: str) -> collections.Counter:
  """Primitives of a jaxpr body's equations, those with outputs (`x = prim ...`) and those without (`prim ...`)."""
  return collections.Counter(re.findall(r"= ([a-z_0-9]+)\b(?:\[| )", body)
                             + re.findall(r"^\s+([a-z_]+_p|[a-z_]+(?= [a-z]+\[))", body, re.M))


def step_bodies(text: str, tile: str):
  """(name, primitive counts) of each `let jaxprN = {...}` whose own equations hold an exp2 over a `tile` array,
  with the bodies it names (`jaxpr=jaxprM`, e.g. a run_state's) counted in."""
  parts = re.split(r"\nlet (jaxpr\d+) = ", text)
  bodies = {name: body.split("\n  in (")[0] for name, body in zip(parts[1::2], parts[2::2])}
  for name, body in bodies.items():
    if re.search(rf"f32\[{tile}\] = exp2", body):
      counts = _counts(body)
      for called in re.findall(r"jaxpr=(jaxpr\d+)", body):
        counts += _counts(bodies.get(called, ""))
      yield name, counts


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--heads", type=int, nargs=3, default=[16, 8, 256], metavar=("HQ", "HKV", "D"))
  parser.add_argument("--seq", type=int, default=8192)
  parser.add_argument("--softcap", type=float, default=50.0, help="0: none")
  parser.add_argument("--window", type=int, default=4096, help="0: none")
  parser.add_argument("--stabilizer", choices=("online", "clis"), default="online")
  args = parser.parse_args()
  hq, hkv, d = args.heads
  q = jax.ShapeDtypeStruct((1, args.seq, hq, d), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((1, args.seq, hkv, d), jnp.bfloat16)
  softcap, window = args.softcap or None, args.window or None
  block_kv = 64 if d >= 256 else 128
  tile = f"64,{block_kv}"
  for name, text in (("tokamax", tokamax_text(q, k, block_kv, softcap, window)),
                     ("ours", ours_text(q, k, softcap, window, args.stabilizer))):
    for body, counts in step_bodies(text, tile):
      print(f"{name} {body}: {sum(counts.values())} equations: {dict(counts.most_common())}")


if __name__ == "__main__":
  main()
