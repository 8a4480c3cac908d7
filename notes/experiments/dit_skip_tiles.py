"""Does the skip tile's size explain the example DiT's quality with skipping? The trained example DiT sampled on
the CPU with the reference skip forward at 64 x 64 and 128 x 128 tiles (the Triton kernel's and the Mosaic GPU
kernel's), each thr schedule, PSNR/SSIM against the dense XLA sample from the same noise (bench_diffusion's),
and the dense kernels' own PSNR against it (the floor that kernel rounding alone sets); with --twin, each
schedule also against the same skip path with nothing marked.

  python -m notes.experiments.dit_skip_tiles --out notes/experiments/dit_skip_tiles.json
  python -m notes.experiments.dit_skip_tiles --tiles 128 --statistic exact --dense --twin --out twin.json
"""

import argparse
import functools
import json
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np

from clis_kernels import masks, plan as plan_lib, reference
from clis_kernels.diffusion import tile_lists
from clis_kernels.plan import Mode, stabilizer_inputs
from clis_kernels.stabilizer import NEG
from examples.video_dit import sampler, train
from scripts.bench_diffusion import quality


def with_tiles(cfg, tile):
  """The sampler's skip plan with the reference at tile x tile."""
  return plan_lib.make_plan(dtype=jnp.dtype(cfg.dtype), head_dim=cfg.head_dim, seq_len=cfg.tokens, skipping=True,
                            implementation="reference", block_sizes=reference.BlockSizes(block_q=tile, block_k=tile))


def exact_reference_forward(q, k, v, skip, stab, *, mode, scale, kv_len, seq_len, block_sizes, track, interpret=False):
  """tile_lists.reference_forward with the Mosaic GPU skip kernel's statistic: per tile the max over rows of
  (row max − m_i − log2 l_i), i.e. max (t_ij − lse_i) for a fixed stabilizer, instead of the max and the min
  over rows taken apart."""
  del track, interpret
  _, cert = stabilizer_inputs(stab, mode)
  bq = block_sizes.block_q
  out, _, (gap_rows, log2_l_rows) = reference.forward_with_tiles(
      q, k, v, None, cert, causal=False, scale=scale, kv_len=kv_len, block_sizes=block_sizes, tile_skip=skip,
      tile_gap=True)
  real = masks.query_is_real(None, q.shape[1], seq_len)[0][None, None, :, None]
  excess = jnp.where(real, gap_rows - log2_l_rows[..., None], NEG)
  gap = excess.reshape(excess.shape[0], excess.shape[1], q.shape[1] // bq, bq, -1).max(axis=3)
  return out, gap, jnp.zeros(gap.shape[:3], jnp.float32)


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--weights", default="examples/video_dit/weights.safetensors")
  p.add_argument("--tiles", type=int, nargs="*", default=[64, 128])
  p.add_argument("--schedules", nargs="+", default=["-10:-4", "-14:-8"])
  p.add_argument("--batch", type=int, default=4)
  p.add_argument("--dense", nargs="*", default=["clis"], help="dense backends to sample as the quality floor")
  p.add_argument("--statistic", choices=["bound", "exact"], default="bound",
                 help="the reference's marking statistic (bound: gap − log2_l; exact: as the Mosaic GPU kernel)")
  p.add_argument("--twin", action="store_true",
                 help="first sample each tile's unskipped twin (thr -1e4: the same step programs, nothing marked) and "
                      "give every schedule's PSNR against it")
  p.add_argument("--out", required=True)
  args = p.parse_args()
  if args.twin:
    args.schedules = ["-10000:-10000"] + args.schedules
  params, cfg = train.load(args.weights)
  if args.statistic == "exact":
    tile_lists.reference_forward = exact_reference_forward  # plan.py loads the skip forward by name
  noise = jax.random.normal(jax.random.PRNGKey(123), (args.batch, cfg.frames, cfg.size, cfg.size, 3))
  condition = jnp.stack([jnp.arange(args.batch) % 2, 2 + jnp.arange(args.batch) % 4,
                         6 + (jnp.arange(args.batch) // 2) % 4], -1).astype(jnp.int32)
  dense = sampler.sample(params, cfg, noise, condition, attention="xla")[0]
  records = []
  dense_samples = {}
  for name in args.dense:  # the floor: dense kernels against dense XLA, the same bf16 model and noise
    dense_samples[name] = sampler.sample(params, cfg, noise, condition, attention=name)[0]
    psnr, ssim = quality(dense_samples[name], dense)
    records.append(dict(tile=None, schedule=f"dense {name}", psnr_db=psnr, ssim=ssim, mean_sparsity=0.0))
    print(records[-1], flush=True)
    pathlib.Path(args.out).write_text(json.dumps(dict(records=records, batch=args.batch, device="cpu"), indent=1))
  for tile in args.tiles:
    sampler.skip_plan = functools.lru_cache(maxsize=None)(functools.partial(with_tiles, tile=tile))
    sampler._step_fn.cache_clear()
    twin = None
    for sched in args.schedules:
      early, late = (float(x) for x in sched.split(":"))
      t0 = time.perf_counter()
      video, per_step, _ = sampler.sample(params, cfg, noise, condition, attention="clis_skip", thr_early=early,
                                          thr_late=late)
      psnr, ssim = quality(video, dense)
      records.append(dict(tile=tile, schedule=sched, statistic=args.statistic, psnr_db=psnr, ssim=ssim,
                          psnr_vs_dense_db={n: quality(video, d)[0] for n, d in dense_samples.items()},
                          mean_sparsity=float(np.mean([s["sparsity"] for s in per_step])),
                          last_sparsity=per_step[-1]["sparsity"], seconds=time.perf_counter() - t0))
      if args.twin and twin is None:
        twin = video
      elif args.twin:
        records[-1]["psnr_vs_twin_db"], records[-1]["ssim_vs_twin"] = quality(video, twin)
      print(records[-1], flush=True)
      pathlib.Path(args.out).write_text(json.dumps(dict(records=records, batch=args.batch, device="cpu"), indent=1))


if __name__ == "__main__":
  main()
