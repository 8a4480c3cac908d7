"""CLiS attention forward as a Pallas Mosaic GPU kernel (Hopper: wgmma, TMA, warp specialisation).

One CTA per (q head, q tile, batch) runs three warpgroups: two compute warpgroups, each owning
block_q query rows, and one memory warpgroup that streams K and V blocks into `slots` shared-
memory buffers with TMA (with BlockSizes.heads_per_cta > 1 a CTA walks that many heads of one GQA group in turn,
its stream holding each head's blocks). The two compute warpgroups take turns on the tensor cores (a shared
"schedule" barrier): while one runs its Q·Kᵀ or P·V wgmma, the other does its softmax.

Each compute warpgroup certifies its block_q rows in its prologue from the q tile it has loaded
and the K/V pre-pass (stabilizer.key_bounds → row_bounds → stabilize; no pass over q outside the
kernel; bidirectional packed rows against their segment's centre), or reads the XLA certificate
(granularity="head"), and runs one of two loops over the KV blocks:
  certified: p = 2^(σ₂·q·kᵀ − M) with the row's fixed M; no row max, no rescale of acc and l.
             l sums the weights as rounded for P·V (stabilizer.py, "Normalisation", as every backend),
             after the softmax has handed the tensor cores to the other warpgroup (BlockSizes.exact_sum).
  otherwise: the online softmax (running max, rescale), also the whole of stabilizer="online".
Under the causal mask the loop splits into blocks wholly below the diagonal (no mask) and the
few that straddle it; causal q tiles run last-first so the longest start early. A local window streams only the
band's blocks and masks its edge blocks (masks.window_full_blocks); a soft cap caps Q·Kᵀ before the mask (`cap_tanh`);
learned sinks join the rows' sums in the epilogue (`_add_sink`).
Layout: q [B, S, Hq, D], k [B, S, Hkv, D], v [B, S, Hkv, Dv] (the API's; Dv = D, or MLA's 192/128 natively:
SPLIT_HEAD_DIMS); lse [B, Hq, S] f32 base 2, as both backwards expect (pallas_mgpu_vjp, the default, and
pallas_gpu_vjp's Triton one).

The kernel in named parts: `_Config` (static), `_Refs`, `_Scratch` / `_KeysScratch` / `_SegScratch`
(shared memory and barriers), `_Rows` (one compute warpgroup's runtime values); `_kernel` →
`_compute_warpgroup` (prologue) → `_certify_here` (`_bound_rows`, `_decide`) or `_read_certificate`
→ `_attend` (`_step` / `_overlapped_step` per KV block, `_drain`) → `_epilogue`; the memory
warpgroup runs mgpu_pipeline.stream_kv. `forward_listed` (temporal skipping, kernels/clis_kernels/diffusion) runs the same
kernel over a kept-tile list per CTA (`_ListScratch`, `_listed_range`, `_list_entry`) and can write each
visited block's row maxima (`_record_row_max`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from clis_kernels import masks
from clis_kernels.mgpu_pipeline import (COMPUTE_WARPGROUPS, RANGE_WIDTH, compiler_params, cta_first_row, finish_stores,
                                        kv_blocks, range_scratch, read_range_entry, stream_kv, swizzled)
from clis_kernels.common import int32_loop, out_struct
from clis_kernels.plan import Mode, stabilizer_inputs
from clis_kernels.stabilizer import CAP_TANH_ERROR, EMPTY_LSE, LOG2E, Certificate, KeyBounds, row_bounds, stabilize

HEAD_DIMS = (64, 128, 256)
# Head dims whose CTA fits the in-kernel certificate's scratch (Mode.KEYS): at 256 the Q, K and V slots alone take
# 192 KiB of shared memory at block_kv 64, so the plan (plan.mode_of reads this) certifies there with an XLA pre-pass.
KEYS_MAX_HEAD_DIM = 128
WIDE_HEAD_BLOCK_KV = 64  # block_kv above head dim 128: two 128-key slots of K and V overflow shared memory
# (q·k, v) head dims the kernels take without padding v up to q·k's: MLA's (DeepSeek V3, Kimi). The output goes out
# through q's bytes (a RefUnion), so 128-key blocks fit: Q 48 KiB, K 96 KiB, V 64 KiB.
SPLIT_HEAD_DIMS = ((192, 128),)
DTYPES = (jnp.bfloat16, jnp.float16)
FAILED_TILE_M = 1e30  # M sent for rows of a tile the XLA certificate failed (real M are far smaller)
ONLINE_FLOOR = -1e20  # the online loop's starting max (base 2): below any real logit
LIST_COLUMNS = 128  # a kept-tile list lies in rows of this many entries (one TMA box holds <= 256 per dimension)
TANHS = ("approx", "exp2")  # BlockSizes.soft_cap_tanh
TANH_ERROR = {"approx": CAP_TANH_ERROR, "exp2": 2.0**-20}  # above twice each one's largest absolute error in tanh
SUM_COLUMNS = 16  # columns of the ones tile the tensor-core sum multiplies by (32-byte rows: wgmma's least swizzle)


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tiles of the Mosaic GPU forward.

  block_q: rows per compute warpgroup (a CTA holds 2·block_q rows); also the certificate tile.
  block_kv: keys per pipeline step; slots: K/V blocks in flight (shared-memory buffers).
  pingpong: the two compute warpgroups take turns on the tensor cores (FA3's schedule); False lets
  both issue wgmma as soon as their operands are ready.
  overlap: the certified loop issues block i+1's Q·Kᵀ before block i's softmax (needs pingpong=False).
  exact_sum: the certified loop's l sums the weights as rounded for P·V (stabilizer.py, "Normalisation"),
  added after the softmax hands the tensor cores over. False sums them unrounded, as the online path does:
  a little faster, and less accurate than the online path on real activations (both measured in BENCHMARKS.md,
  "the certified loop's normaliser").
  exact_lse: a certified row's saved lse sums its unrounded weights (a second row sum, before the softmax hands the
  tensor cores over), so the backward's P sums to one; False takes lse from l (the rounded weights' sum, whose
  rounding enters lse where M sits below the row max: notes/certificate.md). With exact_sum=False l is already
  the unrounded sum and nothing more is summed.
  sum_on_tensor_cores: that sum as a second wgmma, P·ones against a [block_kv, 16] tile of ones in shared
  memory, issued with P·V (no conversion on the vector units).
  document_ranges: causal packed calls start each CTA's KV loop at the first block that holds a key of its
  rows' documents (masks.segment_block_ranges), as tokamax's per-row k_start does; the blocks before it are
  wholly masked and were visited for nothing (8k rows of packed ~500-token documents: 70-80% of the causal
  blocks). On by default: bit-identical to the full causal loops (GPU tests), forward+backward 5.3x faster
  at 8k rows of 300-token documents (Gaussian inputs) (benchmarks/log.md, 2026-12-01, "document ranges on the GPU"); False visits every causal block.
  soft_cap_tanh: how logits_soft_cap's tanh is computed (`cap_tanh`): "approx" (tanh.approx.f32, one instruction)
  or "exp2" (from ex2 and rsqrt, float32-accurate); the backward's BlockSizes has the same field, and both should
  agree.
  heads_per_cta: query heads of one GQA group a CTA walks one after another (the online loop only): the memory
  warpgroup streams the same K/V blocks for each, and each head's q tile is loaded while the one before runs. For
  calls with few KV blocks per CTA, where a CTA's fixed costs (launch, first loads, the epilogue's store) are not
  hidden behind its loop. None (default): `auto_heads_per_cta`. Above head dim 128 each head's q tile loads after the
  head before has stored its o (Q_PREFETCH_MAX_HEAD_DIM); the K/V stream still runs on across heads.
  one_memory_warp: only the memory warpgroup's first warp streams the K/V blocks (mgpu_pipeline.stream_blocks), as
  tokamax's forward does; the other three then issue nothing on the schedulers they share with the compute warps. H200,
  2026-12-04, causal GQA 32/8 D 128, online: forward 1.018 / 1.017x four streaming warps at 8k / 32k (ncu at 8k: 281.5M
  instructions issued with four, tokamax's 263.4M with equal step loops); the certified loop within ±1%; the same
  in the backward's kernels measured ~1% slower, so they keep four (BENCHMARKS.md §1). `forward_listed` keeps four:
  its steps read the kept-tile list from shared memory, a load Mosaic GPU refuses inside per-warp code.
  The backward is the registry's choice (plan.py): "pallas_mgpu" takes pallas_mgpu_vjp's,
  "pallas_mgpu_triton_bwd" pallas_gpu_vjp's, each with its own BlockSizes.
  """

  block_q: int = 64
  block_kv: int = 128
  slots: int = 2
  pingpong: bool = True
  overlap: bool = False
  exact_sum: bool = True
  exact_lse: bool = True
  sum_on_tensor_cores: bool = False
  document_ranges: bool = True
  soft_cap_tanh: str = "approx"
  heads_per_cta: int | None = None
  one_memory_warp: bool = True

  def __post_init__(self):
    if self.heads_per_cta is not None and self.heads_per_cta < 1:
      raise ValueError(f"{self.heads_per_cta=} must be at least 1")
    if self.soft_cap_tanh not in TANHS:
      raise ValueError(f"{self.soft_cap_tanh=} must be one of {TANHS} (cap_tanh says what each costs)")
    if self.sum_on_tensor_cores and (not self.exact_sum or self.overlap):
      raise ValueError("sum_on_tensor_cores=True sums the rounded weights (exact_sum=True) in the ping-pong step "
                       "(overlap=False)")
    if self.overlap and self.pingpong:
      raise ValueError("overlap=True needs pingpong=False (each warpgroup overlaps its own steps instead)")
    if self.block_q != 64:
      raise ValueError(f"{self.block_q=} must be 64 (one wgmma M tile per compute warpgroup)")
    if self.block_kv not in (64, 128):
      raise ValueError(f"{self.block_kv=} must be 64 or 128 (larger K/V blocks overflow shared memory at D=128)")
    if self.slots < 2:
      raise ValueError(f"{self.slots=} must be at least 2 (one block computing while the next loads)")

  @property
  def tile(self) -> int:
    return self.block_q

  @property
  def multiple(self) -> int:
    return max(COMPUTE_WARPGROUPS * self.block_q, self.block_kv)

  @property
  def skip_tiles(self) -> tuple[int, int]:
    """(rows, keys) of a temporal-skipping tile: a CTA's rows (both compute warpgroups walk one kept-tile
    list) and a KV block."""
    return COMPUTE_WARPGROUPS * self.block_q, self.block_kv


