"""The Mosaic GPU backward at head dims above 128 (Gemma's 256): each CTA's two compute warpgroups share its 64 rows
and split the head dim of what they accumulate.

At D 256 a warpgroup cannot hold dK and dV [64, 256] in f32 (256 registers a thread), and the two-kernel backward's
shared memory (pallas_mgpu_vjp.py: 64 rows per warpgroup) does not fit. As FlashAttention-3 at 256, the rows are
shared instead: the scores warpgroup (SCORES) computes S and dP over the whole head dim, then P and dS, and hands
P and dS [64, 64] bf16 to the other (HELPER) through shared memory; each accumulates one half of the columns:
  dkv: rows = 64 keys; streams Q, dO, lse and Δ blocks (every query head of the kv head's group).
       dV[:, h] += Pᵀ·dO[:, h], dK[:, h] += σ·dSᵀ·Q[:, h]
  dq:  rows = 64 queries; streams K and V blocks.          dQ[:, h] += σ·dS·K[:, h]
SCORES takes its operands from registers, HELPER from the hand-over buffer, which holds one step: SCORES writes step
j + 1's only once HELPER has taken step j's (`taken`; HELPER arrives once before its loop, so the first write does not
wait). The tensor cores run both warpgroups' matmuls, so the split costs no matmul work; what it costs is the hand-over
(16 KiB of shared memory, two barriers a step) and SCORES doing the elementwise work alone.
Masks, soft cap, local windows, packed segments and document ranges as pallas_mgpu_vjp (its helpers).
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from clis_kernels import masks
from clis_kernels.common import int32_loop
from clis_kernels.mgpu_pipeline import (COMPUTE_WARPGROUPS, finish_stores, kv_blocks, range_scratch, read_range_entry,
                                        stream_kv, swizzled)
from clis_kernels.pallas_mgpu_vjp import (ROW, ROWS, _key_rows_weights, _q_blocks, _query_rows_weights,
                                         _scores_grad, _stream_query_blocks, _walk_q_blocks, _weights_and_dp)

SCORES, HELPER = 0, 1  # the compute warpgroups' roles
HEAD_DIMS = (256,)  # the head dims these kernels take (q·k and v equal); each half is two 64-column swizzle tiles


def _hand_over(p_smem, ds_smem, p_low, ds_low, handed, taken):
  """SCORES: P and dS of this step into the hand-over buffer once HELPER has taken the last step's."""
  plgpu.barrier_wait(taken)
  if p_smem is not None:
    p_smem[...] = p_low
  ds_smem[...] = ds_low
  plgpu.commit_smem()
  plgpu.barrier_arrive(handed)


