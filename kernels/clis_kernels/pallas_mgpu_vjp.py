"""CLiS attention backward as Pallas Mosaic GPU kernels (Hopper: wgmma, TMA, warp specialisation).

The backward has no stabilizer: P = 2^(σ₂·q·kᵀ − lse) from the forward's base-2 lse (kernels/clis_kernels/stabilizer.py),
so one backward serves the certified and the online loop. dS = P ∘ (dO·Vᵀ − Δ) with
Δ = rowsum(dO ∘ O) (one XLA pass). Two kernels; in each, a CTA runs two compute warpgroups that
own 64 rows apiece and one memory warpgroup that streams the other side's blocks through `slots`
shared-memory buffers with TMA (as pallas_mgpu's forward, without the ping-pong):
  dq:  rows = queries; streams K and V blocks.                        dQ = σ·Σ dS·K
  dkv: rows = keys; streams Q, dO, lse and Δ blocks of every query head of the kv head's group
       (GQA sums dK and dV in registers).                             dV = Σ Pᵀ·dO, dK = σ·Σ dSᵀ·Q
Causal loops visit only the blocks on or below the diagonal (masks.py's ranges) and mask only the
blocks that straddle it. A warpgroup whose rows need fewer blocks than its CTA streams still waits
for each of them and releases it, so no buffer is refilled while the other warpgroup reads it.
Layouts as the forward's: q [B, S, Hq, D], dO [B, S, Hq, Dv], k [B, S, Hkv, D], v [B, S, Hkv, Dv], lse [B, Hq, S]
f32; Dv = D, or a (q·k, v) pair of SPLIT_HEAD_DIMS (MLA's 192/128) in the two kernels.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from clis_kernels import masks
from clis_kernels.mgpu_pipeline import (COMPUTE_WARPGROUPS, RANGE_WIDTH, compiler_params, cta_first_row, finish_stores,
                                        kv_blocks, range_scratch, read_range_entry, stream_blocks, stream_kv,
                                        swizzled)
from clis_kernels.common import int32_loop, out_struct
from clis_kernels.pallas_mgpu import SPLIT_HEAD_DIMS, first_kv_blocks
from clis_kernels.pallas_mgpu_mainloop import TANHS, cap_tanh
from clis_kernels.stabilizer import LOG2E

ROWS = 64  # rows per compute warpgroup (one wgmma M tile), and the streamed block in both kernels
ROW = plgpu.Layout.WGMMA.reduce(1)  # one value per row of a [64, N] wgmma tile
COL = plgpu.Layout.WGMMA.reduce(0)  # one value per column


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tunables of the Mosaic GPU backward: `slots` streamed blocks in flight (shared-memory buffers).
  fused_dq: one kernel instead of two — the dK/dV kernel also forms dQ's part from each (query block, key
  block) pair, dS·K (a fifth matmul, its dS through shared memory), and adds it into an f32 dQ in HBM with
  TMA's reduce-add, so S and dP are computed once instead of twice. The adds' order varies between runs (f32
  sums of the same terms, not bit-identical); fused_dq=False, the two kernels, is the deterministic choice
  (each dQ row summed by one warpgroup in a fixed order), at the cost of recomputing S and dP.
  document_ranges: causal packed calls visit only the block pairs whose documents meet (the forward's option of
  the same name: dQ's loop starts at its rows' documents' first KV block, dK/dV's ends at its keys' documents'
  last query block). On by default; False visits every causal block pair.
  split_dq (with fused_dq, head dim 128): FlashAttention-3's split of dQ — the two compute warpgroups share their
  dSᵀ through shared memory and each forms one half of the head dim from both, dS [64 q × 128 k]·K[:, half],
  so each step adds a [64, 64] f32 part per warpgroup instead of [64, 128] (half the reduce-add bytes, half the
  dQ accumulator's registers, half the staging memory). Both warpgroups then walk the CTA's steps in lockstep
  (one 2-arrival barrier per step). Opt-in until timed on the H200.
  soft_cap_tanh: logits_soft_cap's tanh, as the forward's BlockSizes field of that name (they should agree).
  overlap_dq, overlap_dkv: in the dQ kernel, or in the dK/dV kernel (the fused one too), each step issues dP's wgmma
  right behind S's and waits only for S before forming P, so the tensor cores run dP while the warpgroup computes P
  (FlashAttention-3's order). The same arithmetic in another order (bit-identical gradients); it holds dP's
  accumulator (32 registers a thread) through P. Apart because they measured apart (default_block_sizes).
  dv_with_dp: the dK/dV step issues dV's wgmma right behind dP's, before dP is waited for; False issues it with dK's,
  after dS. Without overlap_dkv, True is tokamax's order (S, P, dP and dV, dS, dK). The fused kernel has its own."""

  slots: int = 2
  fused_dq: bool = False
  document_ranges: bool = True
  split_dq: bool = False
  soft_cap_tanh: str = "approx"
  overlap_dq: bool = False
  overlap_dkv: bool = False
  dv_with_dp: bool = False

  def __post_init__(self):
    if self.soft_cap_tanh not in TANHS:
      raise ValueError(f"{self.soft_cap_tanh=} must be one of {TANHS} (pallas_mgpu_mainloop.cap_tanh says what each "
                       "costs)")
    if self.slots < 2:
      raise ValueError(f"{self.slots=} must be at least 2 (one block computing while the next loads)")
    if self.split_dq and not self.fused_dq:
      raise ValueError("split_dq=True splits the fused backward's dQ: it needs fused_dq=True")
    if self.split_dq and (self.overlap_dq or self.overlap_dkv):
      raise ValueError("split_dq=True runs in the serial step order only: with overlap_dq or overlap_dkv its dK was not "
                       "the same run to run on the GPU (1 bf16 ulp, 2 of 4 runs, 2026-12-07) and it was no faster "
                       "(0.97x the two kernels at 32k): use overlap_dq=False, overlap_dkv=False")
    if self.dv_with_dp and self.fused_dq:
      raise ValueError("dv_with_dp=True moves the dK/dV kernel's dV wgmma; the fused kernel (fused_dq=True) forms dV "
                       "in its own order: use dv_with_dp=False")

  @property
  def multiple(self) -> int:
    return COMPUTE_WARPGROUPS * ROWS