def default_block_sizes(head_dim: int, seq_len: int, dtype) -> BlockSizes:
  """block_kv 128, 2 slots, ping-pong on were the fastest for both loops at head dims 64 and 128 in the H200
  sweeps (notes/kernels.md; figures in BENCHMARKS.md); MLA's q·k 192 (SPLIT_HEAD_DIMS: the plan passes the padded
  q·k head dim) keeps them; head dims padded to 256 take 64-key blocks (WIDE_HEAD_BLOCK_KV)."""
  del seq_len, dtype
  split = head_dim in (d for d, _ in SPLIT_HEAD_DIMS)
  return BlockSizes(block_kv=WIDE_HEAD_BLOCK_KV) if padded_head_dim(head_dim) > 128 and not split else BlockSizes()


def padded_head_dim(head_dim: int) -> int:
  """The head dim the kernels run at: the API pads q, k, v with zero columns up to it (zeros change no
  logit, and the output's extra columns are cut off), as FlashAttention does for 80 or 96."""
  return next((d for d in HEAD_DIMS if d >= head_dim), head_dim)


def split_head_dims(head_dim: int, value_head_dim: int) -> tuple[int, int] | None:
  """The SPLIT_HEAD_DIMS pair that q·k head dim `head_dim` and v head dim `value_head_dim` pad to (only q·k
  wider than v: MLA), or None: then both pad to one width."""
  return next(((d, dv) for d, dv in SPLIT_HEAD_DIMS
               if dv < head_dim <= d and value_head_dim <= dv), None)


def supports(dtype, head_dim: int) -> bool:
  """Whether these kernels take inputs of this dtype and (unpadded) head dim (the API's default asks)."""
  return dtype in DTYPES and padded_head_dim(head_dim) in HEAD_DIMS


def _check(q, k, v, keys, cert, scale, interpret, block_kv):
  if interpret:
    raise ValueError("implementation='pallas_mgpu' has no interpret mode; use implementation='pallas_gpu' "
                     "with interpret=True to run the GPU kernels on a CPU")
  if q.dtype not in DTYPES:
    raise ValueError(f"implementation='pallas_mgpu' needs bfloat16 or float16 inputs; got {q.dtype=} "
                     "(use implementation='pallas_gpu' for float32)")
  dims = (q.shape[-1], v.shape[-1])
  if not (dims[0] == dims[1] and dims[0] in HEAD_DIMS) and dims not in SPLIT_HEAD_DIMS:
    raise ValueError(f"head_dim={q.shape[-1]} must be at most {HEAD_DIMS[-1]} for implementation='pallas_mgpu' "
                     f"(smaller ones are padded to one of {HEAD_DIMS}), with v's head dim {v.shape[-1]} equal to it or "
                     f"a (q·k, v) pair of {SPLIT_HEAD_DIMS}; use implementation='pallas_gpu'")
  if q.shape[-1] > 128 and dims not in SPLIT_HEAD_DIMS and block_kv > WIDE_HEAD_BLOCK_KV:
    raise ValueError(f"{block_kv=} must be at most {WIDE_HEAD_BLOCK_KV} at head_dim={q.shape[-1]} for "
                     "implementation='pallas_mgpu' (K and V slots overflow shared memory)")
  if keys is not None and q.shape[-1] > KEYS_MAX_HEAD_DIM:
    raise ValueError(f"head_dim={q.shape[-1]} takes no in-kernel certificate (Mode.KEYS, up to "
                     f"{KEYS_MAX_HEAD_DIM}) in implementation='pallas_mgpu': certify with a pre-pass (bound='blocks')")
  if not scale > 0:
    raise ValueError(f"{scale=} must be positive for implementation='pallas_mgpu'")
  if cert is not None and cert.certified.shape[-1] * 64 != q.shape[1]:
    raise ValueError(f"the certificate's tile must be block_q=64 rows; got {cert.certified.shape=} for {q.shape=}")


