"""Synthetic videos: coloured circles and squares that move in a straight line and bounce off the walls.

Rendered on the device, in JAX, from a random key (no files): each batch is new, so training
never repeats a clip. A clip is [T, H, W, 3] in [-1, 1] and comes with its condition, three
token ids: shape (circle, square), colour (4), and the direction quadrant of its motion (4).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

COLOURS = jnp.array([[1.0, 0.2, 0.2], [0.2, 1.0, 0.3], [0.3, 0.4, 1.0], [1.0, 0.9, 0.2]])
VOCAB = 2 + 4 + 4  # condition tokens: shape, colour, direction (offset into one table)


@dataclasses.dataclass(frozen=True)
class VideoSpec:
  frames: int = 16
  size: int = 64
  radius: float = 7.0


def _bounce(x, lo, hi):
  """Reflect positions into [lo, hi] (a ball bouncing between walls)."""
  span = hi - lo
  y = jnp.mod(x - lo, 2 * span)
  return lo + jnp.where(y > span, 2 * span - y, y)


def sample_batch(key, batch: int, spec: VideoSpec = VideoSpec()):
  """Returns (video [B, T, H, W, 3] f32 in [-1, 1], condition [B, 3] int32)."""
  ks = jax.random.split(key, 5)
  shape = jax.random.randint(ks[0], (batch,), 0, 2)
  colour = jax.random.randint(ks[1], (batch,), 0, 4)
  quadrant = jax.random.randint(ks[2], (batch,), 0, 4)
  angle = (quadrant + jax.random.uniform(ks[3], (batch,))) * (jnp.pi / 2)
  speed = 1.5 + 1.5 * jax.random.uniform(ks[4], (batch,))
  start = jax.random.uniform(jax.random.fold_in(key, 7), (batch, 2), minval=spec.radius,
                             maxval=spec.size - spec.radius)
  t = jnp.arange(spec.frames, dtype=jnp.float32)
  velocity = speed[:, None] * jnp.stack([jnp.cos(angle), jnp.sin(angle)], -1)  # [B, 2]
  centre = _bounce(start[:, None] + t[None, :, None] * velocity[:, None], spec.radius,
                   spec.size - 1 - spec.radius)  # [B, T, 2]
  grid = jnp.arange(spec.size, dtype=jnp.float32)
  dy = grid[None, None, :, None] - centre[..., 0, None, None]
  dx = grid[None, None, None, :] - centre[..., 1, None, None]
  circle = jnp.sqrt(dx**2 + dy**2) <= spec.radius
  square = jnp.maximum(jnp.abs(dx), jnp.abs(dy)) <= spec.radius * 0.85
  inside = jnp.where((shape == 0)[:, None, None, None], circle, square)  # [B, T, H, W]
  video = jnp.where(inside[..., None], COLOURS[colour][:, None, None, None, :], 0.0) * 2.0 - 1.0
  condition = jnp.stack([shape, 2 + colour, 6 + quadrant], -1).astype(jnp.int32)
  return video, condition