def _masked(s, row_pos, col_pos, row_ids, col_ids, *, causal_rows_are_queries, causal, kv_len, masked, window=None):
  """s with −inf where a column is invisible to a row. Segment ids apply at every step; the causal,
  local-window and kv_len masks only where the caller says the block straddles them."""
  if row_ids is not None:
    same = lax.broadcast_in_dim(row_ids, s.shape, [0]) == lax.broadcast_in_dim(col_ids, s.shape, [1])
    s = jnp.where(same, s, -jnp.inf)
  if masked:
    rows = row_pos + plgpu.broadcasted_iota(jnp.int32, s.shape, 0, layout=plgpu.Layout.WGMMA)
    cols = col_pos + plgpu.broadcasted_iota(jnp.int32, s.shape, 1, layout=plgpu.Layout.WGMMA)
    if window is not None:
      q_pos, k_pos = (rows, cols) if causal_rows_are_queries else (cols, rows)
      seen = masks.visible_pairs(q_pos, k_pos, None, None, causal=False, kv_len=kv_len, window=window)
      s = jnp.where(seen, s, -jnp.inf)  # causal: the window's right side is 0
    elif causal:
      s = jnp.where(rows >= cols if causal_rows_are_queries else cols >= rows, s, -jnp.inf)
    else:
      s = jnp.where(cols < kv_len, s, -jnp.inf)
  return s


def _capped(s, sigma2: float, cap2, tanh: str):
  """(s', dtanh, scale): Q·Kᵀ soft-capped, with the scale that makes it base-2 logits (scale·s' = cap2·tanh(σ₂·s /
  cap2), as the forward: s' = tanh(σ₂·s / cap2), scale = cap2), and the cap's derivative 1 − tanh², which scales dS;
  (s, None, σ₂) without a cap. Before the mask, as in the forward."""
  if cap2 is None:
    return s, None, sigma2
  th = cap_tanh(s * (sigma2 / cap2), tanh)
  return th, 1.0 - th * th, cap2


def _weights_and_dp(issue_s, issue_dp, weights, *, overlap: bool, wait_dp=None, after_weights=None):
  """One step's (weights(S), dP), S and dP [64, 64] f32 accumulators (or their transposes). issue_s(acc) and
  issue_dp(acc) issue their wgmmas into acc and return how many; weights(s) forms P (and what else the step takes
  from S); wait_dp() waits for dP's operands. Without overlap: S, P, then dP, one accumulator live at a time. With
  overlap (BlockSizes.overlap_dq, overlap_dkv): dP's wgmmas go right behind S's and only S is waited for, so the tensor
  cores run dP while this warpgroup forms P. after_weights(w), if given, issues more wgmmas behind dP's, before dP is
  waited for (the dK/dV kernels' dV), and returns how many; without overlap that is tokamax's dK/dV order."""
  acc = plgpu.ACC((ROWS, ROWS), jnp.float32)
  if not overlap:
    def s_scope(ref):
      issue_s(ref)
      return ref[...]

    def dp_scope(ref):
      issue_dp(ref)
      if after_weights is None:
        return ref[...]
      return plgpu.wgmma_accumulator_load(ref, wait_n=after_weights(w))

    w = weights(pl.run_scoped(s_scope, acc))
    if wait_dp is not None:
      wait_dp()
    return w, pl.run_scoped(dp_scope, acc)

  def scope(s_ref, dp_ref):
    issue_s(s_ref)
    if wait_dp is not None:
      wait_dp()
    behind = issue_dp(dp_ref)
    w = weights(plgpu.wgmma_accumulator_load(s_ref, wait_n=behind))
    later = 0 if after_weights is None else after_weights(w)
    return w, plgpu.wgmma_accumulator_load(dp_ref, wait_n=later)

  return pl.run_scoped(scope, acc, acc)


def _scores_grad(p, dtanh, delta, dp):
  """dS = P ∘ (dP − Δ), times the soft cap's derivative where there is a cap."""
  ds = p * (dp - delta)
  return ds if dtanh is None else ds * dtanh


def _key_rows_weights(s, *, slot, kv0, q_block, k_ids, qseg_smem, lse_smem, delta_smem, sigma2, cap2, tanh, causal,
                      masked, window):
  """(Pᵀ, the cap's derivative or None, Δ) of a dK/dV step from its Sᵀ [keys from kv0, queries of block q_block]:
  capped, masked, with the streamed block's lse and Δ (in shared-memory `slot`) broadcast over the keys."""
  s, dtanh, logit_scale = _capped(s, sigma2, cap2, tanh)
  q_ids = None if qseg_smem is None else plgpu.load(qseg_smem.at[slot], layout=COL)
  s = _masked(s, kv0, q_block * ROWS, k_ids, q_ids, causal_rows_are_queries=False, causal=causal, kv_len=None,
              masked=masked, window=window)
  lse = lax.broadcast_in_dim(plgpu.load(lse_smem.at[slot], layout=COL), s.shape, [1])
  delta = lax.broadcast_in_dim(plgpu.load(delta_smem.at[slot], layout=COL), s.shape, [1])
  return jnp.exp2(s * logit_scale - lse), dtanh, delta


