"""What the Mosaic GPU kernels (pallas_mgpu.py, pallas_mgpu_vjp.py) share: two compute warpgroups
and one memory warpgroup per CTA, which query rows a CTA owns and which KV blocks they visit, and
the memory warpgroup's loops that stream blocks (K and V blocks, in stream_kv) through shared-memory
slots."""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.pallas import mosaic_gpu as plgpu

from clis_kernels import masks

COMPUTE_WARPGROUPS = 2
WARPGROUP_THREADS = 128
FIRST_NAMED_BARRIER = 4  # Mosaic GPU keeps hardware barriers 0 (the CTA's) and 1-3 (one per warpgroup) for itself
NAMED_BARRIERS = 16  # hardware barriers per CTA
MAX_NAMED_SLOTS = (NAMED_BARRIERS - FIRST_NAMED_BARRIER - COMPUTE_WARPGROUPS) // 2  # two barriers a K/V slot


class NamedBarriers(NamedTuple):
  """Hardware barrier ids of the forward's named-barrier schedule (BlockSizes.named_barriers), FA3's: schedule + w is
  the one compute warpgroup w syncs on before its P·V (the other arrives once its Q·Kᵀ is issued); k_free + slot and
  v_free + slot the ones a K / V slot's consumers arrive on and its streaming warp syncs on before refilling it."""

  schedule: int
  k_free: int
  v_free: int

  @classmethod
  def for_slots(cls, slots: int) -> NamedBarriers:
    k_free = FIRST_NAMED_BARRIER + COMPUTE_WARPGROUPS
    if slots > MAX_NAMED_SLOTS:
      raise ValueError(f"{slots=} must be at most {MAX_NAMED_SLOTS} with named_barriers=True "
                       f"(two hardware barriers a slot, {NAMED_BARRIERS} per CTA)")
    return cls(FIRST_NAMED_BARRIER, k_free, k_free + slots)


SCHEDULE_THREADS = COMPUTE_WARPGROUPS * WARPGROUP_THREADS  # both compute warpgroups meet on a schedule barrier
CONSUMED_THREADS = SCHEDULE_THREADS + 32  # and the one streaming warp on a slot's


def named_barrier(op: str, barrier, threads: int):
  """PTX `bar.arrive` (op "arrive": count the calling threads in and go on) or `bar.sync` ("sync": count them in and
  wait) on hardware barrier `barrier` (a python int or a traced int32) that completes at `threads` threads. It counts
  threads, not phases: a caller must not arrive twice before the barrier completes the first time."""
  if isinstance(barrier, int):
    @plgpu.inline_mgpu()
    def static_op(_):
      mgpu.utils.inline_ptx(f"bar.{op} {barrier}, {threads};", convergent=True)
    static_op()
  else:
    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WG_SPLAT,))
    def dynamic_op(_, barrier_id):
      mgpu.utils.inline_ptx(f"bar.{op} $0, {threads};", barrier_id.registers[()], convergent=True)
    dynamic_op(jnp.asarray(barrier, jnp.int32))


def swizzled():
  """Shared-memory transforms for [rows, D] tiles of 16-bit values that wgmma and TMA read."""
  return plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128)


def cta_first_row(seq: int, rows: int, *, causal: bool):
  """First query row of this CTA (grid axis "q_tiles"; each compute warpgroup owns `rows` rows).
  Causal q tiles run last-first, so the ones with the longest KV ranges start early."""
  num_tiles = seq // (COMPUTE_WARPGROUPS * rows)
  tile = num_tiles - 1 - lax.axis_index("q_tiles") if causal else lax.axis_index("q_tiles")
  return tile * (COMPUTE_WARPGROUPS * rows)


def compiler_params():
  """The Mosaic GPU kernels' CompilerParams: approximate math (ex2, tanh), and Mosaic GPU's in-kernel profiler when
  CLIS_MGPU_PROFILE_DIR names a directory: each warpgroup's time in the kernels' named scopes (the forward's step:
  turn_after_qk, qk_wait, softmax, await_turn, pv) goes there as a Chrome trace per call, the first
  CLIS_MGPU_PROFILE_SPACE events of each warpgroup (default 512; its buffer takes shared memory, 16 bytes an event
  per warpgroup, so 512 fits beside the forward at head dims up to 128)."""
  profile_dir = os.environ.get("CLIS_MGPU_PROFILE_DIR", "")
  space = int(os.environ.get("CLIS_MGPU_PROFILE_SPACE", "512")) if profile_dir else 0
  return plgpu.CompilerParams(approx_math=True, profile_space=space, profile_dir=profile_dir,
                              profile_bounds_check=bool(profile_dir))


