"""Output shapes for pallas_call that also work inside `jax.shard_map` (with check_vma)."""

from __future__ import annotations

import jax


def out_struct(shape, dtype, like: jax.Array) -> jax.ShapeDtypeStruct:
  """A ShapeDtypeStruct varying over the same manual mesh axes as `like` (q, inside shard_map)."""
  return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=jax.typeof(like).manual_axis_type)


def varying_like(x: jax.Array, like: jax.Array) -> jax.Array:
  """x marked as varying over the manual mesh axes `like` varies over (loop carries in shard_map)."""
  varying = lambda a: jax.typeof(a).manual_axis_type.varying
  missing = tuple(sorted(varying(like) - varying(x)))
  return jax.lax.pcast(x, missing, to="varying") if missing else x