def _query_rows_weights(s, *, slot, row0, kv_block, q_ids, kseg_smem, kseg_ready, lse, sigma2, cap2, tanh, causal,
                        kv_len, masked, window):
  """(P, the cap's derivative or None) of a dQ step from its S [queries from row0, keys of block kv_block]: capped,
  masked (the block's key ids waited for and read from shared-memory `slot` when packed), with the rows' lse (one value
  a row, or already broadcast to S's shape)."""
  s, dtanh, logit_scale = _capped(s, sigma2, cap2, tanh)
  k_ids = None
  if kseg_smem is not None:
    plgpu.barrier_wait(kseg_ready.at[slot])
    k_ids = plgpu.load(kseg_smem.at[slot], layout=COL)
  s = _masked(s, row0, kv_block * ROWS, q_ids, k_ids, causal_rows_are_queries=True, causal=causal, kv_len=kv_len,
              masked=masked, window=window)
  return jnp.exp2(s * logit_scale - (lse if lse.ndim == 2 else lax.broadcast_in_dim(lse, s.shape, [0]))), dtanh


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, causal, sigma2, scale, slots, kv_len,
               group, has_segments, doc_ranges: bool = False, window=None, cap2=None, tanh: str = "approx",
               overlap: bool = False):
  qseg_ref = kseg_ref = range_ref = None
  if has_segments:
    (qseg_ref, kseg_ref), refs = refs[:2], refs[2:]
  if doc_ranges:  # [B, q tiles, RANGE_WIDTH]: the CTA's first KV block
    (range_ref,), refs = refs[:1], refs[1:]
  (dq_ref,) = refs
  dtype, head_dim, value_head_dim = q_ref.dtype, q_ref.shape[-1], v_ref.shape[-1]
  batch, head = lax.axis_index("batch"), lax.axis_index("heads")
  cta_row0 = cta_first_row(q_ref.shape[1], ROWS, causal=causal)
  kv_head = lax.div(head, jnp.int32(group))
  kv_range = functools.partial(kv_blocks, causal=causal, block_kv=ROWS, num_kv_blocks=k_ref.shape[1] // ROWS,
                               kv_len=kv_len)
  _, cta_blocks = kv_range(cta_row0, COMPUTE_WARPGROUPS * ROWS)
  if window is not None:  # the CTA's band [band_first, band_end) of KV blocks, every step masked
    band_first, band_end = masks.window_kv_blocks(
        lax.div(cta_row0, jnp.int32(COMPUTE_WARPGROUPS * ROWS)), window=window, block_q=COMPUTE_WARPGROUPS * ROWS,
        block_k=ROWS, num_kv_blocks=k_ref.shape[1] // ROWS, div=masks.idiv)

  def body(q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, q_ready, do_ready, lse_ready, delta_ready,
           k_ready, v_ready, free, *extra_scratch):
    wg = lax.axis_index("wg")
    seg_scratch, ranges = extra_scratch[:4 * has_segments], extra_scratch[4 * has_segments:]
    qseg_smem, kseg_smem, qseg_ready, kseg_ready = seg_scratch if has_segments else (None,) * 4
    first, blocks, block_of, slot_of = 0, cta_blocks, (lambda i: i), (lambda i: lax.rem(i, jnp.int32(slots)))
    if doc_ranges:  # the CTA's first KV block: the stream starts there and the slots count from it
      first = read_range_entry(range_ref.at[batch, lax.div(cta_row0, jnp.int32(COMPUTE_WARPGROUPS * ROWS))],
                               *ranges)
      blocks, block_of = cta_blocks - first, (lambda i: first + i)
      slot_of = lambda i: lax.rem(i - first, jnp.int32(slots))
    if window is not None:  # the same counting from the band's first block
      first, blocks, block_of = band_first, band_end - band_first, (lambda i: band_first + i)
      slot_of = lambda i: lax.rem(i - band_first, jnp.int32(slots))

    @pl.when(wg < COMPUTE_WARPGROUPS)
    def _compute():
      plgpu.set_max_registers(232, action="increase")
      row0 = cta_row0 + wg * ROWS
      lead = first  # steps [first, lead) take the window's mask (its band's lower edge)
      if window is None:
        full, total = kv_range(row0, ROWS)
      else:
        whole = masks.window_full_blocks(row0, rows=ROWS, window=window, block=ROWS, kv_len=kv_len, div=masks.idiv)
        (lead, full), total = masks.masked_edges(first, first + blocks, whole), first + blocks
      rows = pl.ds(row0, ROWS)
      plgpu.copy_gmem_to_smem(q_ref.at[batch, rows, head], q_smem.at[wg], q_ready.at[wg])
      plgpu.copy_gmem_to_smem(do_ref.at[batch, rows, head], do_smem.at[wg], do_ready.at[wg])
      plgpu.copy_gmem_to_smem(lse_ref.at[batch, head, rows], lse_smem.at[wg], lse_ready.at[wg])
      plgpu.copy_gmem_to_smem(delta_ref.at[batch, head, rows], delta_smem.at[wg], delta_ready.at[wg])
      q_ids = None
      if has_segments:
        plgpu.copy_gmem_to_smem(qseg_ref.at[batch, rows], qseg_smem.at[wg], qseg_ready.at[wg])
        plgpu.barrier_wait(qseg_ready.at[wg])
        q_ids = plgpu.load(qseg_smem.at[wg], layout=ROW)
      for barrier in (q_ready, do_ready, lse_ready, delta_ready):
        plgpu.barrier_wait(barrier.at[wg])
      lse, delta = plgpu.load(lse_smem.at[wg], layout=ROW), plgpu.load(delta_smem.at[wg], layout=ROW)
      rows_of = lambda x: lax.broadcast_in_dim(x, (ROWS, ROWS), [0])

      row_weights = functools.partial(  # the step's weights, less its slot, block and mask
          _query_rows_weights, row0=row0, q_ids=q_ids, kseg_smem=kseg_smem, kseg_ready=kseg_ready, lse=lse,
          sigma2=sigma2, cap2=cap2, tanh=tanh, causal=causal, kv_len=kv_len, window=window)

      def step(i, acc, masked: bool):
        slot = slot_of(i)
        plgpu.barrier_wait(k_ready.at[slot])

        def issue_s(acc_ref):
          plgpu.wgmma(acc_ref, q_smem.at[wg], k_smem.at[slot].T)
          return 1

        weights = functools.partial(row_weights, slot=slot, kv_block=i, masked=masked)

        def issue_dp(acc_ref):
          plgpu.wgmma(acc_ref, do_smem.at[wg], v_smem.at[slot].T)
          return 1

        (p, dtanh), dp = _weights_and_dp(issue_s, issue_dp, weights, overlap=overlap,
                                         wait_dp=lambda: plgpu.barrier_wait(v_ready.at[slot]))
        ds = _scores_grad(p, dtanh, rows_of(delta), dp)

        def dq_update(acc_ref):
          plgpu.wgmma(acc_ref, ds.astype(dtype), k_smem.at[slot])

        acc = pl.run_state(dq_update)(plgpu.ACC.init(acc))
        plgpu.barrier_arrive(free.at[slot])
        return acc

      def release(i, _):  # a block of the CTA's range that these rows do not see
        slot = slot_of(i)
        for barrier in (k_ready, v_ready) + ((kseg_ready,) if has_segments else ()):
          plgpu.barrier_wait(barrier.at[slot])
        plgpu.barrier_arrive(free.at[slot])

      acc = plgpu.layout_cast(jnp.zeros((ROWS, head_dim), jnp.float32), plgpu.Layout.WGMMA)
      if window is not None:
        acc = int32_loop(first, lead, functools.partial(step, masked=True), acc)
      acc = int32_loop(lead, full, functools.partial(step, masked=False), acc)
      if causal or kv_len is not None or window is not None:
        acc = int32_loop(full, total, functools.partial(step, masked=True), acc)
      if causal and window is None:
        int32_loop(total, cta_blocks, release, None)
      q_smem.at[wg][...] = (acc * scale).astype(dtype)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(q_smem.at[wg], dq_ref.at[batch, rows, head])
      finish_stores()

    @pl.when(wg == COMPUTE_WARPGROUPS)
    def _memory():
      plgpu.set_max_registers(40, action="decrease")

      stream_kv(k_ref, v_ref, kseg_ref, k_smem, v_smem, kseg_smem, k_ready, v_ready, kseg_ready, batch=batch,
                kv_head=kv_head, block_kv=ROWS, num_blocks=blocks, slots=slots, free=(free,), block_of=block_of)

  per_wg = lambda: plgpu.Barrier(num_barriers=COMPUTE_WARPGROUPS)
  per_slot = lambda: plgpu.Barrier(num_barriers=slots)
  pl.run_scoped(
      body,
      plgpu.SMEM((COMPUTE_WARPGROUPS, ROWS, head_dim), dtype, transforms=swizzled()),  # q, then dq
      plgpu.SMEM((COMPUTE_WARPGROUPS, ROWS, value_head_dim), dtype, transforms=swizzled()),  # dO
      plgpu.SMEM((slots, ROWS, head_dim), dtype, transforms=swizzled()),  # k blocks
      plgpu.SMEM((slots, ROWS, value_head_dim), dtype, transforms=swizzled()),  # v blocks
      plgpu.SMEM((COMPUTE_WARPGROUPS, ROWS), jnp.float32),  # lse
      plgpu.SMEM((COMPUTE_WARPGROUPS, ROWS), jnp.float32),  # Δ
      per_wg(), per_wg(), per_wg(), per_wg(),  # q, dO, lse, Δ ready
      per_slot(), per_slot(),  # k, v ready
      plgpu.Barrier(num_arrivals=COMPUTE_WARPGROUPS, num_barriers=slots),  # slot free
      *(() if not has_segments else (
          plgpu.SMEM((COMPUTE_WARPGROUPS, ROWS), jnp.int32), plgpu.SMEM((slots, ROWS), jnp.int32),
          per_wg(), per_slot())),
      *(range_scratch() if doc_ranges else ()),
      collective_axes="wg",
  )


def _q_blocks(kv0, rows, *, causal: bool, num_q_blocks: int):
  """(first, first_full) for key rows [kv0, kv0 + rows): q blocks [first, first_full) straddle the diagonal;
  all blocks when bidirectional (padded keys need no mask here: their dK, dV rows are cut off by the caller)."""
  if causal:
    return masks.causal_q_blocks(lax.div(kv0, jnp.int32(rows)), block_q=ROWS, block_k=rows,
                                 num_q_blocks=num_q_blocks, div=masks.idiv)
  return 0, 0


def _dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, causal, sigma2, scale, slots, group,
                has_segments, fused_dq: bool = False, split_dq: bool = False, doc_ranges: bool = False, window=None,
                cap2=None, tanh: str = "approx", overlap: bool = False, dv_with_dp: bool = False):
  qseg_ref = kseg_ref = dq_ref = range_ref = None
  if has_segments:
    (qseg_ref, kseg_ref), refs = refs[:2], refs[2:]
  if doc_ranges:  # [B, kv tiles, RANGE_WIDTH]: one past the CTA's last q block
    (range_ref,), refs = refs[:1], refs[1:]
  if fused_dq:  # an f32 [B, S, Hq, D] ref of zeros that every CTA adds its dQ parts into
    (dq_ref,), refs = refs[:1], refs[1:]
  dk_ref, dv_ref = refs
  dtype, head_dim, value_head_dim = k_ref.dtype, k_ref.shape[-1], v_ref.shape[-1]
  num_q_blocks = q_ref.shape[1] // ROWS
  batch, kv_head = lax.axis_index("batch"), lax.axis_index("heads")
  cta_kv0 = lax.axis_index("kv_tiles") * (COMPUTE_WARPGROUPS * ROWS)  # low tiles see the most: they start first

  q_range = functools.partial(_q_blocks, causal=causal, num_q_blocks=num_q_blocks)
  cta_first, cta_first_full = q_range(cta_kv0, COMPUTE_WARPGROUPS * ROWS)
  cta_end = num_q_blocks  # one past the last q block the CTA visits
  if window is not None:  # the band of q blocks whose rows see the CTA's keys, every step masked
    cta_first, cta_end = masks.window_q_blocks(
        lax.div(cta_kv0, jnp.int32(COMPUTE_WARPGROUPS * ROWS)), window=window, block_q=ROWS,
        block_k=COMPUTE_WARPGROUPS * ROWS, num_q_blocks=num_q_blocks, div=masks.idiv)
  all_q_blocks = jnp.asarray(cta_end - cta_first, jnp.int32)  # q blocks the CTA streams per head of the group

  def body(k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, k_ready, v_ready, q_ready, do_ready, lse_ready,
           delta_ready, free, *extra_scratch):
    wg = lax.axis_index("wg")
    seg_scratch, extra_scratch = extra_scratch[:4 * has_segments], extra_scratch[4 * has_segments:]
    n_dq = (4 if split_dq else 2) if fused_dq else 0
    dq_scratch, ranges = extra_scratch[:n_dq], extra_scratch[n_dq:]
    kseg_smem, qseg_smem, kseg_ready, qseg_ready = seg_scratch if has_segments else (None,) * 4
    ds_smem, dq_smem, ds_ready, keys_read = (tuple(dq_scratch) + (None,) * 4)[:4]
    end, per_head = cta_end, all_q_blocks  # one past the last q block the CTA visits; blocks per head
    if doc_ranges:
      end = read_range_entry(range_ref.at[batch, lax.axis_index("kv_tiles")], *ranges)
      per_head = end - cta_first

    @pl.when(wg < COMPUTE_WARPGROUPS)
    def _compute():
      plgpu.set_max_registers(232, action="increase")
      kv0 = cta_kv0 + wg * ROWS
      first, first_full = q_range(kv0, ROWS)
      rows = pl.ds(kv0, ROWS)
      plgpu.copy_gmem_to_smem(k_ref.at[batch, rows, kv_head], k_smem.at[wg], k_ready.at[wg])
      plgpu.copy_gmem_to_smem(v_ref.at[batch, rows, kv_head], v_smem.at[wg], v_ready.at[wg])
      k_ids = None
      if has_segments:
        plgpu.copy_gmem_to_smem(kseg_ref.at[batch, rows], kseg_smem.at[wg], kseg_ready.at[wg])
        plgpu.barrier_wait(kseg_ready.at[wg])
        k_ids = plgpu.load(kseg_smem.at[wg], layout=ROW)
      plgpu.barrier_wait(k_ready.at[wg])
      plgpu.barrier_wait(v_ready.at[wg])

      def wait_block(slot):
        for barrier in (q_ready, do_ready, lse_ready, delta_ready) + ((qseg_ready,) if has_segments else ()):
          plgpu.barrier_wait(barrier.at[slot])

      key_weights = functools.partial(  # the step's weights, less its slot, block and mask
          _key_rows_weights, kv0=kv0, k_ids=k_ids, qseg_smem=qseg_smem, lse_smem=lse_smem, delta_smem=delta_smem,
          sigma2=sigma2, cap2=cap2, tanh=tanh, causal=causal, window=window)

      def step(j, carry, g, masked: bool):
        """q block j of group head g; the stream's step i counts from the CTA's first block."""
        dk, dv = carry
        slot = lax.rem(g * per_head + j - cta_first, jnp.int32(slots))
        wait_block(slot)

        def issue_s(acc_ref):  # sᵀ: keys × queries
          plgpu.wgmma(acc_ref, k_smem.at[wg], q_smem.at[slot].T)
          return 1

        weights = functools.partial(key_weights, slot=slot, q_block=j, masked=masked)

        def issue_dp(acc_ref):  # dPᵀ = V·dOᵀ
          plgpu.wgmma(acc_ref, v_smem.at[wg], do_smem.at[slot].T)
          return 1

        if dv_with_dp:  # dV's wgmma goes out behind dP's (BlockSizes.dv_with_dp)
          def overlapped(refs):
            dk_ref_, dv_ref_ = refs

            def issue_dv(w):
              plgpu.wgmma(dv_ref_, w[0].astype(dtype), do_smem.at[slot])
              return 1

            w, dp = _weights_and_dp(issue_s, issue_dp, weights, overlap=overlap, after_weights=issue_dv)
            plgpu.wgmma(dk_ref_, _scores_grad(*w, dp).astype(dtype), q_smem.at[slot])

          dk, dv = pl.run_state(overlapped)((plgpu.ACC.init(dk), plgpu.ACC.init(dv)))
          plgpu.barrier_arrive(free.at[slot])
          return dk, dv
        (p, dtanh, delta), dp = _weights_and_dp(issue_s, issue_dp, weights, overlap=overlap)
        ds = _scores_grad(p, dtanh, delta, dp)
        if split_dq:
          i = g * per_head + j - cta_first  # the stream's step: its parity picks the dSᵀ buffers and barrier
          half = head_dim // 2
          dk, dv, dq_part = _split_update(dk, dv, p, ds.astype(dtype), do_smem.at[slot], q_smem.at[slot], k_smem,
                                          ds_smem.at[lax.rem(i, jnp.int32(2))], ds_ready.at[lax.rem(i, jnp.int32(2))],
                                          wg=wg, half=half)
          plgpu.barrier_arrive(free.at[slot])
          _add_dq(dq_part, dq_smem.at[wg], dq_ref.at[batch, pl.ds(j * ROWS, ROWS), kv_head * group + g,
                                                     pl.ds(wg * half, half)])
          return dk, dv
        if not fused_dq:
          def update(refs):
            dk_ref_, dv_ref_ = refs
            plgpu.wgmma(dv_ref_, p.astype(dtype), do_smem.at[slot])
            plgpu.wgmma(dk_ref_, ds.astype(dtype), q_smem.at[slot])

          dk, dv = pl.run_state(update)((plgpu.ACC.init(dk), plgpu.ACC.init(dv)))
          plgpu.barrier_arrive(free.at[slot])
          return dk, dv
        dk, dv, dq_part = _fused_update(dk, dv, p, ds.astype(dtype), do_smem.at[slot], q_smem.at[slot], k_smem.at[wg],
                                        ds_smem.at[wg])
        plgpu.barrier_arrive(free.at[slot])
        _add_dq(dq_part, dq_smem.at[wg], dq_ref.at[batch, pl.ds(j * ROWS, ROWS), kv_head * group + g])
        return dk, dv

      def release(j, _, g):  # a streamed block above these rows' diagonal
        slot = lax.rem(g * per_head + j - cta_first, jnp.int32(slots))
        wait_block(slot)
        plgpu.barrier_arrive(free.at[slot])

      def head_loop(g, carry):
        if causal and window is None and not split_dq:  # from this warpgroup's own diagonal; blocks above released
          int32_loop(cta_first, first, functools.partial(release, g=g), None)
          carry = int32_loop(first, first_full, functools.partial(step, g=g, masked=True), carry)
          return int32_loop(first_full, end, functools.partial(step, g=g, masked=False), carry)
        # both warpgroups walk the CTA's blocks (the window's band; lockstep for split_dq), masking what they can't see
        return _walk_q_blocks(step, carry, g, kv0=kv0, first=cta_first, first_full=cta_first_full, end=end,
                             causal=causal, window=window, num_q_blocks=num_q_blocks)

      zeros = lambda width: plgpu.layout_cast(jnp.zeros((ROWS, width), jnp.float32), plgpu.Layout.WGMMA)
      dk0 = zeros(head_dim)
      dk, dv = int32_loop(0, group, head_loop, (dk0, dk0 if value_head_dim == head_dim else zeros(value_head_dim)))
      if split_dq:  # the other warpgroup's last dQ wgmma reads this one's K: dK may take its bytes only after
        plgpu.barrier_arrive(keys_read.at[0])
        plgpu.barrier_wait(keys_read.at[0])
      k_smem.at[wg][...] = (dk * scale).astype(dtype)
      v_smem.at[wg][...] = dv.astype(dtype)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(k_smem.at[wg], dk_ref.at[batch, rows, kv_head])
      plgpu.copy_smem_to_gmem(v_smem.at[wg], dv_ref.at[batch, rows, kv_head])
      finish_stores()  # the last dQ adds too

    @pl.when(wg == COMPUTE_WARPGROUPS)
    def _memory():
      plgpu.set_max_registers(40, action="decrease")

      by_rows, by_head = (lambda h, r: (batch, r, h)), (lambda h, r: (batch, h, r))
      streams = [(q_ref, q_smem, q_ready, by_rows), (do_ref, do_smem, do_ready, by_rows),
                 (lse_ref, lse_smem, lse_ready, by_head), (delta_ref, delta_smem, delta_ready, by_head)]
      if has_segments:
        streams.append((qseg_ref, qseg_smem, qseg_ready, lambda h, r: (batch, r)))
      _stream_query_blocks(streams, kv_head=kv_head, group=group, per_head=per_head, cta_first=cta_first,
                           slots=slots, free=free)

  pl.run_scoped(body, *_dkv_scratch(dtype, head_dim, value_head_dim, slots, has_segments, fused_dq, split_dq),
                *(range_scratch() if doc_ranges else ()), collective_axes="wg")


