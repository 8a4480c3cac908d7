"""Trains the example DiT on synthetic bouncing shapes (flow matching) and saves its weights.

  python -m examples.video_dit.train --minutes 4 --out examples/video_dit/weights.safetensors
  python -m examples.video_dit.train --steps 2 --batch 2 --tiny --out /tmp/w.safetensors   # CPU smoke run

Rectified flow: x_t = (1 − t)·x0 + t·ε, the model predicts ε − x0, t ~ logit-normal. AdamW with
warm-up and cosine decay (optax). Weights go to one safetensors file (a few MB), with the
config beside them in its metadata, so `load` rebuilds the model.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import traverse_util
from safetensors.numpy import load_file, save_file

from examples.video_dit import data
from examples.video_dit.model import DiTConfig, VideoDiT
from examples.video_dit.sampler import make_attend

TINY = DiTConfig(frames=4, size=16, dim=32, heads=2, layers=2, mlp=64, rope_split=(4, 6, 6))


def save(params, cfg: DiTConfig, path: str) -> None:
  flat = {"/".join(k): np.asarray(v, np.float32) for k, v in traverse_util.flatten_dict(params).items()}
  save_file(flat, path, metadata={"config": json.dumps(dataclasses.asdict(cfg))})


def load(path: str):
  """(params, DiTConfig) from a file written by `save`."""
  from safetensors import safe_open
  with safe_open(path, "numpy") as f:
    cfg_dict = json.loads(f.metadata()["config"])
  cfg = DiTConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in cfg_dict.items()})
  flat = {tuple(k.split("/")): jnp.asarray(v) for k, v in load_file(path).items()}
  return traverse_util.unflatten_dict(flat), cfg


def loss_fn(params, model, video, condition, key):
  k_t, k_noise = jax.random.split(key)
  t = jax.nn.sigmoid(jax.random.normal(k_t, (video.shape[0],)))
  noise = jax.random.normal(k_noise, video.shape)
  x_t = (1 - t)[:, None, None, None, None] * video + t[:, None, None, None, None] * noise
  velocity, _, _ = model.apply({"params": params}, x_t, t, condition)
  return jnp.mean((velocity - (noise - video)) ** 2)


def main():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--minutes", type=float, default=4.0, help="wall-clock training budget")
  p.add_argument("--steps", type=int, default=100_000, help="upper bound on steps")
  p.add_argument("--batch", type=int, default=16)
  p.add_argument("--lr", type=float, default=1e-3)
  p.add_argument("--attention", default="clis", choices=["xla", "cudnn", "online", "clis"])
  p.add_argument("--tiny", action="store_true", help="a tiny model and video (CPU smoke runs)")
  p.add_argument("--out", required=True)
  p.add_argument("--log", default=None, help="JSON with the loss curve")
  args = p.parse_args()
  cfg = TINY if args.tiny else DiTConfig()
  spec = data.VideoSpec(frames=cfg.frames, size=cfg.size, radius=max(2.0, cfg.size / 9))
  model = VideoDiT(cfg, make_attend(args.attention))
  key = jax.random.PRNGKey(0)
  video, condition = data.sample_batch(key, 2, spec)
  params = model.init(key, video, jnp.zeros((2,)), condition)["params"]
  n_params = sum(x.size for x in jax.tree.leaves(params))
  expected_steps = min(args.steps, 20_000)
  schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, min(500, expected_steps // 10 + 1), expected_steps,
                                                args.lr * 0.05)
  opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.01))
  opt_state = opt.init(params)

  @jax.jit
  def train_step(params, opt_state, key):
    k_data, k_loss = jax.random.split(key)
    video, condition = data.sample_batch(k_data, args.batch, spec)
    loss, grads = jax.value_and_grad(loss_fn)(params, model, video, condition, k_loss)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  print(f"{n_params / 1e6:.2f} M parameters, {cfg.tokens} tokens per clip, attention={args.attention}", flush=True)
  start, log, step = time.time(), [], 0
  while step < args.steps and time.time() - start < args.minutes * 60:
    params, opt_state, loss = train_step(params, opt_state, jax.random.fold_in(key, step))
    step += 1
    if step % 100 == 0 or step == 1 or step == args.steps:
      log.append(dict(step=step, loss=float(loss), seconds=time.time() - start))
      print(f"step {step} loss {float(loss):.4f} {time.time() - start:.0f}s", flush=True)
  save(params, cfg, args.out)
  if args.log:
    with open(args.log, "w") as f:
      json.dump(dict(config=dataclasses.asdict(cfg), params=n_params, batch=args.batch, attention=args.attention,
                     device=jax.devices()[0].device_kind, steps=step, curve=log), f, indent=1)
  print(f"saved {args.out} after {step} steps", flush=True)


if __name__ == "__main__":
  main()