def _dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, causal, sigma2, scale, slots, group,
                has_segments, doc_ranges: bool = False, window=None, cap2=None, tanh: str = "approx",
                overlap: bool = False, dv_with_dp: bool = False):
  qseg_ref = kseg_ref = range_ref = None
  if has_segments:
    (qseg_ref, kseg_ref), refs = refs[:2], refs[2:]
  if doc_ranges:  # [B, kv tiles, RANGE_WIDTH]: one past the CTA's last q block
    (range_ref,), refs = refs[:1], refs[1:]
  dk_ref, dv_ref = refs
  dtype, head_dim, value_head_dim = k_ref.dtype, k_ref.shape[-1], v_ref.shape[-1]
  half, value_half = head_dim // 2, value_head_dim // 2
  num_q_blocks = q_ref.shape[1] // ROWS
  batch, kv_head = lax.axis_index("batch"), lax.axis_index("heads")
  kv0 = lax.axis_index("kv_tiles") * ROWS  # low tiles see the most causal query blocks: they start first
  rows = pl.ds(kv0, ROWS)
  first, first_full = _q_blocks(kv0, ROWS, causal=causal, num_q_blocks=num_q_blocks)
  end = num_q_blocks
  if window is not None:  # the band of q blocks whose rows see these keys
    first, end = masks.window_q_blocks(lax.div(kv0, jnp.int32(ROWS)), window=window, block_q=ROWS, block_k=ROWS,
                                       num_q_blocks=num_q_blocks, div=masks.idiv)

  def body(k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, p_smem, ds_smem, k_ready, v_ready, q_ready,
           do_ready, lse_ready, delta_ready, free, handed, taken, kv_read, *extra_scratch):
    wg = lax.axis_index("wg")
    seg_scratch, ranges = extra_scratch[:4 * has_segments], extra_scratch[4 * has_segments:]
    kseg_smem, qseg_smem, kseg_ready, qseg_ready = seg_scratch if has_segments else (None,) * 4
    last = end  # one past the last q block the CTA visits: its keys' documents' end with document ranges
    if doc_ranges:
      last = read_range_entry(range_ref.at[batch, lax.axis_index("kv_tiles")], *ranges)
    per_head = jnp.asarray(last - first, jnp.int32)  # q blocks streamed per head of the group
    slot_of = lambda g, j: lax.rem(g * per_head + j - first, jnp.int32(slots))

    def wait_block(slot, *, scores: bool):
      barriers = (q_ready, do_ready) + ((lse_ready, delta_ready) + ((qseg_ready,) if has_segments else ())
                                        if scores else ())
      for barrier in barriers:
        plgpu.barrier_wait(barrier.at[slot])

    def loop(step, carry):
      """step(j, carry, g, masked) over every q block of every head of the group, masked where it must be."""
      return int32_loop(0, group, lambda g, carry: _walk_q_blocks(
          step, carry, g, kv0=kv0, first=first, first_full=first_full, end=last, causal=causal, window=window,
          num_q_blocks=num_q_blocks), carry)

    zeros = lambda width: plgpu.layout_cast(jnp.zeros((ROWS, width), jnp.float32), plgpu.Layout.WGMMA)

    def write_out(dk, dv, h):
      """This warpgroup's half h of dK and dV, through K's and V's half h (TMA stores contiguous tiles only)."""
      k_smem.at[h][...] = (dk * scale).astype(dtype)
      v_smem.at[h][...] = dv.astype(dtype)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(k_smem.at[h], dk_ref.at[batch, rows, kv_head, pl.ds(h * half, half)])
      plgpu.copy_smem_to_gmem(v_smem.at[h], dv_ref.at[batch, rows, kv_head, pl.ds(h * value_half, value_half)])
      finish_stores()

    @pl.when(wg == SCORES)
    def _scores():
      plgpu.set_max_registers(232, action="increase")
      for h in range(2):  # K and V by halves of the head dim, which dK and dV later take over
        plgpu.copy_gmem_to_smem(k_ref.at[batch, rows, kv_head, pl.ds(h * half, half)], k_smem.at[h], k_ready.at[h])
        plgpu.copy_gmem_to_smem(v_ref.at[batch, rows, kv_head, pl.ds(h * value_half, value_half)], v_smem.at[h],
                                v_ready.at[h])
      k_ids = None
      if has_segments:
        plgpu.copy_gmem_to_smem(kseg_ref.at[batch, rows], kseg_smem, kseg_ready.at[0])
        plgpu.barrier_wait(kseg_ready.at[0])
        k_ids = plgpu.load(kseg_smem, layout=ROW)
      for h in range(2):
        plgpu.barrier_wait(k_ready.at[h])
        plgpu.barrier_wait(v_ready.at[h])
      columns, value_columns = pl.ds(0, half), pl.ds(0, value_half)

      key_weights = functools.partial(  # the step's weights, less its slot, block and mask
          _key_rows_weights, kv0=kv0, k_ids=k_ids, qseg_smem=qseg_smem, lse_smem=lse_smem, delta_smem=delta_smem,
          sigma2=sigma2, cap2=cap2, tanh=tanh, causal=causal, window=window)

      def step(j, carry, g, masked: bool):
        dk, dv = carry
        slot = slot_of(g, j)
        wait_block(slot, scores=True)

        def issue_s(acc_ref):  # Sᵀ: keys × queries, over both halves of the head dim
          for h in range(2):
            plgpu.wgmma(acc_ref, k_smem.at[h], q_smem.at[slot, :, pl.ds(h * half, half)].T)
          return 2

        weights = functools.partial(key_weights, slot=slot, q_block=j, masked=masked)

        def issue_dp(acc_ref):  # dPᵀ = V·dOᵀ
          for h in range(2):
            plgpu.wgmma(acc_ref, v_smem.at[h], do_smem.at[slot, :, pl.ds(h * value_half, value_half)].T)
          return 2

        if overlap or dv_with_dp:  # S and dP issued together, or dV's half behind dP (BlockSizes.dv_with_dp)
          def ordered(refs):
            dk_ref_, dv_ref_ = refs

            def weights_low(s):  # P rounded once, for dV's wgmma and the hand-over
              p, dtanh, delta = weights(s)
              return p, p.astype(dtype), dtanh, delta

            def issue_dv(w):
              plgpu.wgmma(dv_ref_, w[1], do_smem.at[slot, :, value_columns])
              return 1

            (p, p_low, dtanh, delta), dp = _weights_and_dp(issue_s, issue_dp, weights_low, overlap=overlap,
                                                           after_weights=issue_dv if dv_with_dp else None)
            ds_low = _scores_grad(p, dtanh, delta, dp).astype(dtype)
            _hand_over(p_smem, ds_smem, p_low, ds_low, handed, taken)
            if not dv_with_dp:
              issue_dv((p, p_low))
            plgpu.wgmma(dk_ref_, ds_low, q_smem.at[slot, :, columns])

          dk, dv = pl.run_state(ordered)((plgpu.ACC.init(dk), plgpu.ACC.init(dv)))
          plgpu.barrier_arrive(free.at[slot])
          return dk, dv
        (p, dtanh, delta), dp = _weights_and_dp(issue_s, issue_dp, weights, overlap=False)
        ds = _scores_grad(p, dtanh, delta, dp)
        p_low, ds_low = p.astype(dtype), ds.astype(dtype)
        _hand_over(p_smem, ds_smem, p_low, ds_low, handed, taken)

        def update(refs):
          dk_ref_, dv_ref_ = refs
          plgpu.wgmma(dv_ref_, p_low, do_smem.at[slot, :, value_columns])
          plgpu.wgmma(dk_ref_, ds_low, q_smem.at[slot, :, columns])

        dk, dv = pl.run_state(update)((plgpu.ACC.init(dk), plgpu.ACC.init(dv)))
        plgpu.barrier_arrive(free.at[slot])
        return dk, dv

      dk, dv = loop(step, (zeros(half), zeros(value_half)))
      plgpu.barrier_arrive(kv_read)  # K and V are read for the last time: HELPER may write its halves over them
      write_out(dk, dv, 0)

    @pl.when(wg == HELPER)
    def _helper():
      plgpu.set_max_registers(232, action="increase")
      plgpu.barrier_arrive(taken)  # the buffer is free for SCORES's first step
      columns, value_columns = pl.ds(half, half), pl.ds(value_half, value_half)

      def step(j, carry, g, masked: bool):
        del masked  # SCORES masked P and dS
        dk, dv = carry
        slot = slot_of(g, j)
        wait_block(slot, scores=False)
        plgpu.barrier_wait(handed)

        def update(refs):
          dk_ref_, dv_ref_ = refs
          plgpu.wgmma(dv_ref_, p_smem, do_smem.at[slot, :, value_columns])
          plgpu.wgmma(dk_ref_, ds_smem, q_smem.at[slot, :, columns])

        dk, dv = pl.run_state(update)((plgpu.ACC.init(dk), plgpu.ACC.init(dv)))
        plgpu.barrier_arrive(taken)
        plgpu.barrier_arrive(free.at[slot])
        return dk, dv

      dk, dv = loop(step, (zeros(half), zeros(value_half)))
      plgpu.barrier_wait(kv_read)
      write_out(dk, dv, 1)

    @pl.when(wg == COMPUTE_WARPGROUPS)
    def _memory():
      plgpu.set_max_registers(40, action="decrease")
      by_rows, by_head = (lambda h, r: (batch, r, h)), (lambda h, r: (batch, h, r))
      streams = [(q_ref, q_smem, q_ready, by_rows), (do_ref, do_smem, do_ready, by_rows),
                 (lse_ref, lse_smem, lse_ready, by_head), (delta_ref, delta_smem, delta_ready, by_head)]
      if has_segments:
        streams.append((qseg_ref, qseg_smem, qseg_ready, lambda h, r: (batch, r)))
      _stream_query_blocks(streams, kv_head=kv_head, group=group, per_head=per_head, cta_first=first, slots=slots,
                           free=free)

  one = lambda: plgpu.Barrier(num_barriers=1)
  per_slot = lambda: plgpu.Barrier(num_barriers=slots)
  pl.run_scoped(
      body,
      plgpu.SMEM((2, ROWS, half), dtype, transforms=swizzled()),  # k by halves of the head dim, then dk
      plgpu.SMEM((2, ROWS, value_half), dtype, transforms=swizzled()),  # v, then dv
      plgpu.SMEM((slots, ROWS, head_dim), dtype, transforms=swizzled()),  # q blocks
      plgpu.SMEM((slots, ROWS, value_head_dim), dtype, transforms=swizzled()),  # dO blocks
      plgpu.SMEM((slots, ROWS), jnp.float32),  # lse blocks
      plgpu.SMEM((slots, ROWS), jnp.float32),  # Δ blocks
      plgpu.SMEM((ROWS, ROWS), dtype, transforms=swizzled()),  # Pᵀ handed over
      plgpu.SMEM((ROWS, ROWS), dtype, transforms=swizzled()),  # dSᵀ handed over
      plgpu.Barrier(num_barriers=2), plgpu.Barrier(num_barriers=2),  # k, v ready (by halves)
      per_slot(), per_slot(), per_slot(), per_slot(),  # q, dO, lse, Δ ready
      plgpu.Barrier(num_arrivals=COMPUTE_WARPGROUPS, num_barriers=slots),  # slot free
      plgpu.Barrier(), plgpu.Barrier(), plgpu.Barrier(),  # handed, taken, kv_read
      *(() if not has_segments else (
          plgpu.SMEM((ROWS,), jnp.int32), plgpu.SMEM((slots, ROWS), jnp.int32), one(), per_slot())),
      *(range_scratch() if doc_ranges else ()),
      collective_axes="wg",
  )


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, causal, sigma2, scale, slots, kv_len,
               group, has_segments, doc_ranges: bool = False, window=None, cap2=None, tanh: str = "approx",
               overlap: bool = False):
  qseg_ref = kseg_ref = range_ref = None
  if has_segments:
    (qseg_ref, kseg_ref), refs = refs[:2], refs[2:]
  if doc_ranges:  # [B, q tiles, RANGE_WIDTH]: the CTA's first KV block
    (range_ref,), refs = refs[:1], refs[1:]
  (dq_ref,) = refs
  dtype, head_dim = q_ref.dtype, q_ref.shape[-1]
  half = head_dim // 2
  batch, head = lax.axis_index("batch"), lax.axis_index("heads")
  num_tiles = q_ref.shape[1] // ROWS
  tile = num_tiles - 1 - lax.axis_index("q_tiles") if causal else lax.axis_index("q_tiles")  # longest rows first
  row0 = tile * ROWS
  rows = pl.ds(row0, ROWS)
  kv_head = lax.div(head, jnp.int32(group))
  num_kv_blocks = k_ref.shape[1] // ROWS
  full, total = kv_blocks(row0, ROWS, causal=causal, block_kv=ROWS, num_kv_blocks=num_kv_blocks, kv_len=kv_len)
  band = None
  if window is not None:  # the band of KV blocks, masked at its edges
    band = masks.window_kv_blocks(tile, window=window, block_q=ROWS, block_k=ROWS, num_kv_blocks=num_kv_blocks,
                                  div=masks.idiv)

  def body(q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, ds_smem, q_ready, do_ready, lse_ready, delta_ready,
           k_ready, v_ready, free, handed, taken, q_read, *extra_scratch):
    wg = lax.axis_index("wg")
    seg_scratch, ranges = extra_scratch[:4 * has_segments], extra_scratch[4 * has_segments:]
    qseg_smem, kseg_smem, qseg_ready, kseg_ready = seg_scratch if has_segments else (None,) * 4
    first, lead, full_, total_ = 0, 0, full, total  # steps [first, lead) and [full_, total_) masked
    if doc_ranges:  # the rows' documents' first KV block: the stream and the unmasked steps start there
      first = lead = read_range_entry(range_ref.at[batch, tile], *ranges)
    if band is not None:
      first, total_ = band
      whole = masks.window_full_blocks(row0, rows=ROWS, window=window, block=ROWS, kv_len=kv_len, div=masks.idiv)
      lead, full_ = masks.masked_edges(first, total_, whole)
    blocks = jnp.asarray(total_ - first, jnp.int32)
    slot_of = lambda i: lax.rem(i - first, jnp.int32(slots))

    def loop(step, carry):
      if window is not None:
        carry = int32_loop(first, lead, functools.partial(step, masked=True), carry)
      carry = int32_loop(lead, full_, functools.partial(step, masked=False), carry)
      if causal or kv_len is not None or window is not None:
        carry = int32_loop(full_, total_, functools.partial(step, masked=True), carry)
      return carry

    def write_out(dq, h):
      """This warpgroup's half h of dQ, through Q's half h."""
      q_smem.at[h][...] = (dq * scale).astype(dtype)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(q_smem.at[h], dq_ref.at[batch, rows, head, pl.ds(h * half, half)])
      finish_stores()

    zeros = plgpu.layout_cast(jnp.zeros((ROWS, half), jnp.float32), plgpu.Layout.WGMMA)

    @pl.when(wg == SCORES)
    def _scores():
      plgpu.set_max_registers(232, action="increase")
      for h in range(2):  # Q by halves of the head dim, which dQ later takes over
        plgpu.copy_gmem_to_smem(q_ref.at[batch, rows, head, pl.ds(h * half, half)], q_smem.at[h], q_ready.at[h])
      plgpu.copy_gmem_to_smem(do_ref.at[batch, rows, head], do_smem, do_ready.at[0])
      plgpu.copy_gmem_to_smem(lse_ref.at[batch, head, rows], lse_smem, lse_ready.at[0])
      plgpu.copy_gmem_to_smem(delta_ref.at[batch, head, rows], delta_smem, delta_ready.at[0])
      q_ids = None
      if has_segments:
        plgpu.copy_gmem_to_smem(qseg_ref.at[batch, rows], qseg_smem, qseg_ready.at[0])
        plgpu.barrier_wait(qseg_ready.at[0])
        q_ids = plgpu.load(qseg_smem, layout=ROW)
      for barrier in (q_ready.at[0], q_ready.at[1], do_ready.at[0], lse_ready.at[0], delta_ready.at[0]):
        plgpu.barrier_wait(barrier)
      rows_of = lambda x: lax.broadcast_in_dim(x, (ROWS, ROWS), [0])
      lse, delta = rows_of(plgpu.load(lse_smem, layout=ROW)), rows_of(plgpu.load(delta_smem, layout=ROW))
      columns = pl.ds(0, half)

      row_weights = functools.partial(  # the step's weights, less its slot, block and mask
          _query_rows_weights, row0=row0, q_ids=q_ids, kseg_smem=kseg_smem, kseg_ready=kseg_ready, lse=lse,
          sigma2=sigma2, cap2=cap2, tanh=tanh, causal=causal, kv_len=kv_len, window=window)

      def step(i, dq, masked: bool):
        slot = slot_of(i)
        plgpu.barrier_wait(k_ready.at[slot])

        def issue_s(acc_ref):  # over both halves of the head dim
          for h in range(2):
            plgpu.wgmma(acc_ref, q_smem.at[h], k_smem.at[slot, :, pl.ds(h * half, half)].T)
          return 2

        weights = functools.partial(row_weights, slot=slot, kv_block=i, masked=masked)

        def issue_dp(acc_ref):
          plgpu.wgmma(acc_ref, do_smem, v_smem.at[slot].T)
          return 1

        (p, dtanh), dp = _weights_and_dp(issue_s, issue_dp, weights, overlap=overlap,
                                         wait_dp=lambda: plgpu.barrier_wait(v_ready.at[slot]))
        ds_low = _scores_grad(p, dtanh, delta, dp).astype(dtype)
        _hand_over(None, ds_smem, None, ds_low, handed, taken)

        def update(acc_ref):
          plgpu.wgmma(acc_ref, ds_low, k_smem.at[slot, :, columns])

        dq = pl.run_state(update)(plgpu.ACC.init(dq))
        plgpu.barrier_arrive(free.at[slot])
        return dq

      dq = loop(step, zeros)
      plgpu.barrier_arrive(q_read)  # Q is read for the last time: HELPER may write its half over it
      write_out(dq, 0)

    @pl.when(wg == HELPER)
    def _helper():
      plgpu.set_max_registers(232, action="increase")
      plgpu.barrier_arrive(taken)
      columns = pl.ds(half, half)

      def step(i, dq, masked: bool):
        del masked
        slot = slot_of(i)
        plgpu.barrier_wait(k_ready.at[slot])
        plgpu.barrier_wait(handed)

        def update(acc_ref):
          plgpu.wgmma(acc_ref, ds_smem, k_smem.at[slot, :, columns])

        dq = pl.run_state(update)(plgpu.ACC.init(dq))
        plgpu.barrier_arrive(taken)
        plgpu.barrier_arrive(free.at[slot])
        return dq

      dq = loop(step, zeros)
      plgpu.barrier_wait(q_read)
      write_out(dq, 1)

    @pl.when(wg == COMPUTE_WARPGROUPS)
    def _memory():
      plgpu.set_max_registers(40, action="decrease")
      stream_kv(k_ref, v_ref, kseg_ref, k_smem, v_smem, kseg_smem, k_ready, v_ready, kseg_ready, batch=batch,
                kv_head=kv_head, block_kv=ROWS, num_blocks=blocks, slots=slots, free=(free,),
                block_of=lambda i: first + i)

  one = lambda: plgpu.Barrier(num_barriers=1)
  per_slot = lambda: plgpu.Barrier(num_barriers=slots)
  pl.run_scoped(
      body,
      plgpu.SMEM((2, ROWS, half), dtype, transforms=swizzled()),  # q by halves of the head dim, then dq
      plgpu.SMEM((ROWS, v_ref.shape[-1]), dtype, transforms=swizzled()),  # dO
      plgpu.SMEM((slots, ROWS, head_dim), dtype, transforms=swizzled()),  # k blocks
      plgpu.SMEM((slots, ROWS, v_ref.shape[-1]), dtype, transforms=swizzled()),  # v blocks
      plgpu.SMEM((ROWS,), jnp.float32),  # lse
      plgpu.SMEM((ROWS,), jnp.float32),  # Δ
      plgpu.SMEM((ROWS, ROWS), dtype, transforms=swizzled()),  # dS handed over
      plgpu.Barrier(num_barriers=2), one(), one(), one(),  # q (by halves), dO, lse, Δ ready
      per_slot(), per_slot(),  # k, v ready
      plgpu.Barrier(num_arrivals=COMPUTE_WARPGROUPS, num_barriers=slots),  # slot free
      plgpu.Barrier(), plgpu.Barrier(), plgpu.Barrier(),  # handed, taken, q_read
      *(() if not has_segments else (
          plgpu.SMEM((ROWS,), jnp.int32), plgpu.SMEM((slots, ROWS), jnp.int32), one(), per_slot())),
      *(range_scratch() if doc_ranges else ()),
      collective_axes="wg",
  )