def _walk_q_blocks(step, carry, g, *, kv0, first, first_full, end, causal: bool, window, num_q_blocks: int):
  """Group head g of a dK/dV CTA whose rows all take every step: step(j, carry, g=g, masked=...) over q blocks
  [first, end) (causal: masked up to first_full, past the rows' diagonal block; a window: masked at the band's
  edges, as seen from keys kv0 on; bidirectional: every block, unmasked). Returns the carry."""
  if window is not None:
    whole = masks.window_full_blocks(kv0, rows=ROWS, window=window[::-1], block=ROWS, kv_len=None, div=masks.idiv)
    lead, full = masks.masked_edges(first, end, whole)
    carry = int32_loop(first, lead, functools.partial(step, g=g, masked=True), carry)
    carry = int32_loop(lead, full, functools.partial(step, g=g, masked=False), carry)
    return int32_loop(full, end, functools.partial(step, g=g, masked=True), carry)
  if causal:
    carry = int32_loop(first, first_full, functools.partial(step, g=g, masked=True), carry)
    return int32_loop(first_full, end, functools.partial(step, g=g, masked=False), carry)
  return int32_loop(0, num_q_blocks, functools.partial(step, g=g, masked=False), carry)


def _stream_query_blocks(streams, *, kv_head, group: int, per_head, cta_first, slots: int, free):
  """The dK/dV kernel's memory warpgroup: block i of the stream is head i // per_head of the kv head's group,
  query rows from block cta_first + i % per_head; each (gmem ref, smem, ready barrier, index of (head, rows))
  in `streams` is loaded for it."""
  def load(i, slot):
    head = kv_head * group + lax.div(i, per_head)
    rows = pl.ds((cta_first + lax.rem(i, per_head)) * ROWS, ROWS)
    for ref, smem, ready, at in streams:
      plgpu.copy_gmem_to_smem(ref.at[at(head, rows)], smem.at[slot], ready.at[slot])

  stream_blocks(load, num_blocks=group * per_head, slots=slots, free=(free,))