@dataclasses.dataclass(frozen=True)
class _Config:
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
  q_prefetch: bool = False  # heads > 1: the next head's q tile loads during this head's loop (`_q_parities`)
  sinks: bool = False  # learned sink logits: the epilogue adds each head's term to the rows' sums (`_add_sink`)
  one_memory_warp: bool = True  # BlockSizes.one_memory_warp

  @property
  def logit_scale(self) -> float:
    """What turns the loop's Q·Kᵀ (`_capped`) into base-2 logits: σ₂, or cap2 (one multiply fewer per logit)."""
    return self.sigma2 if self.cap2 is None else self.cap2


class _Refs(NamedTuple):
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


class _Scratch(NamedTuple):
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


class _KeysScratch(NamedTuple):
  """Mode "keys": what the prologue certificate reads."""

  centre: Any
  kdiag: Any  # each row's own key (causal: L = t_ii)
  flag: Any
  bounds: Any
  kdiag_ready: Any
  bounds_ready: Any
  centre_ready: Any


class _SegScratch(NamedTuple):
  """Packed segments: the rows' ids and one block of key ids per slot; with doc_ranges, the CTA's first block."""

  qseg: Any
  kseg: Any
  qseg_ready: Any
  kseg_ready: Any
  first: Any = None
  first_ready: Any = None


class _ListScratch(NamedTuple):
  """Kept-tile lists: the CTA's list, and two row-maximum buffers per compute warpgroup (track)."""

  visit: Any
  visit_ready: Any
  rowmax: Any


class _Rows(NamedTuple):
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
  take_turn: Callable  # _take_turn and _turn bound once per CTA: pl.when traces each function once
  turn: Callable
  block_of: Callable  # loop step -> the KV block it visits (the step itself, or the kept-tile list's entry)
  lists: Any = None  # _ListScratch when listed
  rowmax: Any = None  # track: the row-maximum output (_Refs.rowmax)
  lead: Any = 0  # window: steps [0, lead) are masked too (the band's lower edge); [lead, full) are whole
  o_smem: Any = None  # where the epilogue stages o: q_smem, or _Scratch.o's buffer
  base: Any = 0  # heads_per_cta: the stream's step of this head's first block (loop steps count from it)
  sink: Any = None  # sinks: (this head's sink row in shared memory, its barrier)


