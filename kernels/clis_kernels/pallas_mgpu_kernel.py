"""The Mosaic GPU forward kernel's structure and prologue (pallas_mgpu.py launches it; pallas_mgpu_mainloop.py holds
its KV loop and epilogue).

Named parts: `Config` (static), `Refs` (global memory), `Scratch` / `KeysScratch` / `SegScratch` / `ListScratch`
(shared memory and barriers, `_scratch`), `Rows` (one compute warpgroup's runtime values). `kernel` splits the CTA
into two compute warpgroups (`_compute_warpgroup`: loads, then `_certify_here` (`_bound_rows`, `_decide`) or
`_read_certificate`, then pallas_mgpu_mainloop.attend) and the memory warpgroup (mgpu_pipeline.stream_kv). With
BlockSizes.heads_per_cta a CTA walks several heads of one GQA group (`_q_buffer`, `_q_parities`); `forward_listed`'s
kept-tile lists are read by `_listed_range` and `_list_entry`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from clis_kernels import masks
from clis_kernels.common import int32_loop
from clis_kernels.mgpu_pipeline import (COMPUTE_WARPGROUPS, NamedBarriers, cta_first_row, kv_blocks, named_free,
                                        range_scratch, read_range_entry, stream_kv, swizzled)
from clis_kernels.pallas_mgpu_mainloop import SUM_COLUMNS, TANH_ERROR, attend, cap_tanh, take_turn, turn
from clis_kernels.stabilizer import row_bounds, stabilize

FAILED_TILE_M = 1e30  # M sent for rows of a tile the XLA certificate failed (real M are far smaller)
LIST_COLUMNS = 128  # a kept-tile list lies in rows of this many entries (one TMA box holds <= 256 per dimension)


@dataclasses.dataclass(frozen=True)
class Config:
  """The kernel's static parameters (what `forward` decides before the launch)."""

  mode: str  # "keys" (certify in the prologue) | "cert" (read the XLA certificate) | "online"
  causal: bool
  sigma2: float  # scale · log2 e
  block_q: int
  block_kv: int
  slots: int
  kv_len: int | None
  group: int  # query heads per kv head
  has_segments: bool
  row_centres: bool  # bidirectional packed rows: each row's own segment centre
  pingpong: bool
  overlap: bool
  exact_sum: bool
  tc_sum: bool  # BlockSizes.sum_on_tensor_cores, in a mode with a certified loop
  lse_sum: bool = False  # certified rows carry the unrounded weights' sum for lse (exact_lse with exact_sum)
  listed: bool = False  # walk a kept-tile list per CTA (temporal skipping; bidirectional, unpacked)
  track: bool = False  # listed: write each visited block's row maxima (the skip marking statistic)
  list_width: int = 0  # listed: entries per list (a power of two); the last holds the count
  doc_ranges: bool = False  # causal, packed: each CTA's loop starts at its documents' first KV block
  window: tuple[int, int] | None = None  # local (left, right): the CTA visits its band's blocks only
  cap2: float | None = None  # base-2 soft cap c·log2 e of c·tanh(s / c), or None
  tanh: str = "approx"  # BlockSizes.soft_cap_tanh
  heads: int = 1  # BlockSizes.heads_per_cta
  sinks: bool = False  # learned sink logits: the epilogue adds each head's term to the rows' sums (`_add_sink`)
  one_memory_warp: bool = True  # BlockSizes.one_memory_warp
  named: bool = False  # BlockSizes.named_barriers

  @property
  def barriers(self) -> NamedBarriers:
    """The hardware barrier ids of the named-barrier schedule (used when `named`)."""
    return NamedBarriers.for_slots(self.slots)

  @property
  def logit_scale(self) -> float:
    """What turns the loop's Q·Kᵀ (`_capped`) into base-2 logits: σ₂, or cap2 (one multiply fewer per logit)."""
    return self.sigma2 if self.cap2 is None else self.cap2