def _fused_update(dk, dv, p, ds_low, do_block, q_block, k_rows, ds_buf):
  """One step's three matmuls after S and dP (rows = this warpgroup's 64 keys, columns = a block of queries):
  dV += Pᵀ·dO and dK += dSᵀ·Q from registers, and dQ's part dS·K [queries, D] with dSᵀ stored to shared memory
  and read transposed (wgmma's A from registers cannot be transposed). Returns (dk, dv, dq_part)."""
  ds_buf[...] = ds_low  # the previous step's dS·K has completed: run_state waits for its wgmmas
  plgpu.commit_smem()

  def update(refs):
    dk_ref_, dv_ref_, dq_ref_ = refs
    plgpu.wgmma(dv_ref_, p.astype(ds_low.dtype), do_block)
    plgpu.wgmma(dk_ref_, ds_low, q_block)
    plgpu.wgmma(dq_ref_, ds_buf.T, k_rows)

  zeros = plgpu.layout_cast(jnp.zeros(dk.shape, jnp.float32), plgpu.Layout.WGMMA)
  return pl.run_state(update)((plgpu.ACC.init(dk), plgpu.ACC.init(dv), plgpu.ACC.init(zeros)))


def _split_update(dk, dv, p, ds_low, do_block, q_block, k_smem, ds_bufs, ds_ready, *, wg, half: int):
  """_fused_update's split form: this warpgroup's dSᵀ goes to its half of `ds_bufs` [2 warpgroups, keys,
  queries]; dV and dK are issued; once both warpgroups' dSᵀ are in (`ds_ready`, two arrivals), dQ's part for
  head-dim columns [wg·half, (wg + 1)·half) is Σ_w dSᵀ_w.T·K_w[:, half] over both warpgroups' keys. The buffers
  alternate by step parity: a warpgroup rewrites this parity's two steps later, after the other has arrived at
  the step between — which it does only once its own run_state, and so its reads of this parity, completed."""
  ds_bufs.at[wg][...] = ds_low
  plgpu.commit_smem()
  plgpu.barrier_arrive(ds_ready)
  columns = pl.ds(wg * half, half)

  def update(refs):
    dk_ref_, dv_ref_, dq_ref_ = refs
    plgpu.wgmma(dv_ref_, p.astype(ds_low.dtype), do_block)
    plgpu.wgmma(dk_ref_, ds_low, q_block)
    plgpu.barrier_wait(ds_ready)
    for w in range(COMPUTE_WARPGROUPS):
      plgpu.wgmma(dq_ref_, ds_bufs.at[w].T, k_smem.at[w, :, columns])

  zeros = plgpu.layout_cast(jnp.zeros((dk.shape[0], half), jnp.float32), plgpu.Layout.WGMMA)
  return pl.run_state(update)((plgpu.ACC.init(dk), plgpu.ACC.init(dv), plgpu.ACC.init(zeros)))


