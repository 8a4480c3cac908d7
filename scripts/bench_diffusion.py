"""Diffusion inference with the example video DiT: dense vs CLiS vs CLiS + temporal tile skipping.

For every variant, the same noise and conditions are sampled with the flow-matching Euler
sampler (examples/video_dit); skip variants follow a thr schedule (--schedules) or calibrate each
layer's thr to a relative L1 target every step (--calibrate; eager, so its step latency is not
comparable). Records per step: latency (a second, warm run of the sampler),
the self-attention time of all layers (each layer's attention timed alone on the step's skip
state, variants interleaved), and the fraction of tiles skipped; per variant: PSNR and SSIM of
the final videos against the dense XLA sample from the same noise (run first; without xla, the
first variant's), and for skip variants against their unskipped twin (the same skip path and step programs,
thr −1e4, which marks nothing): what skipping alone moved, apart from any kernel's rounding. The JSON records
are rewritten after every variant, so a run cut short keeps what it measured; at the end come a markdown table, a PNG plot of sparsity and attention time per step, and an image strip of
dense and accelerated samples (same stem).

Run it as a module from the repository root (it imports the example, examples/video_dit):
  python -m scripts.bench_diffusion --weights examples/video_dit/weights.safetensors --out benchmarks/results/x.json
  python -m scripts.bench_diffusion --quick --out /tmp/diff.json     # tiny random model, CPU
(schedules start with "-": quote them with a leading space, --schedules " -14:-8" " -10:-4", or argparse
reads them as options)
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from clis_kernels import diffusion
from clis_train import benchmarking
from examples.video_dit import sampler, train
from examples.video_dit.model import VideoDiT


def quality(video, reference):
  """(PSNR dB, SSIM) of videos [B, T, H, W, 3] in [-1, 1] against the reference, averaged over frames."""
  from skimage.metrics import structural_similarity
  a, b = np.asarray(video, np.float64).clip(-1, 1), np.asarray(reference, np.float64).clip(-1, 1)
  mse = np.mean((a - b) ** 2)
  psnr = float("inf") if mse == 0 else 10 * math.log10(4.0 / mse)
  ssim = np.mean([structural_similarity(x, y, data_range=2.0, channel_axis=-1, win_size=7)
                  for x, y in zip(a.reshape(-1, *a.shape[2:]), b.reshape(-1, *b.shape[2:]))])
  return psnr, float(ssim)


def attention_times(cfg, name, states_per_step, thrs, batch, *, repeats, inner):
  """Per step, ms of all layers' self-attention alone (random q, k, v of the model's shape)."""
  shape = (batch, cfg.tokens, cfg.heads, cfg.head_dim)
  q, k, v = (jax.random.normal(jax.random.PRNGKey(i), shape, jnp.dtype(cfg.dtype)) for i in range(3))
  fns = {}
  for step, states in enumerate(states_per_step):
    track = sampler.is_skipping(name) and thrs[step] > -math.inf
    attend = jax.jit(lambda q, k, v, s, thr, track=track: sampler.make_attend(name, thr if track else -math.inf, cfg)(
        q, k, v, s)[0])
    for layer in range(cfg.layers):
      state = None if states is None else states[layer]
      fns[(step, layer)] = functools.partial(attend, q, k, v, state, jnp.float32(max(thrs[step], -1e4)))
  timed = benchmarking.interleaved_medians(fns, repeats=repeats, inner=inner, warmup=1)
  return [sum(timed[(s, layer)][0] for layer in range(cfg.layers)) for s in range(len(states_per_step))]


def image_strip(videos: dict, path: pathlib.Path, clip: int = 0):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  names = list(videos)
  frames = videos[names[0]].shape[1]
  picks = sorted({0, frames // 2, frames - 1})
  fig, axes = plt.subplots(len(names), len(picks), figsize=(1.6 * len(picks), 1.6 * len(names)), squeeze=False)
  for r, name in enumerate(names):
    for c, f in enumerate(picks):
      axes[r][c].imshow((np.asarray(videos[name][clip, f], np.float32).clip(-1, 1) + 1) / 2)
      axes[r][c].set_xticks([])
      axes[r][c].set_yticks([])
      if c == 0:
        axes[r][c].set_ylabel(name, fontsize=7)
      if r == 0:
        axes[r][c].set_title(f"frame {f}", fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def plot_steps(records, path: pathlib.Path):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.2))
  for r in records:
    steps = [s["step"] for s in r["per_step"]]
    a.plot(steps, [s["attention_ms"] for s in r["per_step"]], label=r["impl"])
    b.plot(steps, [s["sparsity"] for s in r["per_step"]], label=r["impl"])
  a.set_xlabel("denoising step")
  a.set_ylabel("self-attention ms (all layers)")
  b.set_xlabel("denoising step")
  b.set_ylabel("fraction of tiles skipped")
  a.legend(fontsize=7)
  benchmarking.save_figure(fig, path, records[0])


UNSKIPPED_THR = -1e4  # marks nothing (no tile's bound is that low), yet runs the marking step programs


def main():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--weights", default="examples/video_dit/weights.safetensors")
  p.add_argument("--impls", nargs="+", default=["xla", "cudnn", "online", "clis", "clis_skip"])
  p.add_argument("--schedules", nargs="+", default=["-14:-8", "-10:-4"],
                 help="thr_early:thr_late (log2) for each skip run")
  p.add_argument("--calibrate", type=float, nargs="*", default=[0.01],
                 help="relative L1 targets: skip runs whose layers bisect thr every step (diffusion.calibrate_thr)")
  p.add_argument("--steps", type=int, default=20)
  p.add_argument("--dense-steps", type=int, default=4)
  p.add_argument("--batch", type=int, default=4)
  p.add_argument("--repeats", type=int, default=5)
  p.add_argument("--inner", type=int, default=5)
  p.add_argument("--quick", action="store_true", help="a tiny random model on the CPU")
  p.add_argument("--out", default=None)
  args = p.parse_args()
  if args.quick:
    cfg = train.TINY
    params = VideoDiT(cfg, sampler.make_attend("xla")).init(
        jax.random.PRNGKey(0), jnp.zeros((1, cfg.frames, cfg.size, cfg.size, 3)), jnp.zeros((1,)),
        jnp.zeros((1, 3), jnp.int32))["params"]
    # random weights everywhere (the output layer starts at zero, which would make every sample the noise)
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.PRNGKey(1), len(leaves))
    params = jax.tree.unflatten(tree, [x + 0.05 * jax.random.normal(k_, x.shape) for x, k_ in zip(leaves, keys)])
    args.impls, args.schedules, args.steps, args.dense_steps = ["xla", "clis", "clis_skip"], ["-6:-2"], 3, 1
    args.calibrate = [0.01]
    args.batch, args.repeats, args.inner = 1, 2, 1
  else:
    params, cfg = train.load(args.weights)
  if jax.devices()[0].platform != "gpu":
    args.impls = [i for i in args.impls if i != "cudnn"]
  noise = jax.random.normal(jax.random.PRNGKey(123), (args.batch, cfg.frames, cfg.size, cfg.size, 3))
  condition = jnp.stack([jnp.arange(args.batch) % 2, 2 + jnp.arange(args.batch) % 4,
                         6 + (jnp.arange(args.batch) // 2) % 4], -1).astype(jnp.int32)
  variants = []
  for impl in args.impls:
    if sampler.is_skipping(impl):  # first its unskipped twin: the same step programs (marking on), no tile marked
      variants.append((impl, (UNSKIPPED_THR, UNSKIPPED_THR)))
      variants += [(impl, tuple(float(x) for x in sched.split(":"))) for sched in args.schedules]
      variants += [(impl, ("cal", target)) for target in args.calibrate]
    else:
      variants.append((impl, None))
  variants.sort(key=lambda v: v[0] != "xla")  # the dense XLA sample first: the quality reference

  out = pathlib.Path(args.out or benchmarking.default_output("diffusion_quick" if args.quick else "diffusion"))
  out.parent.mkdir(parents=True, exist_ok=True)
  meta = benchmarking.device_meta()
  videos, records = {}, []
  for impl, sched in variants:
    kw = dict(attention=impl, steps=args.steps, dense_steps=args.dense_steps)
    if sched is None:
      label = impl
    elif sched[0] == "cal":
      label = f"{impl}[cal {sched[1]:g}]"
      kw.update(calibrate=sched[1])
    else:
      label = f"{impl}[{sched[0]:g}:{sched[1]:g}]"
      kw.update(thr_early=sched[0], thr_late=sched[1])
    if "calibrate" not in kw:
      sampler.sample(params, cfg, noise, condition, **kw)  # compile (calibrated steps run eagerly)
    video, per_step, states = sampler.sample(params, cfg, noise, condition, timing=True, keep_states=True, **kw)
    videos[label] = video
    thrs = [s["thr"] for s in per_step]
    att = attention_times(cfg, impl, states, thrs, args.batch, repeats=args.repeats, inner=args.inner)
    for s, ms in zip(per_step, att):
      s["attention_ms"] = ms
    records.append(dict(case=f"video_dit_T{cfg.frames}_{cfg.size}px_S{cfg.tokens}", impl=label, schedule=sched,
                        steps=args.steps, dense_steps=args.dense_steps, B=args.batch, S=cfg.tokens, H=cfg.heads,
                        D=cfg.head_dim, layers=cfg.layers, per_step=per_step,
                        step_ms=float(np.median([s["ms"] for s in per_step])),
                        attention_ms=float(np.sum(att)), mean_sparsity=float(np.mean([s["sparsity"] for s in per_step])),
                        **meta))
    records[-1]["psnr_db"], records[-1]["ssim"] = quality(video, next(iter(videos.values())))
    dense_twin = impl.replace("_skip", "")  # clis_skip -> clis, clis_skip_cp -> clis_cp
    if sampler.is_skipping(impl) and dense_twin in videos:
      records[-1]["psnr_vs_dense_same_kernel_db"] = quality(video, videos[dense_twin])[0]
    twin = f"{impl}[{UNSKIPPED_THR:g}:{UNSKIPPED_THR:g}]"
    if sampler.is_skipping(impl) and label != twin and twin in videos:  # what skipping alone moved
      records[-1]["psnr_vs_unskipped_db"], records[-1]["ssim_vs_unskipped"] = quality(video, videos[twin])
    out.write_text(json.dumps(records, indent=1))  # after every variant: a run cut short keeps what it measured
    print(f"{label}: median step {records[-1]['step_ms']:.2f} ms, attention {records[-1]['attention_ms']:.2f} ms "
          f"over {args.steps} steps, mean sparsity {records[-1]['mean_sparsity']:.3f}, "
          f"PSNR {records[-1]['psnr_db']:.2f} dB, SSIM {records[-1]['ssim']:.4f}", flush=True)

  base = {r["impl"]: r for r in records}
  dense = base.get("clis") or records[0]
  lines = ["| impl | median step ms | attention ms (all steps) | vs clis dense | mean sparsity | PSNR dB | SSIM |",
           "|---|---|---|---|---|---|---|"]
  for r in records:
    lines.append(f"| {r['impl']} | {r['step_ms']:.2f} | {r['attention_ms']:.2f} | "
                 f"{dense['attention_ms'] / r['attention_ms']:.3f}× | {r['mean_sparsity']:.3f} | {r['psnr_db']:.2f} | "
                 f"{r['ssim']:.4f} |")
  out.with_suffix(".md").write_text("\n".join(lines) + "\n")
  plot_steps(records, out.with_suffix(".png"))
  image_strip(videos, out.with_name(out.stem + "_strip.png"))
  print("\n".join(lines))
  print("wrote", out)


if __name__ == "__main__":
  main()
