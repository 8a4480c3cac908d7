"""What the Mosaic GPU kernels (pallas_mgpu.py, pallas_mgpu_vjp.py) share: two compute warpgroups
and one memory warpgroup per CTA, and the memory warpgroup's loop that streams blocks through
shared-memory slots."""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

COMPUTE_WARPGROUPS = 2


def swizzled():
  """Shared-memory transforms for [rows, D] tiles of 16-bit values that wgmma and TMA read."""
  return plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128)


def stream_blocks(load, *, num_blocks, slots: int, free):
  """The memory warpgroup's loop: load(block, slot) for blocks [0, num_blocks), round-robin over
  `slots` shared-memory buffers; a slot is refilled once every barrier in `free` says both compute
  warpgroups are done with its previous block."""
  for slot in range(slots):
    pl.when(slot < num_blocks)(functools.partial(load, jnp.int32(slot), slot))

  @pl.loop(slots, num_blocks)
  def _(block):
    slot = lax.rem(block, jnp.int32(slots))
    for barrier in free:
      plgpu.barrier_wait(barrier.at[slot])
    load(block, slot)
