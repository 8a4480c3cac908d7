"""Does the skip tile's size explain the example DiT's quality with skipping? The trained example DiT sampled on
the CPU with the reference skip forward at 64 x 64 and 128 x 128 tiles (the Triton kernel's and the Mosaic GPU
kernel's), each thr schedule, PSNR/SSIM against the dense XLA sample from the same noise (bench_diffusion's).

  python notes/experiments/dit_skip_tiles.py --out notes/experiments/dit_skip_tiles.json
"""

import argparse
import functools
import json
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

from clis_kernels import plan as plan_lib, reference  # noqa: E402
from examples.video_dit import sampler, train  # noqa: E402
from scripts.bench_diffusion import quality  # noqa: E402


def with_tiles(cfg, tile):
  """The sampler's skip plan with the reference at tile x tile."""
  return plan_lib.make_plan(dtype=jnp.dtype(cfg.dtype), head_dim=cfg.head_dim, seq_len=cfg.tokens, skipping=True,
                            implementation="reference", block_sizes=reference.BlockSizes(block_q=tile, block_k=tile))


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--weights", default="examples/video_dit/weights.safetensors")
  p.add_argument("--tiles", type=int, nargs="+", default=[64, 128])
  p.add_argument("--schedules", nargs="+", default=["-10:-4", "-14:-8"])
  p.add_argument("--batch", type=int, default=4)
  p.add_argument("--out", required=True)
  args = p.parse_args()
  params, cfg = train.load(args.weights)
  noise = jax.random.normal(jax.random.PRNGKey(123), (args.batch, cfg.frames, cfg.size, cfg.size, 3))
  condition = jnp.stack([jnp.arange(args.batch) % 2, 2 + jnp.arange(args.batch) % 4,
                         6 + (jnp.arange(args.batch) // 2) % 4], -1).astype(jnp.int32)
  dense = sampler.sample(params, cfg, noise, condition, attention="xla")[0]
  records = []
  for tile in args.tiles:
    sampler.skip_plan = functools.lru_cache(maxsize=None)(functools.partial(with_tiles, tile=tile))
    sampler._step_fn.cache_clear()
    for sched in args.schedules:
      early, late = (float(x) for x in sched.split(":"))
      t0 = time.perf_counter()
      video, per_step, _ = sampler.sample(params, cfg, noise, condition, attention="clis_skip", thr_early=early,
                                          thr_late=late)
      psnr, ssim = quality(video, dense)
      records.append(dict(tile=tile, schedule=sched, psnr_db=psnr, ssim=ssim,
                          mean_sparsity=float(np.mean([s["sparsity"] for s in per_step])),
                          last_sparsity=per_step[-1]["sparsity"], seconds=time.perf_counter() - t0))
      print(records[-1], flush=True)
      pathlib.Path(args.out).write_text(json.dumps(dict(records=records, batch=args.batch, device="cpu"), indent=1))


if __name__ == "__main__":
  main()