def _scratch(c: _Config, dtype, head_dim: int, value_head_dim: int):
  """The run_scoped allocations, grouped as _Scratch, _KeysScratch, _SegScratch, _ListScratch (each but the
  first None where the call has none)."""
  wgs, bq, bkv = COMPUTE_WARPGROUPS, c.block_q, c.block_kv
  qbufs = wgs * _q_parities(c)
  qo = plgpu.SMEM((qbufs, bq, head_dim), dtype, transforms=swizzled())
  if value_head_dim != head_dim:  # o [bq, Dv] of warpgroup w lies in q's bytes of w: it is written once q is read
    qo = plgpu.RefUnion(qo, plgpu.SMEM((wgs, bq * head_dim // value_head_dim, value_head_dim), dtype,
                                       transforms=swizzled()))
  common = _Scratch(
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
    keys = _KeysScratch(
        plgpu.SMEM((bq, head_dim), dtype, transforms=swizzled()) if c.row_centres
        else plgpu.SMEM((wgs, head_dim), jnp.float32),
        plgpu.SMEM((wgs, bq, head_dim), dtype, transforms=swizzled()),
        plgpu.SMEM((wgs, bq), jnp.float32),
        plgpu.SMEM((wgs, 4, bq), jnp.float32),
        plgpu.Barrier(num_barriers=wgs), plgpu.Barrier(num_barriers=wgs), plgpu.Barrier(num_barriers=wgs))
  segs = None
  if c.has_segments:
    segs = _SegScratch(plgpu.SMEM((wgs, bq), jnp.int32), plgpu.SMEM((c.slots, bkv), jnp.int32),
                       plgpu.Barrier(num_barriers=wgs), plgpu.Barrier(num_barriers=c.slots),
                       *(range_scratch() if c.doc_ranges else ()))
  lists = None
  if c.listed:
    lists = _ListScratch(plgpu.SMEM(_list_shape(c.list_width), jnp.int32), plgpu.Barrier(num_barriers=1),
                         plgpu.SMEM((wgs, 2, bq), jnp.float32))
  return common, keys, segs, lists


def _q_parities(c: _Config) -> int:
  """q tiles in flight per compute warpgroup: two when the CTA walks several heads and a second fits (the next one
  loads while this one runs), else one (each head loads its own after the head before stored o from that buffer)."""
  return 2 if c.q_prefetch else 1


def _kernel(q_ref, k_ref, v_ref, *refs, config: _Config):
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
  g = _Refs(q_ref, k_ref, v_ref, qseg_ref, kseg_ref, m_ref, centre_ref, bounds_ref, o_ref, lse_ref, flags_ref,
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

  def body(s: _Scratch, ks: _KeysScratch | None, ss: _SegScratch | None, ls: _ListScratch | None):
    if v_ref.shape[-1] != head_dim:  # the RefUnion of q's buffer and o's
      q_bufs, o_bufs = s.qo
      s = s._replace(qo=q_bufs, o=o_bufs)
    wg = lax.axis_index("wg")
    kv_head = lax.div(head, jnp.int32(c.group))
    turns = functools.partial(_take_turn, s), functools.partial(_turn, c, s)

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
        if c.q_prefetch:
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
                num_blocks=num_blocks, slots=c.slots, free=(s.k_free, s.v_free), block_of=block_in_stream,
                one_warp=c.one_memory_warp and not c.listed)  # list entries are smem loads, refused in warp code

  pl.run_scoped(body, *_scratch(c, dtype, head_dim, v_ref.shape[-1]), collective_axes="wg")


def _window_range(c: _Config, g: _Refs, row0, rows):
  """(first, end): the KV blocks holding keys that rows [row0, row0 + rows) see under the local window."""
  return masks.window_kv_blocks(lax.div(row0, jnp.int32(rows)), window=c.window, block_q=rows, block_k=c.block_kv,
                                num_kv_blocks=g.k.shape[1] // c.block_kv, div=masks.idiv)


def _kv_range(c: _Config, g: _Refs, row0, rows):
  return kv_blocks(row0, rows, causal=c.causal, block_kv=c.block_kv, num_kv_blocks=g.k.shape[1] // c.block_kv,
                   kv_len=c.kv_len)


def _list_shape(width: int) -> tuple[int, int]:
  columns = min(width, LIST_COLUMNS)
  return width // columns, columns


def _list_entry(c: _Config, ls: _ListScratch, i):
  """Entry i of the CTA's kept-tile list (a scalar load from shared memory)."""
  columns = _list_shape(c.list_width)[1]
  return ls.visit[lax.div(i, jnp.int32(columns)), lax.rem(i, jnp.int32(columns))]


def _listed_range(c: _Config, ls: _ListScratch):
  """(unmasked, total) steps over the CTA's kept-tile list: the last step is masked when it visits the
  last KV block and the keys end inside it (kv_len); the list is in increasing block order."""
  count = _list_entry(c, ls, jnp.int32(c.list_width - 1))
  if c.kv_len is None:
    return count, count
  last_block = (c.kv_len - 1) // c.block_kv
  ends_partial = (_list_entry(c, ls, jnp.maximum(count - 1, 0)) == last_block).astype(jnp.int32)
  return count - ends_partial, count


def _take_turn(s: _Scratch):
  """Hands the tensor cores to the other compute warpgroup and waits for them back."""
  plgpu.barrier_arrive(s.schedule)
  plgpu.barrier_wait(s.schedule)


def _turn(c: _Config, s: _Scratch):
  """_take_turn inside the KV loop, when the warpgroups ping-pong."""
  if c.pingpong:
    _take_turn(s)


def _one_warpgroup_at_a_time(s: _Scratch, r: _Rows, decide):
  """Runs decide() in warpgroup 0, then in warpgroup 1 (one schedule-barrier phase each).
  Its warpgroup-wide min goes through shared scratch that the two compute warpgroups share:
  run together, each could read the other's result (H200: both tiles of a CTA took the
  same decision)."""
  pl.when(r.wg == 1)(r.take_turn)
  result = decide()
  pl.when(r.wg == 0)(r.take_turn)
  return result


def _load_q(c: _Config, g: _Refs, s: _Scratch, *, buf, batch, head, row0):
  """TMA of the q tile of `head` at rows [row0, row0 + block_q) into q buffer `buf` (its compute warpgroup's, or
  with heads_per_cta `_q_buffer`'s)."""
  plgpu.copy_gmem_to_smem(g.q.at[batch, pl.ds(row0, c.block_q), head], s.qo.at[buf], s.q_ready.at[buf])


def _q_buffer(nth, wg):
  """The q buffer of a compute warpgroup's nth head when the CTA walks several (two per warpgroup, by parity)."""
  return lax.rem(nth, jnp.int32(2)) * COMPUTE_WARPGROUPS + wg


def _compute_warpgroup(c: _Config, g: _Refs, s: _Scratch, ks, ss, ls, *, wg, batch, head, kv_head, cta_row0,
                       cta_blocks, turns, block_of, first_block=0, nth=None):
  """Prologue (loads, then the certificate or the XLA one's M), the KV loop it allows, the epilogue.
  nth: with heads_per_cta, which of the CTA's heads this is (with q_prefetch its q tile was loaded by the one
  before, which loads the next's now)."""
  row0 = cta_row0 + wg * c.block_q
  q_buf, base = wg, 0
  if nth is not None and c.q_prefetch:
    q_buf, base = _q_buffer(nth, wg), nth * cta_blocks
    pl.when(nth + 1 < c.heads)(lambda: _load_q(c, g, s, buf=_q_buffer(nth + 1, wg), batch=batch, head=head + 1,
                                                row0=row0))
  elif nth is not None:
    base = nth * cta_blocks
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
  if nth is None or not c.q_prefetch:  # with q_prefetch the head before loaded it
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
  r = _Rows(wg, batch, head, kv_head, row0, full, total, cta_blocks, q_smem, rows, q_ids, g.q.dtype, *turns,
            block_of, ls, g.rowmax, lead, q_smem if s.o is None else s.o.at[wg, pl.ds(0, c.block_q)], base, sink)

  if c.mode in ("cert", "keys"):
    if c.mode == "cert":
      m_fixed, certified = _one_warpgroup_at_a_time(s, r, lambda: _read_certificate(s, r))
    else:
      m_fixed, certified = _certify_here(c, g, s, ks, r)
    pl.when(certified)(lambda: _attend(c, g, s, ss, r, True, m_fixed))
    pl.when(jnp.logical_not(certified))(lambda: _attend(c, g, s, ss, r, False))
  else:
    _attend(c, g, s, ss, r, False)


def _read_certificate(s: _Scratch, r: _Rows):
  """M per row, and whether the XLA certificate passed the tile (no row at FAILED_TILE_M)."""
  plgpu.barrier_wait(s.m_ready.at[r.wg])
  m_rows = plgpu.load(r.rows, layout=plgpu.Layout.WGMMA.reduce(1))
  return m_rows, jnp.min((m_rows < FAILED_TILE_M / 2).astype(jnp.int32)) > 0


def _certify_here(c: _Config, g: _Refs, s: _Scratch, ks: _KeysScratch, r: _Rows):
  """(M, certified): the rows' bounds in both warpgroups at once, then the two decisions in turn
  (only the min shares scratch); rows' own centres share one buffer, so in turn too."""
  if c.row_centres:
    def bound_and_decide():
      m, row_ok = _bound_rows(c, g, ks, r)
      return m, _decide(c, g, ks, r, row_ok)
    return _one_warpgroup_at_a_time(s, r, bound_and_decide)
  m, row_ok = _bound_rows(c, g, ks, r)
  return m, _one_warpgroup_at_a_time(s, r, lambda: _decide(c, g, ks, r, row_ok))


def _bound_rows(c: _Config, g: _Refs, ks: _KeysScratch, r: _Rows):
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


def _own_key(c: _Config) -> bool:
  """Whether every row sees its own key (causal or local), so that L = t_ii."""
  return c.causal or c.window is not None


def _decide(c: _Config, g: _Refs, ks: _KeysScratch, r: _Rows, row_ok):
  """The tile passes when every row does (a warpgroup-wide min); the flag goes out per row."""
  certified = jnp.min(row_ok)
  ks.flag.at[r.wg][...] = plgpu.layout_cast(jnp.full((c.block_q,), certified.astype(jnp.float32)),
                                            plgpu.Layout.WGMMA.reduce(1))
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(ks.flag.at[r.wg], g.flags.at[r.batch, r.head, pl.ds(r.row0, c.block_q)])
  return certified > 0


def _attend(c: _Config, g: _Refs, s: _Scratch, ss, r: _Rows, fixed: bool, m_fixed=None):
  """The KV loop (certified with M fixed, or online), the release of blocks the other warpgroup
  still streams, and the epilogue."""
  bq, value_head_dim = c.block_q, g.v.shape[-1]
  if fixed:  # M is loop-invariant: the loop closes over it and carries (acc, l, the unrounded sum for lse or None)
    m0 = m_fixed
  else:
    # A finite floor, not −inf: a block whose keys are all masked then leaves m at the floor
    # and adds weight 2^(−inf − floor) = 0; no step forms −inf − (−inf).
    m0 = plgpu.layout_cast(jnp.full((bq,), ONLINE_FLOOR, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
  if fixed and c.tc_sum:  # l as P·ones: [bq, SUM_COLUMNS] equal columns
    l0 = plgpu.layout_cast(jnp.zeros((bq, SUM_COLUMNS), jnp.float32), plgpu.Layout.WGMMA)
    plgpu.barrier_wait(s.ones_ready.at[0])
  else:
    l0 = plgpu.layout_cast(jnp.zeros((bq,), jnp.float32), plgpu.Layout.WGMMA.reduce(1))
  lse0 = plgpu.layout_cast(jnp.zeros((bq,), jnp.float32), plgpu.Layout.WGMMA.reduce(1)) if c.lse_sum else None
  carry = (plgpu.layout_cast(jnp.zeros((bq, value_head_dim), jnp.float32), plgpu.Layout.WGMMA),
           *((l0, lse0) if fixed else (m0, l0)))
  plgpu.barrier_wait(s.k_ready.at[0 if isinstance(r.base, int) else lax.rem(r.base, jnp.int32(c.slots))])
  pl.when(r.wg == 1)(r.turn)  # warpgroup 1 starts half a step behind warpgroup 0
  masked_steps = c.causal or c.kv_len is not None or c.window is not None
  if fixed and c.overlap:
    def first_qk(acc_ref):
      plgpu.wgmma(acc_ref, r.q_smem, s.k.at[0].T)
      return acc_ref[...]

    step = functools.partial(_overlapped_step, c, s, ss, r, m0)
    carry = (*carry, pl.run_scoped(first_qk, plgpu.ACC((bq, c.block_kv), jnp.float32)))
    if c.window is not None:
      carry = int32_loop(0, r.lead, functools.partial(step, masked=True), carry)
    carry = int32_loop(r.lead, r.full, functools.partial(step, masked=False), carry)
    if masked_steps:
      carry = int32_loop(r.full, r.total, functools.partial(step, masked=True), carry)
    carry = carry[:3]
  else:
    step = functools.partial(_step, c, s, ss, r, fixed, m0)
    if c.window is not None:
      carry = int32_loop(r.base, r.lead, functools.partial(step, masked=True), carry)
    carry = int32_loop(r.lead, r.full, functools.partial(step, masked=False), carry)
    if masked_steps:
      carry = int32_loop(r.full, r.total, functools.partial(step, masked=True), carry)
  if c.causal:  # blocks the other warpgroup still needs: release them in step with its loop
    int32_loop(r.total, r.cta_blocks, functools.partial(_drain, c, s, ss), None)
  pl.when(r.wg == 0)(r.turn)
  acc, m, l, l_lse = (carry[0], m0, *carry[1:]) if fixed else (*carry, None)
  if fixed and c.tc_sum:
    l = l.sum(axis=1) * (1.0 / SUM_COLUMNS)
  _epilogue(c, g, s, r, acc, m, l, l_lse)


def _visible(c: _Config, s: _Scratch, ss, r: _Rows, qk, i, slot, masked: bool):
  """Block i's logits with −inf where a key is hidden; releases the block's K (read now)."""
  if c.has_segments:  # every step: a query sees keys of its own segment (padding keys are −1)
    plgpu.barrier_wait(ss.kseg_ready.at[slot])
    k_ids = plgpu.load(ss.kseg.at[slot], layout=plgpu.Layout.WGMMA.reduce(0))
    same = lax.broadcast_in_dim(r.q_ids, qk.shape, [0]) == lax.broadcast_in_dim(k_ids, qk.shape, [1])
    # −inf is safe: the online loop's max starts at ONLINE_FLOOR, so a block wholly of other
    # segments adds 2^(−inf − floor) = 0; rows that never see a key are padding (zeroed below).
    qk = jnp.where(same, qk, -jnp.inf)
  plgpu.barrier_arrive(s.k_free.at[slot])  # k and its segment ids are read
  if masked:
    q_pos = r.row0 + plgpu.broadcasted_iota(jnp.int32, qk.shape, 0, layout=plgpu.Layout.WGMMA)
    k_pos = r.block_of(i) * c.block_kv + plgpu.broadcasted_iota(jnp.int32, qk.shape, 1, layout=plgpu.Layout.WGMMA)
    if c.window is None:
      qk = jnp.where(q_pos >= k_pos if c.causal else k_pos < c.kv_len, qk, -jnp.inf)
    else:
      seen = masks.visible_pairs(q_pos, k_pos, None, None, causal=False, kv_len=c.kv_len, window=c.window)
      qk = jnp.where(seen, qk, -jnp.inf)  # causal: the window's right side is 0
  return qk


def cap_tanh(x, how: str):
  """tanh for the soft cap (BlockSizes.soft_cap_tanh). "approx": tanh.approx.f32 (Mosaic GPU's tanh under
  approx_math, tokamax's), one MUFU instruction, ~2^-11 relative. "exp2": 1 − 2·r² with r = rsqrt(2^(2·log2 e·x)
  + 1), two MUFU instructions (ex2, rsqrt.approx: ~2^-22 relative), saturating to ±1 with no NaN. On the H200 both
  give the same errors against float64 as the Triton kernels' tanh (notes/experiments/cap_tanh_accuracy.py), and
  "approx" runs the capped forward 1.25-1.34x faster (BENCHMARKS.md §1). The certificate widens its capped bounds
  by TANH_ERROR·cap2 either way, so an inexact tanh cannot break it."""
  if how == "approx":
    return jnp.tanh(x)
  r = lax.rsqrt(jnp.exp2(x * (2.0 * LOG2E)) + 1.0)
  return 1.0 - 2.0 * (r * r)


def _capped(c: _Config, qk):
  """Q·Kᵀ as the loop takes it: `c.logit_scale` times the result is the base-2 logit, σ₂·qk, or with a soft cap
  cap2·tanh(σ₂·qk / cap2) (stabilizer.soft_cap; the result is then the tanh, as tokamax's). Before the mask: tanh
  would turn a hidden −inf into a finite −cap."""
  if c.cap2 is None:
    return qk
  return cap_tanh(qk * (c.sigma2 / c.cap2), c.tanh)


def _step(c: _Config, s: _Scratch, ss, r: _Rows, fixed: bool, m0, i, carry, masked: bool):
  """One KV block: Q·Kᵀ, the weights (certified: one FMA and one exp2 each; online: running max and
  rescale), P·V; the warpgroups hand the tensor cores over around the softmax when they ping-pong. The named scopes
  are the regions Mosaic GPU's profiler times (mgpu_pipeline.compiler_params); they change nothing otherwise."""
  acc, m, l, l_lse = (carry[0], m0, *carry[1:]) if fixed else (*carry, None)
  slot = lax.rem(i, jnp.int32(c.slots))

  def qk_scope(acc_ref):
    plgpu.wgmma(acc_ref, r.q_smem, s.k.at[slot].T)
    with jax.named_scope("turn_after_qk"):
      _turn(c, s)
    with jax.named_scope("qk_wait"):
      return acc_ref[...]

  qk = pl.run_scoped(qk_scope, plgpu.ACC((c.block_q, c.block_kv), jnp.float32))
  with jax.named_scope("softmax"):
    acc, m, l, l_lse, p_low = _weights(c, s, ss, r, fixed, i, slot, masked, qk, acc, m, l, l_lse)
  if c.pingpong:
    plgpu.barrier_arrive(s.schedule)  # softmax done
  if fixed and c.exact_sum and not c.tc_sum:  # while the other warpgroup holds the tensor cores
    with jax.named_scope("rounded_sum"):
      l = l + p_low.astype(jnp.float32).sum(axis=1)
  with jax.named_scope("await_turn"):
    plgpu.barrier_wait(s.v_ready.at[slot])
    if c.pingpong:
      plgpu.barrier_wait(s.schedule)  # tensor cores free again

  def pv(refs):
    acc_ref, l_ref = refs
    plgpu.wgmma(acc_ref, p_low, s.v.at[slot])
    if l_ref is not None:  # the rounded weights' sum, on the tensor cores
      plgpu.wgmma(l_ref, p_low, s.ones)

    @pl.when(i + 1 < r.total)
    def _():
      plgpu.barrier_wait(s.k_ready.at[lax.rem(i + 1, jnp.int32(c.slots))])

  tc_sum = fixed and c.tc_sum
  with jax.named_scope("pv"):
    acc, l_new = pl.run_state(pv)((plgpu.ACC.init(acc), plgpu.ACC.init(l) if tc_sum else None))
  l = l_new if tc_sum else l
  plgpu.barrier_arrive(s.v_free.at[slot])
  return (acc, l, l_lse) if fixed else (acc, m, l)


def _weights(c: _Config, s: _Scratch, ss, r: _Rows, fixed: bool, i, slot, masked: bool, qk, acc, m, l, l_lse):
  """The step's softmax on block i's Q·Kᵀ [block_q, block_kv]: (acc, m, l, l_lse, the weights in q's dtype),
  certified with the fixed M (m) or online (running max m, acc and l rescaled)."""
  qk = _visible(c, s, ss, r, _capped(c, qk), i, slot, masked)
  row_max = qk.max(axis=1) * c.logit_scale if c.track or not fixed else None
  if c.track:
    _record_row_max(c, r, i, row_max)
  if fixed:  # the certified step: no max, no rescale
    p = jnp.exp2(qk * c.logit_scale - lax.broadcast_in_dim(m, qk.shape, [0]))
    p_low = p.astype(r.dtype)
    if not c.exact_sum:
      l = l + p.sum(axis=1)  # the unrounded weights: see the module docstring
    if c.lse_sum:  # lse's sum, unrounded, while p is in registers (BlockSizes.exact_lse)
      l_lse = l_lse + p.sum(axis=1)
    acc, l, l_lse, p_low = lax.optimization_barrier((acc, l, l_lse, p_low))
  else:
    m_new = jnp.maximum(m, row_max)
    alpha = jnp.exp2(m - m_new)
    p = jnp.exp2(qk * c.logit_scale - lax.broadcast_in_dim(m_new, qk.shape, [0]))
    acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
    l = l * alpha + p.sum(axis=1)
    m, p_low = m_new, p.astype(r.dtype)
    acc, m, l, p_low = lax.optimization_barrier((acc, m, l, p_low))
  return acc, m, l, l_lse, p_low


def _overlapped_step(c: _Config, s: _Scratch, ss, r: _Rows, m0, i, carry, masked: bool):
  """The certified step with block i+1's Q·Kᵀ issued before block i's exp2 (p_i depends on
  nothing of step i−1, so the tensor cores work while this warpgroup exponentiates)."""
  acc, l, l_lse, qk = carry  # qk: block i's logits, already computed
  slot, nxt = lax.rem(i, jnp.int32(c.slots)), lax.rem(i + 1, jnp.int32(c.slots))
  qk = _visible(c, s, ss, r, _capped(c, qk), i, slot, masked)
  if c.track:
    _record_row_max(c, r, i, qk.max(axis=1) * c.logit_scale)

  def scope(next_ref):
    @pl.when(i + 1 < r.total)
    def _():
      plgpu.barrier_wait(s.k_ready.at[nxt])
      plgpu.wgmma(next_ref, r.q_smem, s.k.at[nxt].T)

    p = jnp.exp2(qk * c.logit_scale - lax.broadcast_in_dim(m0, qk.shape, [0]))
    p_low = p.astype(r.dtype)
    new_l = l + (p_low.astype(jnp.float32) if c.exact_sum else p).sum(axis=1)
    new_lse = l_lse + p.sum(axis=1) if c.lse_sum else None
    plgpu.barrier_wait(s.v_ready.at[slot])
    new_acc = pl.run_state(lambda ref: plgpu.wgmma(ref, p_low, s.v.at[slot]))(plgpu.ACC.init(acc))
    return new_acc, new_l, new_lse, next_ref[...]

  carry = pl.run_scoped(scope, plgpu.ACC((c.block_q, c.block_kv), jnp.float32))
  plgpu.barrier_arrive(s.v_free.at[slot])
  return carry


def _record_row_max(c: _Config, r: _Rows, i, row_max):
  """Writes step i's row maxima [block_q] (log2 units) to rowmax[batch, head, block, rows] through one of
  two shared-memory buffers; the store issued two steps ago must have read this buffer first."""
  buf = r.lists.rowmax.at[r.wg, lax.rem(i, jnp.int32(2))]
  plgpu.wait_smem_to_gmem(1, wait_read_only=True)
  buf[...] = row_max
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(buf, r.rowmax.at[r.batch, r.head, r.block_of(i), pl.ds(r.row0, c.block_q)])


def _drain(c: _Config, s: _Scratch, ss, i, _):
  """Releases block i, which this warpgroup does not need but the other one does (causal)."""
  slot = lax.rem(i, jnp.int32(c.slots))
  if not c.pingpong:  # without the schedule's lockstep, wait for each block before releasing it
    for barrier in (s.k_ready, s.v_ready) + ((ss.kseg_ready,) if c.has_segments else ()):
      plgpu.barrier_wait(barrier.at[slot])
  plgpu.barrier_arrive(s.k_free.at[slot])
  plgpu.barrier_arrive(s.v_free.at[slot])
  _turn(c, s)
  _turn(c, s)


def _add_sink(r: _Rows, m, l, l_lse):
  """(m, l, l_lse, the factor on acc) with the head's sink logit t as one more term of the rows' softmax, of value
  0: the stabilizer becomes max(m, t) and the sums take 2^(t − max) (stabilizer.fold_sinks's arithmetic, in
  registers). Exact for any t, so neither the loop nor the certificate changes."""
  buf, ready = r.sink
  plgpu.barrier_wait(ready)
  t = plgpu.load(buf, layout=plgpu.Layout.WGMMA.reduce(1))
  m_new = jnp.maximum(m, t)
  old, sink = jnp.exp2(m - m_new), jnp.exp2(t - m_new)
  return m_new, l * old + sink, None if l_lse is None else l_lse * old + sink, old


def _epilogue(c: _Config, g: _Refs, s: _Scratch, r: _Rows, acc, m, l, l_lse=None):
  """o = acc / l and lse = M + log2 l (l_lse instead where given: the unrounded sum; padding rows: 0 and EMPTY_LSE)
  out through shared memory; with sinks, after `_add_sink`."""
  factor = 1.0
  if c.sinks:
    m, l, l_lse, factor = _add_sink(r, m, l, l_lse)
  o = acc * lax.broadcast_in_dim(factor / l, acc.shape, [0])
  lse = m + jnp.log2(l if l_lse is None else l_lse)
  if c.has_segments:  # padding rows (id 0) see no key: o = 0 and EMPTY_LSE, as every backend
    empty = r.q_ids == 0
    o = jnp.where(lax.broadcast_in_dim(empty, acc.shape, [0]), 0.0, o)
    lse = jnp.where(empty, EMPTY_LSE, lse)
  r.o_smem[...] = o.astype(r.dtype)
  r.rows[...] = lse
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(r.o_smem, g.o.at[r.batch, pl.ds(r.row0, c.block_q), r.head])
  plgpu.copy_smem_to_gmem(r.rows, g.lse.at[r.batch, r.head, pl.ds(r.row0, c.block_q)])
  finish_stores()


def _per_row(x, *, tile: int, seq: int):
  """[..., n] per tile of `tile` rows (or [..., 1] for all) -> [..., seq] per row."""
  return jnp.broadcast_to(jnp.repeat(x, tile, axis=-1) if x.shape[-1] > 1 else x, x.shape[:-1] + (seq,))


def kernel_key_inputs(keys: KeyBounds, *, row_centres: bool, dtype, seq: int, tile: int):
  """(centre, bounds) as the kernel reads them. centre: [B, 1, Hkv, D] f32, or with row_centres
  (bidirectional packed) [B, S, Hkv, D] each row's segment centre rounded to `dtype` (half the
  shared memory of f32). bounds [B, Hkv, 4, S]
  f32 per row: radius + slack, headroom, threshold, slack, where slack = max ‖c − c_rounded‖ keeps
  the bound sound: ‖k_j − c'‖ ≤ ‖k_j − c‖ + ‖c − c'‖ ≤ radius + slack."""
  per_row = functools.partial(_per_row, tile=tile, seq=seq)
  centre = keys.centre.astype(dtype if row_centres else jnp.float32)
  if row_centres:
    slack = jnp.linalg.norm(keys.centre - centre.astype(jnp.float32), axis=-1).max(axis=1)[..., None]  # [B, Hkv, 1]
  else:  # the f32 centre is exact
    slack = jnp.zeros(keys.centre.shape[:1] + keys.centre.shape[2:3] + (1,), jnp.float32)
  bounds = [per_row(keys.radius + slack), per_row(keys.headroom[..., None]), per_row(keys.threshold[..., None]),
            per_row(slack)]
  return centre, jnp.stack(bounds, axis=2).astype(jnp.float32)


def forward(q, k, v, segment_ids, stab: KeyBounds | Certificate | None, *, mode: Mode, causal, scale, kv_len,
            block_sizes: BlockSizes, seq_len: int | None = None, window=None, softcap=None, interpret=False,
            sinks=None):
  """Returns (o [B, S, Hq, Dv], lse [B, Hq, S] f32 base 2, certified tiles [B, Hq, S/64] or None).

  mode (plan.Mode) names the stabilizer: KEYS, stab the K/V pre-pass (each warpgroup certifies its
  rows in the prologue, bidirectional packed rows against their segment's centre); CERTIFICATE or
  BLOCKS, stab an XLA pre-pass's Certificate (granularity="head", the block bound); ONLINE, None.
  S must be a multiple of block_sizes.multiple (the API pads with zeros, which the in-kernel
  certificate relies on: zero rows pass). seq_len: accepted for the API's call, not needed.
  window: local (left, right), or None: each CTA streams only its band's KV blocks, every step masked.
  softcap: c of c·tanh(s / c), or None; the in-kernel certificate caps its bounds (capping is monotone).
  sinks: [Hq] f32 learned sink logits (natural-log units), or None: o and lse include each head's sink term, added in
  the epilogue (`_add_sink`; what stabilizer.fold_sinks does in XLA for the other backends).
  """
  o, lse, certified, _ = _launch(q, k, v, segment_ids, stab, mode=mode, causal=causal, scale=scale, kv_len=kv_len,
                                 block_sizes=block_sizes, interpret=interpret, window=window, softcap=softcap,
                                 sinks=sinks)
  return o, lse, certified


def forward_listed(q, k, v, visit, stab: KeyBounds | None, *, mode: Mode, scale, kv_len, block_sizes: BlockSizes,
                   track: bool):
  """Bidirectional, unpacked attention over kept-tile lists (kernels/clis_kernels/diffusion's temporal skipping): the CTA
  of q tile u (2·block_q rows) walks KV blocks visit[b, h, u, :count], count = visit[b, h, u, -1]; the memory
  warpgroup loads only those blocks, and both loops (certified, online) walk them.
  Returns (o, lse, certified [B, Hq, S/64] or None, rowmax [B, Hq, KV blocks, S] f32 or None): with track,
  max_j t_ij (log2 units, σ₂·q·k) over each visited block's keys for every row; unvisited blocks unwritten.
  """
  return _launch(q, k, v, None, stab, mode=mode, causal=False, scale=scale, kv_len=kv_len, block_sizes=block_sizes,
                 interpret=False, visit=visit, track=track)


def first_kv_blocks(segment_ids, *, cta_rows: int, block_kv: int):
  """masks.causal_document_ranges's first KV block per CTA, as range rows [B, CTAs, RANGE_WIDTH] (entry 0)."""
  first, _ = masks.causal_document_ranges(segment_ids, block_q=cta_rows, block_k=block_kv)
  return jnp.broadcast_to(first[..., None], first.shape + (RANGE_WIDTH,))


HEADS_PER_CTA_WINDOW = 1024  # auto_heads_per_cta: windows at most this many keys wide (left + right + 1)
HEADS_PER_CTA_MAX = 8
# heads_per_cta prefetches the next head's q tile up to this head dim; at 256 two q tiles per warpgroup (2 · 2 · 64 ·
# 256 · 2 bytes) do not fit beside K and V, so each head loads its own once the head before has stored o
Q_PREFETCH_MAX_HEAD_DIM = 128


def auto_heads_per_cta(*, mode: str, group: int, window, listed: bool, split_dims: bool, head_dim: int) -> int:
  """The default heads_per_cta: the largest divisor of the GQA group up to 8 for online calls with a window at most
  HEADS_PER_CTA_WINDOW keys wide, else 1. H200, 2026-12-03 (BENCHMARKS.md §1): window 128 at GQA 64/8 D 64, forward
  1.32× / 1.38× one head per CTA at 8 heads (8k / 32k rows); window 1024 at GQA 32/8 D 128, 1.07× / 1.03× at 4;
  window 4096 and plain causal 2k rows: within ±4%, so they keep one. Head dims above 128 keep one: there the next
  head's q tile cannot load during this one's loop (Q_PREFETCH_MAX_HEAD_DIM), and that form is not yet timed."""
  if (mode != "online" or listed or split_dims or head_dim > Q_PREFETCH_MAX_HEAD_DIM or window is None
      or sum(window) + 1 > HEADS_PER_CTA_WINDOW):
    return 1
  return max(n for n in range(1, HEADS_PER_CTA_MAX + 1) if group % n == 0)


def _check_heads_per_cta(c: _Config, q, v):
  """heads_per_cta walks heads of one GQA group with the online loop, q and v of one head dim."""
  if c.group % c.heads:
    raise ValueError(f"heads_per_cta={c.heads} must divide the query heads per kv head ({c.group}): a CTA walks heads "
                     "that share one kv head")
  if c.mode != "online" or c.listed:
    raise ValueError(f"heads_per_cta={c.heads} runs the online loop only (got mode {c.mode!r}"
                     f"{', a kept-tile list' if c.listed else ''}): use stabilizer='online' or heads_per_cta=1")
  if q.shape[-1] != v.shape[-1]:
    raise ValueError(f"heads_per_cta={c.heads} needs q and v of one head dim (got {q.shape[-1]} and {v.shape[-1]}): "
                     "use heads_per_cta=1")


def _launch(q, k, v, segment_ids, stab, *, mode: Mode, causal, scale, kv_len, block_sizes: BlockSizes, interpret,
            visit=None, track: bool = False, window=None, softcap=None, sinks=None):
  keys, cert = stabilizer_inputs(stab, mode)
  _check(q, k, v, keys, cert, scale, interpret, block_sizes.block_kv)
  batch, seq, num_heads, _ = q.shape
  bs = block_sizes
  if seq % bs.multiple or k.shape[1] % bs.multiple:
    raise ValueError(f"{bs.multiple=} must divide the padded lengths {q.shape[1]=} and {k.shape[1]=}")
  mode = {Mode.KEYS: "keys", Mode.ONLINE: "online"}.get(mode, "cert")  # the kernel's loops, by input
  row_centres = keys is not None and keys.centre.shape[1] != 1
  num_kv_blocks = k.shape[1] // bs.block_kv
  config = _Config(
      mode=mode, causal=causal, sigma2=scale * LOG2E, block_q=bs.block_q, block_kv=bs.block_kv,
      slots=min(bs.slots, num_kv_blocks), kv_len=kv_len, group=num_heads // k.shape[2],
      has_segments=segment_ids is not None, row_centres=row_centres, pingpong=bs.pingpong, overlap=bs.overlap,
      exact_sum=bs.exact_sum, tc_sum=bs.sum_on_tensor_cores and mode != "online", listed=visit is not None,
      lse_sum=bs.exact_lse and bs.exact_sum and mode != "online",
      track=track and visit is not None, list_width=0 if visit is None else visit.shape[-1],
      doc_ranges=bs.document_ranges and causal and segment_ids is not None and visit is None and window is None,
      window=None if window is None else tuple(int(w) for w in window),
      cap2=None if softcap is None else float(softcap) * LOG2E, tanh=bs.soft_cap_tanh, sinks=sinks is not None,
      one_memory_warp=bs.one_memory_warp)
  heads = bs.heads_per_cta
  if heads is None:
    heads = auto_heads_per_cta(mode=mode, group=config.group, window=config.window, listed=config.listed,
                               split_dims=q.shape[-1] != v.shape[-1], head_dim=q.shape[-1])
  config = dataclasses.replace(config, heads=heads, q_prefetch=heads > 1 and q.shape[-1] <= Q_PREFETCH_MAX_HEAD_DIM)
  if config.heads > 1:
    _check_heads_per_cta(config, q, v)
  kernel = functools.partial(_kernel, config=config)
  args = [q, k, v]
  if segment_ids is not None:  # key id 0 (padding) becomes −1: it then matches no query, padding included
    args += [segment_ids.q.astype(jnp.int32), jnp.where(segment_ids.kv == 0, -1, segment_ids.kv).astype(jnp.int32)]
  if config.doc_ranges:
    args.append(first_kv_blocks(segment_ids, cta_rows=COMPUTE_WARPGROUPS * bs.block_q, block_kv=bs.block_kv))
  if visit is not None:
    num_ctas = seq // (COMPUTE_WARPGROUPS * bs.block_q)
    if causal or segment_ids is not None or visit.shape[:3] != (batch, num_heads, num_ctas):
      raise ValueError(f"visit.shape={visit.shape} must be {(batch, num_heads, num_ctas)} + (width,) and the call "
                       "bidirectional and unpacked: kept-tile lists are per (batch, head, CTA q tile)")
    args.append(visit.astype(jnp.int32).reshape(visit.shape[:3] + _list_shape(visit.shape[-1])))
  out_type = [out_struct(q.shape[:3] + v.shape[3:], q.dtype, q), out_struct((batch, num_heads, seq), jnp.float32, q)]
  if mode == "cert":  # the kernel reads the certificate per row, with M
    args += [jnp.where(_per_row(cert.certified, tile=bs.tile, seq=seq), cert.m, FAILED_TILE_M)]
  if mode == "keys":
    if row_centres and segment_ids is None:
      raise ValueError(f"keys.centre.shape={keys.centre.shape}: one centre per position needs segment_ids "
                       "(stabilizer.key_bounds gives it for bidirectional packed rows only)")
    args += list(kernel_key_inputs(keys, row_centres=row_centres, dtype=q.dtype, seq=seq, tile=bs.tile))
    out_type.append(out_struct((batch, num_heads, seq), jnp.float32, q))  # certified flag per row
  if config.track:
    out_type.append(out_struct((batch, num_heads, num_kv_blocks, seq), jnp.float32, q))
  if sinks is not None:
    if sinks.shape != (num_heads,):
      raise ValueError(f"sinks.shape={sinks.shape} must be [Hq]=[{num_heads}], one logit per query head")
    args.append(jnp.broadcast_to((sinks.astype(jnp.float32) * LOG2E)[:, None], (num_heads, bs.block_q)))
  if config.tc_sum:
    args.append(jnp.ones((bs.block_kv, SUM_COLUMNS), q.dtype))
  outs = plgpu.kernel(
      kernel,
      out_type=tuple(out_type),
      grid=(num_heads // config.heads, seq // (COMPUTE_WARPGROUPS * bs.block_q), batch),
      grid_names=("heads", "q_tiles", "batch"),
      num_threads=COMPUTE_WARPGROUPS + 1,
      thread_name="wg",
      compiler_params=compiler_params(),
  )(*args)
  o, lse = outs[:2]
  rowmax = outs[-1] if config.track else None
  if mode == "keys":
    return o, lse, outs[2].reshape(batch, num_heads, seq // bs.tile, bs.tile)[..., 0] > 0.5, rowmax
  return o, lse, None if cert is None else cert.certified, rowmax
