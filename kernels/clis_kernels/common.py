"""Small helpers every backend shares: dot precision, and shapes that work inside `jax.shard_map`."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def dot_precision(dtype):
  """f32 inputs get true f32 products (not tf32/bf16 passes); low precision uses the matrix units."""
  return jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None


def out_struct(shape, dtype, like: jax.Array) -> jax.ShapeDtypeStruct:
  """A ShapeDtypeStruct varying over the same manual mesh axes as `like` (q, inside shard_map)."""
  return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=jax.typeof(like).manual_axis_type)


def varying_like(x: jax.Array, like: jax.Array) -> jax.Array:
  """x marked as varying over the manual mesh axes `like` varies over (loop carries in shard_map)."""
  varying = lambda a: jax.typeof(a).manual_axis_type.varying
  missing = tuple(sorted(varying(like) - varying(x)))
  return jax.lax.pcast(x, missing, to="varying") if missing else x


def int32_loop(lower, upper, body, carry):
  """lax.fori_loop with an int32 index whatever the bounds (Python ints become int64 under
  jax_enable_x64, which the Mosaic GPU kernels' int32 slot arithmetic refuses)."""
  return jax.lax.fori_loop(jnp.asarray(lower, jnp.int32), jnp.asarray(upper, jnp.int32), body, carry)