class Refs(NamedTuple):
  """Global-memory operands; None where the mode or layout has none."""

  q: Any
  k: Any
  v: Any
  qseg: Any
  kseg: Any
  m: Any  # "cert": M per row (FAILED_TILE_M where the tile failed)
  centre: Any  # "keys": the K/V pre-pass's centre(s)
  bounds: Any  # "keys": radius, headroom, threshold, slack per row
  o: Any  # [B, S, Hq, Dv]
  lse: Any
  flags: Any  # "keys": the certified flag per row, out
  ones: Any = None  # tc_sum: [block_kv, 16] ones, the B operand of the sum's wgmma
  visit: Any = None  # listed: [B, Hq, CTAs, rows, columns] int32, kept KV blocks in order, the count last
  rowmax: Any = None  # track: [B, Hq, KV blocks, S] f32 out, max_j t_ij per visited block and row (log2 units)
  first: Any = None  # doc_ranges: [B, CTAs, RANGE_WIDTH] int32, the CTA's first KV block in entry 0
  sinks: Any = None  # sinks: [Hq, block_q] f32, each head's sink logit (base 2) repeated over a tile's rows


class Scratch(NamedTuple):
  """Shared memory and barriers of every mode."""

  qo: Any  # [2, block_q, D]: q in, then o out (SPLIT_HEAD_DIMS: o through `o`, in the same bytes)
  k: Any  # [slots, block_kv, D]
  v: Any  # [slots, block_kv, Dv]
  rows: Any  # [2, block_q] f32: M in, lse out
  k_ready: Any
  v_ready: Any
  q_ready: Any
  m_ready: Any
  k_free: Any  # each compute warpgroup arrives when it has read a slot's K
  v_free: Any
  schedule: Any  # the compute warpgroups' turns on the tensor cores
  ones: Any = None  # tc_sum: [block_kv, 16] ones in shared memory, and its TMA's barrier
  ones_ready: Any = None
  o: Any = None  # SPLIT_HEAD_DIMS: [2, block_q·D/Dv, Dv], o out through rows [0, block_q) of each warpgroup's q bytes
  sinks: Any = None  # sinks: [heads · 2, block_q] f32, one sink row per (head of the CTA, compute warpgroup)
  sinks_ready: Any = None


class KeysScratch(NamedTuple):
  """Mode "keys": what the prologue certificate reads."""

  centre: Any
  kdiag: Any  # each row's own key (causal: L = t_ii)
  flag: Any
  bounds: Any
  kdiag_ready: Any
  bounds_ready: Any
  centre_ready: Any


class SegScratch(NamedTuple):
  """Packed segments: the rows' ids and one block of key ids per slot; with doc_ranges, the CTA's first block."""

  qseg: Any
  kseg: Any
  qseg_ready: Any
  kseg_ready: Any
  first: Any = None
  first_ready: Any = None


class ListScratch(NamedTuple):
  """Kept-tile lists: the CTA's list, and two row-maximum buffers per compute warpgroup (track)."""

  visit: Any
  visit_ready: Any
  rowmax: Any


class Rows(NamedTuple):
  """What one compute warpgroup works on."""

  wg: Any
  batch: Any
  head: Any
  kv_head: Any
  row0: Any  # first query row
  full: Any  # KV blocks wholly visible (no mask)
  total: Any  # KV blocks this warpgroup visits
  cta_blocks: Any  # KV blocks the CTA streams (the other warpgroup may need more)
  q_smem: Any
  rows: Any
  q_ids: Any  # segment ids of the rows, or None
  dtype: Any  # q's (the weights are rounded to it for P·V)
  take_turn: Callable  # take_turn and turn bound once per CTA: pl.when traces each function once
  turn: Callable
  block_of: Callable  # loop step -> the KV block it visits (the step itself, or the kept-tile list's entry)
  lists: Any = None  # ListScratch when listed
  rowmax: Any = None  # track: the row-maximum output (Refs.rowmax)
  lead: Any = 0  # window: steps [0, lead) are masked too (the band's lower edge); [lead, full) are whole
  o_smem: Any = None  # where the epilogue stages o: q_smem, or Scratch.o's buffer
  base: Any = 0  # heads_per_cta: the stream's step of this head's first block (loop steps count from it)
  sink: Any = None  # sinks: (this head's sink row in shared memory, its barrier)