def _add_dq(dq_part, buf, dq_rows):
  """Adds dq_part [64, D] f32 into dq_rows (HBM) with TMA's reduce-add, through `buf` once the previous
  add has read it."""
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)
  buf[...] = dq_part
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(buf, dq_rows, reduction_op="add")


def _dkv_scratch(dtype, head_dim: int, value_head_dim: int, slots: int, has_segments: bool, fused_dq: bool = False,
                 split_dq: bool = False) -> tuple:
  """The dK/dV kernel's shared memory and barriers, in the order its body takes them."""
  per_wg = lambda: plgpu.Barrier(num_barriers=COMPUTE_WARPGROUPS)
  per_slot = lambda: plgpu.Barrier(num_barriers=slots)
  return (
      plgpu.SMEM((COMPUTE_WARPGROUPS, ROWS, head_dim), dtype, transforms=swizzled()),  # k, then dk
      plgpu.SMEM((COMPUTE_WARPGROUPS, ROWS, value_head_dim), dtype, transforms=swizzled()),  # v, then dv
      plgpu.SMEM((slots, ROWS, head_dim), dtype, transforms=swizzled()),  # q blocks
      plgpu.SMEM((slots, ROWS, value_head_dim), dtype, transforms=swizzled()),  # dO blocks
      plgpu.SMEM((slots, ROWS), jnp.float32),  # lse blocks
      plgpu.SMEM((slots, ROWS), jnp.float32),  # Δ blocks
      per_wg(), per_wg(),  # k, v ready
      per_slot(), per_slot(), per_slot(), per_slot(),  # q, dO, lse, Δ ready
      plgpu.Barrier(num_arrivals=COMPUTE_WARPGROUPS, num_barriers=slots),  # slot free
      *(() if not has_segments else (
          plgpu.SMEM((COMPUTE_WARPGROUPS, ROWS), jnp.int32), plgpu.SMEM((slots, ROWS), jnp.int32),
          per_wg(), per_slot())),
      *(() if not fused_dq or split_dq else (
          plgpu.SMEM((COMPUTE_WARPGROUPS, ROWS, ROWS), dtype, transforms=swizzled()),  # dSᵀ, read transposed
          plgpu.SMEM((COMPUTE_WARPGROUPS, ROWS, head_dim), jnp.float32))),  # dQ's part, on its way to HBM
      *(() if not split_dq else (  # both warpgroups' dSᵀ by step parity; each one's half of dQ's part
          plgpu.SMEM((2, COMPUTE_WARPGROUPS, ROWS, ROWS), dtype, transforms=swizzled()),
          plgpu.SMEM((COMPUTE_WARPGROUPS, ROWS, head_dim // 2), jnp.float32),
          plgpu.Barrier(num_arrivals=COMPUTE_WARPGROUPS, num_barriers=2),  # both dSᵀ of a parity written
          plgpu.Barrier(num_arrivals=COMPUTE_WARPGROUPS, num_barriers=1))),  # both done reading K (dQ's wgmmas)
  )


FUSED_MAX_HEAD_DIM = 64
MAX_HEAD_DIM = 128  # dK and dV's f32 accumulators outgrow a warpgroup's registers above (plan.py reads it)
WIDE_HEAD_DIMS = (256,)  # pallas_mgpu_vjp_wide's: the warpgroups share rows and split the head dim (Gemma's 256)
# SPLIT_HEAD_DIMS (pallas_mgpu's, MLA's 192/128) run too: dK [64, 192] and dV [64, 128] f32 take 160 registers a
# thread, against 128 at head dim 128 and 256 at 256. plan.py reads it from here.


LONG_ROWS = 32768  # default_block_sizes: where the measured step orders change (8k and 16k rows against 32k)


def default_block_sizes(head_dim: int, seq_len: int, dtype, *, softcap: float | None = None) -> BlockSizes:
  """The fused backward up to head dim 64, where it is faster (H200, causal 8k, D 64: 1.02 ms against 1.16 for
  the two kernels); at D 128 its 209 KB of shared memory leave one pipeline too few and it is 1.5x slower
  (benchmarks/log.md, 2026-12-01, "the fused backward"). Pass BlockSizes(fused_dq=False) for bit-identical gradients
  run to run. Above 64, the step orders that measured fastest in the whole backward (H100, 2026-12-07, causal, sink
  inputs; BENCHMARKS.md §1, "Each backward kernel's step order"), chosen from each kernel timed alone:
  - overlap_dq everywhere but with a cap at D 128 (and MLA's dims) below LONG_ROWS (alone: 1.07-1.12x without a
    cap; 0.91x at 8k, 1.06x at 32k with cap 50).
  - overlap_dkv with a cap at D 128 (whole: 1.08 / 1.23x the dQ overlap alone, 8k / 32k) and at MLA's dims below
    LONG_ROWS (whole at 16k: 1.06x; alone 1.14x at 8k, 0.85x at 32k); not at D 128 without a cap (alone 0.94-0.98x).
  - D 256: both kernels overlapped with dV issued with dK, at every length, with or without a cap (H100, 2026-12-07,
    sink inputs, whole fwd+bwd against the orders before: 1.119 / 1.070x without a cap at 8k / 32k, 1.088 / 1.134x with
    Gemma 2's cap 50 and 4096 window; BENCHMARKS.md §1, "The wide dK/dV kernel with dV issued with dK").
  - dv_with_dp (tokamax's dK/dV order) nowhere: 1.02-1.03x at D 128 alone, 0.96x in the whole backward at 32k; the wide
    dK/dV kernel alone with it 0.78 / 0.87x the same kernel with dV issued with dK (overlapped, 8k / 32k)."""
  del dtype
  if head_dim <= FUSED_MAX_HEAD_DIM:
    return BlockSizes(fused_dq=True)
  capped, long = softcap is not None, seq_len >= LONG_ROWS
  if head_dim in WIDE_HEAD_DIMS:
    return BlockSizes(overlap_dq=True, overlap_dkv=True)
  if capped:
    return BlockSizes(overlap_dq=long, overlap_dkv=True)
  split = head_dim in (d for d, _ in SPLIT_HEAD_DIMS)
  return BlockSizes(overlap_dq=True, overlap_dkv=split and not long)


def takes_head_dims(head_dim: int, value_head_dim: int) -> bool:
  """Whether this backward takes q·k head dim `head_dim` with v head dim `value_head_dim` (as the kernels run them,
  padded): equal ones up to MAX_HEAD_DIM or in WIDE_HEAD_DIMS, or a SPLIT_HEAD_DIMS pair."""
  return ((head_dim == value_head_dim and (head_dim <= MAX_HEAD_DIM or head_dim in WIDE_HEAD_DIMS))
          or (head_dim, value_head_dim) in SPLIT_HEAD_DIMS)


def backward(q, k, v, segment_ids, o, lse, do, *, causal, scale, kv_len, block_sizes: BlockSizes, window=None,
             softcap=None, interpret=False):
  """Returns (dq, dk, dv) shaped like q, k, v; sequence lengths a multiple of block_sizes.multiple.
  window: local (left, right), or None (each CTA visits its band's blocks only, all masked); softcap: c of
  c·tanh(s / c), or None (dS takes the cap's derivative). No interpret mode (plan.py never sends one here)."""
  if interpret:
    raise ValueError("pallas_mgpu_vjp.backward has no interpret mode")
  launch = Launches(q, k, v, segment_ids, o, lse, do, causal=causal, scale=scale, kv_len=kv_len,
                    block_sizes=block_sizes, window=window, softcap=softcap)
  if q.shape[-1] in WIDE_HEAD_DIMS:
    return launch.dq(), *launch.dkv()
  if block_sizes.fused_dq:
    return launch.fused()
  return launch.dq(), *launch.dkv()


class Launches:
  """The backward's kernel launches over one call's inputs, each callable alone (scripts/profile_backward.py
  times them apart): Δ = rowsum(dO ∘ O) and the kernels' arguments are made on construction, in XLA."""

  def __init__(self, q, k, v, segment_ids, o, lse, do, *, causal, scale, kv_len, block_sizes: BlockSizes,
               window=None, softcap=None):
    batch, seq, num_heads, _ = q.shape
    kv_seq, num_kv_heads = k.shape[1:3]  # kv_seq may differ from seq (cross-attention)
    if seq % block_sizes.multiple or kv_seq % block_sizes.multiple:
      raise ValueError(f"{block_sizes.multiple=} must divide the padded lengths {seq=} and {kv_seq=}")
    if not takes_head_dims(q.shape[-1], v.shape[-1]):
      raise ValueError(f"head_dim={q.shape[-1]} must be at most {MAX_HEAD_DIM} or one of {WIDE_HEAD_DIMS} for the "
                       f"Mosaic GPU backward, with v's head dim {v.shape[-1]} equal to it, or (q·k, v) one of "
                       f"{SPLIT_HEAD_DIMS}; use implementation='pallas_gpu' (the Triton kernels)")
    self.wide = q.shape[-1] in WIDE_HEAD_DIMS  # pallas_mgpu_vjp_wide's kernels: 64 rows a CTA, the head dim split
    if self.wide and block_sizes.fused_dq:
      raise ValueError(f"head_dim={q.shape[-1]} runs pallas_mgpu_vjp_wide's two kernels: use BlockSizes(fused_dq=False)")
    if block_sizes.fused_dq and q.shape[-1] != v.shape[-1]:
      raise ValueError(f"fused_dq=True needs v's head dim equal to q's; got {q.shape[-1]} and {v.shape[-1]}: use "
                       "BlockSizes(fused_dq=False)")
    if block_sizes.split_dq and q.shape[-1] != 128:
      raise ValueError(f"split_dq=True needs head_dim 128 (halves of 64 columns, one swizzle tile); got "
                       f"head_dim={q.shape[-1]}: use BlockSizes(fused_dq=True) without split_dq")
    delta = jnp.einsum("bshd,bshd->bhs", o.astype(jnp.float32), do.astype(jnp.float32))
    args = [q, k, v, do, lse, delta]
    if segment_ids is not None:  # key id 0 (padding) becomes −1, as in the forward
      args += [segment_ids.q.astype(jnp.int32), jnp.where(segment_ids.kv == 0, -1, segment_ids.kv).astype(jnp.int32)]
    doc_ranges = block_sizes.document_ranges and causal and segment_ids is not None and window is None
    self.common = dict(causal=causal, sigma2=scale * LOG2E, scale=scale, slots=block_sizes.slots,
                       group=num_heads // num_kv_heads, has_segments=segment_ids is not None, doc_ranges=doc_ranges,
                       window=None if window is None else tuple(int(w) for w in window),
                       cap2=None if softcap is None else float(softcap) * LOG2E, tanh=block_sizes.soft_cap_tanh)
    self.dq_args, self.dkv_args = args, args
    cta_rows = ROWS if self.wide else COMPUTE_WARPGROUPS * ROWS  # the wide kernels' warpgroups share their rows
    if doc_ranges:
      self.dq_args = args + [first_kv_blocks(segment_ids, cta_rows=cta_rows, block_kv=ROWS)]
      self.dkv_args = args + [_q_block_ends(segment_ids, cta_rows=cta_rows)]
    self.q, self.k, self.v, self.scale, self.kv_len, self.block_sizes = q, k, v, scale, kv_len, block_sizes
    self.dq_grid = (num_heads, seq // cta_rows, batch)
    self.dkv_grid = (num_kv_heads, kv_seq // cta_rows, batch)

  def _launch(self, kernel, out_type, grid, names, kernel_name: str):
    """One backward kernel, named for profilers (ncu and nsys show `kernel_name`, "_wide" above head dim 128)."""
    return plgpu.kernel(kernel, out_type=out_type, grid=grid, grid_names=names, num_threads=COMPUTE_WARPGROUPS + 1,
                        thread_name="wg", compiler_params=compiler_params(),
                        kernel_name=kernel_name + ("_wide" if self.wide else ""))

  def fused(self):
    """(dq, dk, dv) from the one-kernel backward (BlockSizes(fused_dq=True)): dQ reduce-added in f32."""
    q, k, v = self.q, self.k, self.v
    dq_acc = jax.new_ref(jnp.zeros(q.shape, jnp.float32))
    dk, dv = self._launch(
        functools.partial(_dkv_kernel, fused_dq=True, split_dq=self.block_sizes.split_dq,
                          overlap=self.block_sizes.overlap_dkv, **self.common),
        (out_struct(k.shape, k.dtype, k), out_struct(v.shape, v.dtype, v)), self.dkv_grid,
        ("heads", "kv_tiles", "batch"), "clis_mgpu_bwd_fused")(*self.dkv_args, dq_acc)
    return (dq_acc[...] * self.scale).astype(q.dtype), dk, dv

  def _kernels(self):
    """(dq kernel, dkv kernel, their keywords): pallas_mgpu_vjp_wide's at WIDE_HEAD_DIMS, else this module's."""
    if not self.wide:
      return _dq_kernel, _dkv_kernel, self.common
    from clis_kernels import pallas_mgpu_vjp_wide as wide
    return wide._dq_kernel, wide._dkv_kernel, self.common

  def dq(self):
    """dq from the dQ kernel (rows = queries)."""
    q = self.q
    kernel, _, common = self._kernels()
    return self._launch(functools.partial(kernel, kv_len=self.kv_len, overlap=self.block_sizes.overlap_dq, **common),
                        out_struct(q.shape, q.dtype, q), self.dq_grid, ("heads", "q_tiles", "batch"),
                        "clis_mgpu_bwd_dq")(*self.dq_args)

  def dkv(self):
    """(dk, dv) from the dK/dV kernel (rows = keys)."""
    k, v = self.k, self.v
    _, kernel, common = self._kernels()
    return self._launch(functools.partial(kernel, overlap=self.block_sizes.overlap_dkv,
                                          dv_with_dp=self.block_sizes.dv_with_dp, **common),
                        (out_struct(k.shape, k.dtype, k), out_struct(v.shape, v.dtype, v)), self.dkv_grid,
                        ("heads", "kv_tiles", "batch"), "clis_mgpu_bwd_dkv")(*self.dkv_args)


def _q_block_ends(segment_ids, *, cta_rows: int):
  """masks.causal_document_ranges's end (q blocks of ROWS) per kv tile of cta_rows keys, as range rows
  [B, kv tiles, RANGE_WIDTH]."""
  _, end = masks.causal_document_ranges(segment_ids, block_q=ROWS, block_k=cta_rows)
  return jnp.broadcast_to(end[..., None], end.shape + (RANGE_WIDTH,))