def finish_stores():
  """Waits until this warpgroup's TMA stores (and reduce-adds) have read their shared memory: all a CTA needs before
  it reuses those buffers or ends (the global writes land by the kernel's end), as tokamax's and CUTLASS's
  epilogues wait. Waiting for the global writes too held each CTA's end back: gpt-oss's window-128 forward, whose
  CTAs are short, ran 1.17 / 1.08x faster without it at 8k / 32k (BENCHMARKS.md §1)."""
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def kv_blocks(row0, rows, *, causal: bool, block_kv: int, num_kv_blocks: int, kv_len):
  """(unmasked, total) KV blocks for query rows [row0, row0 + rows) (masks.py's ranges; python ints
  when not causal, so those loops get static bounds)."""
  if causal:
    return masks.causal_kv_blocks(lax.div(row0, jnp.int32(rows)), block_q=rows, block_k=block_kv,
                                  num_kv_blocks=num_kv_blocks, div=masks.idiv)
  return masks.bidirectional_kv_blocks(kv_len=kv_len, block_k=block_kv, num_kv_blocks=num_kv_blocks)


def named_free(ids: NamedBarriers):
  """stream_blocks's `free` on named barriers: the streaming warp syncs on the slot's K and V barriers, which complete
  once both compute warpgroups have arrived (pallas_mgpu_mainloop._release)."""
  def free(slot):
    named_barrier("sync", ids.k_free + slot, CONSUMED_THREADS)
    named_barrier("sync", ids.v_free + slot, CONSUMED_THREADS)
  return free


def stream_blocks(load, *, num_blocks, slots: int, free, one_warp: bool = False):
  """The memory warpgroup's loop: load(block, slot) for blocks [0, num_blocks), round-robin over
  `slots` shared-memory buffers; a slot is refilled once every barrier in `free` says both compute
  warpgroups are done with its previous block (or, `free` a function, once free(slot) returns). one_warp: only the
  warpgroup's first warp runs it (as tokamax's forward), so the other three issue nothing on the schedulers they share
  with the compute warps."""
  def loop():
    for slot in range(slots):
      pl.when(slot < num_blocks)(functools.partial(load, jnp.int32(slot), slot))

    @pl.loop(jnp.int32(slots), jnp.asarray(num_blocks, jnp.int32))  # int32 under jax_enable_x64 too
    def _(block):
      slot = lax.rem(block, jnp.int32(slots))
      if callable(free):
        free(slot)
      else:
        for barrier in free:
          plgpu.barrier_wait(barrier.at[slot])
      load(block, slot)

  if one_warp:
    plgpu.warp_map(lambda warp: pl.when(warp == 0)(loop))
  else:
    loop()


def stream_kv(k_ref, v_ref, kseg_ref, k_smem, v_smem, kseg_smem, k_ready, v_ready, kseg_ready, *, batch, kv_head,
              block_kv: int, num_blocks, slots: int, free, block_of=lambda i: i, one_warp: bool = False):
  """stream_blocks for the K and V blocks of one (batch, kv head), and their key segment ids when
  packed (kseg_ref not None): step i loads keys [b·block_kv, (b+1)·block_kv) of block b = block_of(i)
  (i itself, or a kept-tile list's entry)."""
  def load(step, slot):
    keys = pl.ds(block_of(step) * block_kv, block_kv)
    plgpu.copy_gmem_to_smem(k_ref.at[batch, keys, kv_head], k_smem.at[slot], k_ready.at[slot])
    plgpu.copy_gmem_to_smem(v_ref.at[batch, keys, kv_head], v_smem.at[slot], v_ready.at[slot])
    if kseg_ref is not None:
      plgpu.copy_gmem_to_smem(kseg_ref.at[batch, keys], kseg_smem.at[slot], kseg_ready.at[slot])

  stream_blocks(load, num_blocks=num_blocks, slots=slots, free=free, one_warp=one_warp)


RANGE_WIDTH = 16  # a CTA's loop bound (document ranges) travels as one 64-byte TMA row, the bound in entry 0


def range_scratch() -> tuple:
  """Shared memory and barrier for a CTA's range row (read_range_entry)."""
  return plgpu.SMEM((RANGE_WIDTH,), jnp.int32), plgpu.Barrier(num_barriers=1)


def read_range_entry(row_ref, range_smem, range_ready):
  """Entry 0 of a CTA's range row in HBM: the memory warpgroup loads it, every warpgroup reads it."""
  pl.when(lax.axis_index("wg") == COMPUTE_WARPGROUPS)(
      lambda: plgpu.copy_gmem_to_smem(row_ref, range_smem, range_ready.at[0]))
  plgpu.barrier_wait(range_ready.at[0])
  return range_smem[0]