def _scratch(c: Config, dtype, head_dim: int, value_head_dim: int):
  """The run_scoped allocations, grouped as Scratch, KeysScratch, SegScratch, ListScratch (each but the
  first None where the call has none)."""
  wgs, bq, bkv = COMPUTE_WARPGROUPS, c.block_q, c.block_kv
  qbufs = wgs * _q_parities(c)
  qo = plgpu.SMEM((qbufs, bq, head_dim), dtype, transforms=swizzled())
  if value_head_dim != head_dim:  # o [bq, Dv] of warpgroup w lies in q's bytes of w: it is written once q is read
    qo = plgpu.RefUnion(qo, plgpu.SMEM((wgs, bq * head_dim // value_head_dim, value_head_dim), dtype,
                                       transforms=swizzled()))
  common = Scratch(
      qo,
      plgpu.SMEM((c.slots, bkv, head_dim), dtype, transforms=swizzled()),
      plgpu.SMEM((c.slots, bkv, value_head_dim), dtype, transforms=swizzled()),
      plgpu.SMEM((wgs, bq), jnp.float32),
      plgpu.Barrier(num_barriers=c.slots), plgpu.Barrier(num_barriers=c.slots),
      plgpu.Barrier(num_barriers=qbufs), plgpu.Barrier(num_barriers=wgs),
      plgpu.Barrier(num_arrivals=wgs, num_barriers=c.slots), plgpu.Barrier(num_arrivals=wgs, num_barriers=c.slots),
      plgpu.Barrier(num_arrivals=wgs),
      *((plgpu.SMEM((bkv, SUM_COLUMNS), dtype, transforms=(plgpu.TilingTransform((8, SUM_COLUMNS)),
                                                            plgpu.SwizzleTransform(2 * SUM_COLUMNS))),
         plgpu.Barrier(num_barriers=1)) if c.tc_sum else ()))
  if c.sinks:
    common = common._replace(sinks=plgpu.SMEM((c.heads * wgs, bq), jnp.float32),
                             sinks_ready=plgpu.Barrier(num_barriers=c.heads * wgs))
  keys = None
  if c.mode == "keys":
    keys = KeysScratch(
        plgpu.SMEM((bq, head_dim), dtype, transforms=swizzled()) if c.row_centres
        else plgpu.SMEM((wgs, head_dim), jnp.float32),
        plgpu.SMEM((wgs, bq, head_dim), dtype, transforms=swizzled()),
        plgpu.SMEM((wgs, bq), jnp.float32),
        plgpu.SMEM((wgs, 4, bq), jnp.float32),
        plgpu.Barrier(num_barriers=wgs), plgpu.Barrier(num_barriers=wgs), plgpu.Barrier(num_barriers=wgs))
  segs = None
  if c.has_segments:
    segs = SegScratch(plgpu.SMEM((wgs, bq), jnp.int32), plgpu.SMEM((c.slots, bkv), jnp.int32),
                       plgpu.Barrier(num_barriers=wgs), plgpu.Barrier(num_barriers=c.slots),
                       *(range_scratch() if c.doc_ranges else ()))
  lists = None
  if c.listed:
    lists = ListScratch(plgpu.SMEM(list_shape(c.list_width), jnp.int32), plgpu.Barrier(num_barriers=1),
                         plgpu.SMEM((wgs, 2, bq), jnp.float32))
  return common, keys, segs, lists


def _q_parities(c: Config) -> int:
  """q tiles in flight per compute warpgroup: two when the CTA walks several heads (the next one loads while this one
  runs), else one."""
  return 2 if c.heads > 1 else 1


def kernel(q_ref, k_ref, v_ref, *refs, config: Config):
  c = config
  qseg_ref = kseg_ref = m_ref = centre_ref = bounds_ref = flags_ref = ones_ref = visit_ref = rowmax_ref = None
  first_ref = sinks_ref = None
  num_outputs = 2 + (c.mode == "keys") + c.track
  inputs, outputs = refs[:-num_outputs], refs[-num_outputs:]
  if c.has_segments:
    (qseg_ref, kseg_ref), inputs = inputs[:2], inputs[2:]
  if c.doc_ranges:
    (first_ref,), inputs = inputs[:1], inputs[1:]
  if c.listed:
    (visit_ref,), inputs = inputs[:1], inputs[1:]
  if c.tc_sum:  # the last input
    ones_ref, inputs = inputs[-1], inputs[:-1]
  if c.sinks:  # the last but ones
    sinks_ref, inputs = inputs[-1], inputs[:-1]
  if c.mode == "cert":
    (m_ref,) = inputs
  elif c.mode == "keys":
    centre_ref, bounds_ref = inputs
  o_ref, lse_ref, *rest = outputs
  if c.mode == "keys":
    flags_ref, rest = rest[0], rest[1:]
  if c.track:
    (rowmax_ref,) = rest
  g = Refs(q_ref, k_ref, v_ref, qseg_ref, kseg_ref, m_ref, centre_ref, bounds_ref, o_ref, lse_ref, flags_ref,
            ones_ref, visit_ref, rowmax_ref, first_ref, sinks_ref)
  dtype, head_dim = q_ref.dtype, q_ref.shape[-1]
  batch, head = lax.axis_index("batch"), lax.axis_index("heads")
  if c.heads > 1:  # the CTA's first head; it walks heads [head, head + c.heads) of one GQA group
    head = head * c.heads
  cta_row0 = cta_first_row(q_ref.shape[1], c.block_q, causal=c.causal)
  if c.window is not None:  # the band's blocks [first, end)
    band_first, band_end = _window_range(c, g, cta_row0, COMPUTE_WARPGROUPS * c.block_q)
    cta_blocks = band_end - band_first
  elif not c.listed:  # what the memory warpgroup loads (listed: the list's count, read in shared memory)
    _, cta_blocks = _kv_range(c, g, cta_row0, COMPUTE_WARPGROUPS * c.block_q)

  def body(s: Scratch, ks: KeysScratch | None, ss: SegScratch | None, ls: ListScratch | None):
    if v_ref.shape[-1] != head_dim:  # the RefUnion of q's buffer and o's
      q_bufs, o_bufs = s.qo
      s = s._replace(qo=q_bufs, o=o_bufs)
    wg = lax.axis_index("wg")
    kv_head = lax.div(head, jnp.int32(c.group))
    turns = functools.partial(take_turn, s), functools.partial(turn, c, s)

    if c.tc_sum:
      pl.when(wg == 0)(lambda: plgpu.copy_gmem_to_smem(g.ones, s.ones, s.ones_ready.at[0]))
    if c.listed:  # one list per CTA: the memory warpgroup loads it, every warpgroup reads it
      pl.when(wg == COMPUTE_WARPGROUPS)(lambda: plgpu.copy_gmem_to_smem(
          g.visit.at[batch, head, lax.axis_index("q_tiles")], ls.visit, ls.visit_ready.at[0]))
      plgpu.barrier_wait(ls.visit_ready.at[0])
      _, blocks = _listed_range(c, ls)
      block_of = functools.partial(_list_entry, c, ls)
    first = 0
    if c.doc_ranges:  # the loops count steps from the CTA's first block (its documents' first key)
      tile = lax.div(cta_row0, jnp.int32(COMPUTE_WARPGROUPS * c.block_q))
      first = read_range_entry(g.first.at[batch, tile], ss.first, ss.first_ready)
      blocks, block_of = cta_blocks - first, lambda i: first + i
    elif c.window is not None:
      first, blocks, block_of = band_first, cta_blocks, lambda i: band_first + i
    elif not c.listed:
      blocks, block_of = cta_blocks, lambda i: i

    @pl.when(wg < COMPUTE_WARPGROUPS)
    def _compute():
      plgpu.set_max_registers(232, action="increase")
      walk = functools.partial(_compute_warpgroup, c, g, s, ks, ss, ls, wg=wg, batch=batch, kv_head=kv_head,
                               cta_row0=cta_row0, cta_blocks=blocks, turns=turns, block_of=block_of,
                               first_block=first)
      if c.heads == 1:
        walk(head=head)
      else:  # head h0 + j's steps follow head h0 + j − 1's in the memory warpgroup's stream
        _load_q(c, g, s, buf=wg, batch=batch, head=head, row0=cta_row0 + wg * c.block_q)
        int32_loop(0, c.heads, lambda j, _: walk(head=head + j, nth=j), None)

    @pl.when(wg == COMPUTE_WARPGROUPS)
    def _memory():
      plgpu.set_max_registers(40, action="decrease")
      num_blocks, block_in_stream = blocks, block_of
      if c.heads > 1:  # each head streams the same blocks
        per_head = jnp.maximum(blocks, 1)
        num_blocks, block_in_stream = c.heads * blocks, lambda i: block_of(lax.rem(i, per_head))
      stream_kv(k_ref, v_ref, kseg_ref, s.k, s.v, None if ss is None else ss.kseg, s.k_ready, s.v_ready,
                None if ss is None else ss.kseg_ready, batch=batch, kv_head=kv_head, block_kv=c.block_kv,
                num_blocks=num_blocks, slots=c.slots, block_of=block_in_stream,
                free=named_free(c.barriers) if c.named else (s.k_free, s.v_free),
                one_warp=c.one_memory_warp and not c.listed)  # list entries are smem loads, refused in warp code

  pl.run_scoped(body, *_scratch(c, dtype, head_dim, v_ref.shape[-1]), collective_axes="wg")


def _window_range(c: Config, g: Refs, row0, rows):
  """(first, end): the KV blocks holding keys that rows [row0, row0 + rows) see under the local window."""
  return masks.window_kv_blocks(lax.div(row0, jnp.int32(rows)), window=c.window, block_q=rows, block_k=c.block_kv,
                                num_kv_blocks=g.k.shape[1] // c.block_kv, div=masks.idiv)


def _kv_range(c: Config, g: Refs, row0, rows):
  return kv_blocks(row0, rows, causal=c.causal, block_kv=c.block_kv, num_kv_blocks=g.k.shape[1] // c.block_kv,
                   kv_len=c.kv_len)


def list_shape(width: int) -> tuple[int, int]:
  columns = min(width, LIST_COLUMNS)
  return width // columns, columns


def _list_entry(c: Config, ls: ListScratch, i):
  """Entry i of the CTA's kept-tile list (a scalar load from shared memory)."""
  columns = list_shape(c.list_width)[1]
  return ls.visit[lax.div(i, jnp.int32(columns)), lax.rem(i, jnp.int32(columns))]


def _listed_range(c: Config, ls: ListScratch):
  """(unmasked, total) steps over the CTA's kept-tile list: the last step is masked when it visits the
  last KV block and the keys end inside it (kv_len); the list is in increasing block order."""
  count = _list_entry(c, ls, jnp.int32(c.list_width - 1))
  if c.kv_len is None:
    return count, count
  last_block = (c.kv_len - 1) // c.block_kv
  ends_partial = (_list_entry(c, ls, jnp.maximum(count - 1, 0)) == last_block).astype(jnp.int32)
  return count - ends_partial, count



def _one_warpgroup_at_a_time(s: Scratch, r: Rows, decide):
  """Runs decide() in warpgroup 0, then in warpgroup 1 (one schedule-barrier phase each).
  Its warpgroup-wide min goes through shared scratch that the two compute warpgroups share:
  run together, each could read the other's result (H200: both tiles of a CTA took the
  same decision)."""
  pl.when(r.wg == 1)(r.take_turn)
  result = decide()
  pl.when(r.wg == 0)(r.take_turn)
  return result


def _load_q(c: Config, g: Refs, s: Scratch, *, buf, batch, head, row0):
  """TMA of the q tile of `head` at rows [row0, row0 + block_q) into q buffer `buf` (its compute warpgroup's, or
  with heads_per_cta `_q_buffer`'s)."""
  plgpu.copy_gmem_to_smem(g.q.at[batch, pl.ds(row0, c.block_q), head], s.qo.at[buf], s.q_ready.at[buf])


def _q_buffer(nth, wg):
  """The q buffer of a compute warpgroup's nth head when the CTA walks several (two per warpgroup, by parity)."""
  return lax.rem(nth, jnp.int32(2)) * COMPUTE_WARPGROUPS + wg


def _compute_warpgroup(c: Config, g: Refs, s: Scratch, ks, ss, ls, *, wg, batch, head, kv_head, cta_row0,
                       cta_blocks, turns, block_of, first_block=0, nth=None):
  """Prologue (loads, then the certificate or the XLA one's M), the KV loop it allows, the epilogue.
  nth: with heads_per_cta, which of the CTA's heads this is (its q tile was loaded by the one before, which loads the
  next's now)."""
  row0 = cta_row0 + wg * c.block_q
  q_buf, base = wg, 0
  if nth is not None:
    q_buf, base = _q_buffer(nth, wg), nth * cta_blocks
    pl.when(nth + 1 < c.heads)(lambda: _load_q(c, g, s, buf=_q_buffer(nth + 1, wg), batch=batch, head=head + 1,
                                                row0=row0))
  q_smem, rows = s.qo.at[q_buf], s.rows.at[wg]
  lead = 0  # steps [0, lead) take the window's mask (its band's first blocks)
  if c.window is not None:  # both warpgroups walk the CTA's band (no drain), the mask at its edges only
    whole = masks.window_full_blocks(row0, rows=c.block_q, window=c.window, block=c.block_kv, kv_len=c.kv_len,
                                     div=masks.idiv)
    lead, full = masks.masked_edges(0, cta_blocks, (whole[0] - first_block, whole[1] - first_block))
    total = cta_blocks
  elif c.listed:
    full, total = _listed_range(c, ls)
  else:
    full, total = _kv_range(c, g, row0, c.block_q)
  if c.doc_ranges:  # steps count from the CTA's first block (launch clamps it to at most full)
    full, total = full - first_block, total - first_block
  if nth is None:  # with heads_per_cta the head before loaded it
    _load_q(c, g, s, buf=wg, batch=batch, head=head, row0=row0)
  if c.mode == "cert":
    plgpu.copy_gmem_to_smem(g.m.at[batch, head, pl.ds(row0, c.block_q)], rows, s.m_ready.at[wg])
  if c.mode == "keys":
    if not c.row_centres:  # one centre per (batch, kv head); rows with their own load them in _bound_rows
      plgpu.copy_gmem_to_smem(g.centre.at[batch, 0, kv_head], ks.centre.at[wg], ks.centre_ready.at[wg])
    plgpu.copy_gmem_to_smem(g.bounds.at[batch, kv_head, :, pl.ds(row0, c.block_q)], ks.bounds.at[wg],
                            ks.bounds_ready.at[wg])
    if _own_key(c):  # each row's own key: the lower bound L = t_ii
      plgpu.copy_gmem_to_smem(g.k.at[batch, pl.ds(row0, c.block_q), kv_head], ks.kdiag.at[wg], ks.kdiag_ready.at[wg])
  if c.has_segments:
    plgpu.copy_gmem_to_smem(g.qseg.at[batch, pl.ds(row0, c.block_q)], ss.qseg.at[wg], ss.qseg_ready.at[wg])
  sink = None
  if c.sinks:  # waited for in the epilogue; each head of the CTA has its own buffer, used once
    buf = wg if nth is None else nth * COMPUTE_WARPGROUPS + wg
    sink = s.sinks.at[buf], s.sinks_ready.at[buf]
    plgpu.copy_gmem_to_smem(g.sinks.at[head], *sink)
  plgpu.barrier_wait(s.q_ready.at[q_buf])
  q_ids = None
  if c.has_segments:
    plgpu.barrier_wait(ss.qseg_ready.at[wg])
    q_ids = plgpu.load(ss.qseg.at[wg], layout=plgpu.Layout.WGMMA.reduce(1))
  if nth is not None:  # loop steps count in the memory warpgroup's stream, which holds every head's blocks
    lead, full, total, cta_blocks = lead + base, full + base, total + base, cta_blocks + base
    block_of = lambda i, block_of=block_of: block_of(i - base)
  r = Rows(wg, batch, head, kv_head, row0, full, total, cta_blocks, q_smem, rows, q_ids, g.q.dtype, *turns,
            block_of, ls, g.rowmax, lead, q_smem if s.o is None else s.o.at[wg, pl.ds(0, c.block_q)], base, sink)

  if c.mode in ("cert", "keys"):
    if c.mode == "cert":
      m_fixed, certified = _one_warpgroup_at_a_time(s, r, lambda: _read_certificate(s, r))
    else:
      m_fixed, certified = _certify_here(c, g, s, ks, r)
    pl.when(certified)(lambda: attend(c, g, s, ss, r, True, m_fixed))
    pl.when(jnp.logical_not(certified))(lambda: attend(c, g, s, ss, r, False))
  else:
    attend(c, g, s, ss, r, False)


def _read_certificate(s: Scratch, r: Rows):
  """M per row, and whether the XLA certificate passed the tile (no row at FAILED_TILE_M)."""
  plgpu.barrier_wait(s.m_ready.at[r.wg])
  m_rows = plgpu.load(r.rows, layout=plgpu.Layout.WGMMA.reduce(1))
  return m_rows, jnp.min((m_rows < FAILED_TILE_M / 2).astype(jnp.int32)) > 0


def _certify_here(c: Config, g: Refs, s: Scratch, ks: KeysScratch, r: Rows):
  """(M, certified): the rows' bounds in both warpgroups at once, then the two decisions in turn
  (only the min shares scratch); rows' own centres share one buffer, so in turn too."""
  if c.row_centres:
    def bound_and_decide():
      m, row_ok = _bound_rows(c, g, ks, r)
      return m, _decide(c, g, ks, r, row_ok)
    return _one_warpgroup_at_a_time(s, r, bound_and_decide)
  m, row_ok = _bound_rows(c, g, ks, r)
  return m, _one_warpgroup_at_a_time(s, r, lambda: _decide(c, g, ks, r, row_ok))


def _bound_rows(c: Config, g: Refs, ks: KeysScratch, r: Rows):
  """(M, passes) per row of this warpgroup from the K/V pre-pass (stabilizer.row_bounds and
  stabilize, as the Triton kernel's prologue). Radius, headroom, threshold and the centre's
  rounding slack arrive per row through TMA, as M does in "cert" mode. Packed rows each have
  their segment's centre when bidirectional (row_centres), rounded to q's dtype: one [block_q, D]
  buffer serves both warpgroups, so those warpgroups run this one after the other."""
  wg = r.wg
  plgpu.barrier_wait(ks.bounds_ready.at[wg])
  q = plgpu.load(r.q_smem, layout=plgpu.Layout.WGMMA).astype(jnp.float32)
  if c.row_centres:
    plgpu.copy_gmem_to_smem(g.centre.at[r.batch, pl.ds(r.row0, c.block_q), r.kv_head], ks.centre,
                            ks.centre_ready.at[wg])
    plgpu.barrier_wait(ks.centre_ready.at[wg])
    centre = plgpu.load(ks.centre, layout=plgpu.Layout.WGMMA).astype(jnp.float32)
  else:
    plgpu.barrier_wait(ks.centre_ready.at[wg])
    centre = lax.broadcast_in_dim(plgpu.load(ks.centre.at[wg], layout=plgpu.Layout.WGMMA.reduce(0)), q.shape, [1])
  radius, headroom, threshold, slack = (
      plgpu.load(ks.bounds.at[wg, j], layout=plgpu.Layout.WGMMA.reduce(1)) for j in range(4))
  k_diag = None
  if _own_key(c):
    plgpu.barrier_wait(ks.kdiag_ready.at[wg])
    k_diag = plgpu.load(ks.kdiag.at[wg], layout=plgpu.Layout.WGMMA).astype(jnp.float32)
  upper, lower = row_bounds(q, centre, radius, k_diag, sigma2=c.sigma2)  # radius includes the slack
  if k_diag is None:  # L = σ₂·q·c with the rounded centre c' can exceed σ₂·q·c by σ₂·‖q‖·‖c − c'‖
    lower = lower - c.sigma2 * jnp.sqrt(jnp.sum(q * q, axis=1)) * slack
  if c.cap2 is not None:  # monotone: the capped bounds bound the capped logits (the loop's own tanh)
    margin = c.cap2 * TANH_ERROR[c.tanh]  # the loop's tanh may differ from the exact one by this much either way
    upper, lower = (c.cap2 * cap_tanh(x * (1.0 / c.cap2), c.tanh) for x in (upper, lower))
    upper, lower = upper + margin, lower - margin
  m, row_ok = stabilize(upper, lower, headroom, threshold)  # rows the API padded are zero: they pass
  row_ok = row_ok.astype(jnp.int32)
  if c.has_segments:  # packed padding rows (id 0) see no key: they pass, as in stabilize()
    row_ok = jnp.maximum(row_ok, (r.q_ids == 0).astype(jnp.int32))
  return m, row_ok


def _own_key(c: Config) -> bool:
  """Whether every row sees its own key (causal or local), so that L = t_ii."""
  return c.causal or c.window is not None


def _decide(c: Config, g: Refs, ks: KeysScratch, r: Rows, row_ok):
  """The tile passes when every row does (a warpgroup-wide min); the flag goes out per row."""
  certified = jnp.min(row_ok)
  ks.flag.at[r.wg][...] = plgpu.layout_cast(jnp.full((c.block_q,), certified.astype(jnp.float32)),
                                            plgpu.Layout.WGMMA.reduce(1))
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(ks.flag.at[r.wg], g.flags.at[r.batch, r.head, pl.ds(r.row0, c.block_q)])
  return certified > 0

