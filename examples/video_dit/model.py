"""A small Wan-like video DiT in Flax: 3-D patches, 3-D RoPE, self-attention over all video
tokens, cross-attention to the condition tokens, adaLN modulation, flow-matching velocity.

Self-attention has one call site; the caller passes `attend(q, k, v, state) -> (out, state,
aux)` so the sampler chooses the backend (dense XLA, cuDNN, our online or CLiS kernel) and
threads each layer's skip state (kernels/clis_kernels/diffusion) through the steps. Video [B, T, H, W, 3].
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from examples.video_dit.data import VOCAB


@dataclasses.dataclass(frozen=True)
class DiTConfig:
  frames: int = 16
  size: int = 64
  channels: int = 3
  patch: tuple[int, int, int] = (1, 4, 4)
  dim: int = 128
  heads: int = 2
  layers: int = 8
  mlp: int = 512
  rope_split: tuple[int, int, int] = (16, 24, 24)  # head-dim channels rotated by t, h, w
  dtype: str = "bfloat16"

  @property
  def grid(self) -> tuple[int, int, int]:
    return self.frames // self.patch[0], self.size // self.patch[1], self.size // self.patch[2]

  @property
  def tokens(self) -> int:
    return math.prod(self.grid)

  @property
  def head_dim(self) -> int:
    return self.dim // self.heads


def patchify(video, cfg: DiTConfig):
  """[B, T, H, W, C] -> [B, tokens, pt·ph·pw·C], tokens in (t, h, w) order."""
  b = video.shape[0]
  (gt, gh, gw), (pt, ph, pw) = cfg.grid, cfg.patch
  x = video.reshape(b, gt, pt, gh, ph, gw, pw, cfg.channels)
  return x.transpose(0, 1, 3, 5, 2, 4, 6, 7).reshape(b, gt * gh * gw, -1)


def unpatchify(x, cfg: DiTConfig):
  b = x.shape[0]
  (gt, gh, gw), (pt, ph, pw) = cfg.grid, cfg.patch
  x = x.reshape(b, gt, gh, gw, pt, ph, pw, cfg.channels)
  return x.transpose(0, 1, 4, 2, 5, 3, 6, 7).reshape(b, cfg.frames, cfg.size, cfg.size, cfg.channels)


def rope_3d(x, cfg: DiTConfig):
  """Rotary embedding on [B, S, H, D]: the head dim is split into t, h and w parts, each
  rotated by that coordinate of the token (Wan's 3-D RoPE)."""
  coords = jnp.stack(jnp.meshgrid(*(jnp.arange(n) for n in cfg.grid), indexing="ij"), -1).reshape(-1, 3)
  parts, start = [], 0
  for axis, width in enumerate(cfg.rope_split):
    half = width // 2
    freqs = 10000.0 ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angle = coords[:, axis, None].astype(jnp.float32) * freqs  # [S, half]
    cos, sin = jnp.cos(angle)[None, :, None], jnp.sin(angle)[None, :, None]
    a = x[..., start:start + half].astype(jnp.float32)
    b = x[..., start + half:start + width].astype(jnp.float32)
    parts += [a * cos - b * sin, b * cos + a * sin]
    start += width
  return jnp.concatenate(parts, -1).astype(x.dtype)


def timestep_embedding(t, dim):
  half = dim // 2
  freqs = jnp.exp(-math.log(10000.0) * jnp.arange(half) / half)
  angle = 1000.0 * t[:, None] * freqs[None]
  return jnp.concatenate([jnp.cos(angle), jnp.sin(angle)], -1)


def _dense(features, name, dtype, zero=False):
  init = nn.initializers.zeros if zero else nn.initializers.xavier_uniform()
  return nn.Dense(features, dtype=dtype, param_dtype=jnp.float32, name=name, kernel_init=init)


def _norm(x):
  return nn.LayerNorm(use_scale=False, use_bias=False, epsilon=1e-6, dtype=jnp.float32)(x)


class Block(nn.Module):
  cfg: DiTConfig
  attend: Callable

  @nn.compact
  def __call__(self, x, e, ctx, state):
    cfg, dt = self.cfg, jnp.dtype(self.cfg.dtype)
    b, s, _ = x.shape
    mod = e + self.param("modulation", nn.initializers.normal(cfg.dim ** -0.5), (6, cfg.dim))
    shift1, scale1, gate1, shift2, scale2, gate2 = (mod[:, i, None] for i in range(6))

    h = (_norm(x) * (1 + scale1) + shift1).astype(dt)
    split = lambda y: y.reshape(b, -1, cfg.heads, cfg.head_dim)
    q = rope_3d(split(_dense(cfg.dim, "q", dt)(h)), cfg)
    k = rope_3d(split(_dense(cfg.dim, "k", dt)(h)), cfg)
    v = split(_dense(cfg.dim, "v", dt)(h))
    attn, state, aux = self.attend(q, k, v, state)
    x = x + gate1 * _dense(cfg.dim, "o", dt)(attn.reshape(b, s, cfg.dim)).astype(jnp.float32)

    h = _norm(x).astype(dt)
    cq = split(_dense(cfg.dim, "cross_q", dt)(h))
    ck, cv = split(_dense(cfg.dim, "cross_k", dt)(ctx)), split(_dense(cfg.dim, "cross_v", dt)(ctx))
    cross = jax.nn.dot_product_attention(cq, ck, cv, implementation="xla")
    x = x + _dense(cfg.dim, "cross_o", dt)(cross.reshape(b, s, cfg.dim)).astype(jnp.float32)

    h = (_norm(x) * (1 + scale2) + shift2).astype(dt)
    h = _dense(cfg.dim, "mlp_out", dt)(nn.gelu(_dense(cfg.mlp, "mlp_in", dt)(h)))
    return x + gate2 * h.astype(jnp.float32), state, aux


class VideoDiT(nn.Module):
  """velocity = VideoDiT(cfg, attend)(x_t [B, T, H, W, 3], t [B], condition [B, 3], states)."""

  cfg: DiTConfig
  attend: Callable

  @nn.compact
  def __call__(self, video, t, condition, states=None):
    cfg, dt = self.cfg, jnp.dtype(self.cfg.dtype)
    states = states if states is not None else [None] * cfg.layers
    x = _dense(cfg.dim, "patch_embed", dt)(patchify(video, cfg).astype(dt)).astype(jnp.float32)
    temb = _dense(cfg.dim, "time_out", jnp.float32)(nn.silu(_dense(cfg.dim, "time_in", jnp.float32)(
        timestep_embedding(t, cfg.dim))))
    e = _dense(6 * cfg.dim, "time_mod", jnp.float32)(nn.silu(temb)).reshape(-1, 6, cfg.dim)
    ctx = nn.Embed(VOCAB, cfg.dim, param_dtype=jnp.float32, name="cond_embed")(condition).astype(dt)
    new_states, auxes = [], []
    for i in range(cfg.layers):
      x, state, aux = Block(cfg, self.attend, name=f"block_{i}")(x, e, ctx, states[i])
      new_states.append(state)
      auxes.append(aux)
    head = self.param("head_modulation", nn.initializers.normal(cfg.dim ** -0.5), (2, cfg.dim))
    shift, scale = (head[None] + _dense(2 * cfg.dim, "head_mod", jnp.float32)(nn.silu(temb)).reshape(-1, 2, cfg.dim)
                    ).transpose(1, 0, 2)[:, :, None]
    x = _norm(x) * (1 + scale) + shift
    out = _dense(math.prod(cfg.patch) * cfg.channels, "unpatch", jnp.float32, zero=True)(x)
    return unpatchify(out, cfg), new_states, auxes
