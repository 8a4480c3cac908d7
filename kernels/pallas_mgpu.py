"""CLiS attention forward as a Pallas Mosaic GPU kernel (Hopper: wgmma, TMA, warp specialisation).

One CTA per (q head, q tile, batch) runs three warpgroups: two compute warpgroups, each owning
block_q query rows, and one memory warpgroup that streams K and V blocks into `slots` shared-
memory buffers with TMA. The two compute warpgroups take turns on the tensor cores (a shared
"schedule" barrier): while one runs its Q·Kᵀ or P·V wgmma, the other does its softmax.

Each compute warpgroup certifies its block_q rows in its prologue from the q tile it has loaded
and the K/V pre-pass (stabilizer.key_bounds → row_bounds → stabilize; no pass over q outside the
kernel; bidirectional packed rows against their segment's centre), or reads the XLA certificate
(granularity="head"), and runs one of two loops over the KV blocks:
  certified: p = 2^(σ₂·q·kᵀ − M) with the row's fixed M; no row max, no rescale of acc and l.
             l sums the weights before they are rounded for P·V, as the online path does: the
             exact sum of the rounded weights (stabilizer.py, "Normalisation"; the Triton kernel's
             choice) made this kernel 1.34-1.43x slower on the vector units and 1.01-1.32x on the
             tensor cores (H200, notes/kernels.md round 3); the GPU tests bound its error by 1.25x
             online's.
  otherwise: the online softmax (running max, rescale), also the whole of stabilizer="online".
Under the causal mask the loop splits into blocks wholly below the diagonal (no mask) and the
few that straddle it; causal q tiles run last-first so the longest start early.
Layout: q [B, S, Hq, D], k/v [B, S, Hkv, D] (the API's); lse [B, Hq, S] f32 base 2, as both
backwards expect (pallas_mgpu_vjp, the default, and pallas_gpu_vjp's Triton one).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from clis_kernels import pallas_gpu, pallas_gpu_vjp, pallas_mgpu_vjp
from clis_kernels.mgpu_pipeline import COMPUTE_WARPGROUPS, cta_first_row, kv_blocks, stream_kv, swizzled
from clis_kernels.common import out_struct
from clis_kernels.stabilizer import EMPTY_LSE, LOG2E, Certificate, KeyBounds, row_bounds, stabilize

HEAD_DIMS = (64, 128)
DTYPES = (jnp.bfloat16, jnp.float16)
FAILED_TILE_M = 1e30  # M sent for rows of a tile the XLA certificate failed (real M are far smaller)
ONLINE_FLOOR = -1e20  # the online loop's starting max (base 2): below any real logit


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tiles of the Mosaic GPU forward and of its backward (Mosaic GPU by default, or pallas_gpu's Triton one).

  block_q: rows per compute warpgroup (a CTA holds 2·block_q rows); also the certificate tile.
  block_kv: keys per pipeline step; slots: K/V blocks in flight (shared-memory buffers).
  backward: pallas_gpu.BlockSizes (the Triton backward) or pallas_mgpu_vjp.BlockSizes (Mosaic GPU).
  pingpong: the two compute warpgroups take turns on the tensor cores (FA3's schedule); False lets
  both issue wgmma as soon as their operands are ready.
  overlap: the certified loop issues block i+1's Q·Kᵀ before block i's softmax (needs pingpong=False).
  """

  block_q: int = 64
  block_kv: int = 128
  slots: int = 2
  backward: pallas_gpu.BlockSizes | pallas_mgpu_vjp.BlockSizes = pallas_mgpu_vjp.BlockSizes()
  pingpong: bool = True
  overlap: bool = False

  def __post_init__(self):
    if self.overlap and self.pingpong:
      raise ValueError("overlap=True needs pingpong=False (each warpgroup overlaps its own steps instead)")
    if self.block_q != 64:
      raise ValueError(f"{self.block_q=} must be 64 (one wgmma M tile per compute warpgroup)")
    if self.block_kv not in (64, 128):
      raise ValueError(f"{self.block_kv=} must be 64 or 128 (larger K/V blocks overflow shared memory at D=128)")
    if self.slots < 2:
      raise ValueError(f"{self.slots=} must be at least 2 (one block computing while the next loads)")
    if not isinstance(self.backward, (pallas_gpu.BlockSizes, pallas_mgpu_vjp.BlockSizes)):
      raise ValueError("backward must be a pallas_gpu.BlockSizes (Triton) or a pallas_mgpu_vjp.BlockSizes "
                       f"(Mosaic GPU); got {type(self.backward).__name__}")

  @property
  def tile(self) -> int:
    return self.block_q

  @property
  def multiple(self) -> int:
    return max(COMPUTE_WARPGROUPS * self.block_q, self.block_kv, self.backward.multiple)


def default_block_sizes(head_dim: int, seq_len: int, dtype) -> BlockSizes:
  """One shape for both supported head dims, with the Mosaic GPU backward (H200 sweeps in
  notes/kernels.md: block_kv 128, 2 slots, ping-pong on were fastest for both loops; the Mosaic
  backward took causal 8k fwd+bwd from 5.62 to 4.24 ms)."""
  del head_dim, seq_len, dtype
  return BlockSizes()


def padded_head_dim(head_dim: int) -> int:
  """The head dim the kernels run at: the API pads q, k, v with zero columns up to it (zeros change no
  logit, and the output's extra columns are cut off), as FlashAttention does for 80 or 96."""
  return next((d for d in HEAD_DIMS if d >= head_dim), head_dim)


def supports(dtype, head_dim: int) -> bool:
  """Whether these kernels take inputs of this dtype and (unpadded) head dim (the API's default asks)."""
  return dtype in DTYPES and padded_head_dim(head_dim) in HEAD_DIMS


def _check(q, k, cert, scale, interpret):
  if interpret:
    raise ValueError("implementation='pallas_mgpu' has no interpret mode; use implementation='pallas_gpu' "
                     "with interpret=True to run the GPU kernels on a CPU")
  if q.dtype not in DTYPES:
    raise ValueError(f"implementation='pallas_mgpu' needs bfloat16 or float16 inputs; got {q.dtype=} "
                     "(use implementation='pallas_gpu' for float32)")
  if q.shape[-1] not in HEAD_DIMS:
    raise ValueError(f"head_dim={q.shape[-1]} must be at most {HEAD_DIMS[-1]} for implementation='pallas_mgpu' "
                     f"(smaller ones are padded to one of {HEAD_DIMS}); use implementation='pallas_gpu'")
  if not scale > 0:
    raise ValueError(f"{scale=} must be positive for implementation='pallas_mgpu'")
  if cert is not None and cert.certified.shape[-1] * 64 != q.shape[1]:
    raise ValueError(f"the certificate's tile must be block_q=64 rows; got {cert.certified.shape=} for {q.shape=}")


def _kernel(q_ref, k_ref, v_ref, *refs, mode: str, causal: bool, sigma2: float, block_q: int, block_kv: int,
            slots: int, kv_len: int | None, group: int, has_segments: bool, row_centres: bool, pingpong: bool,
            overlap: bool):
  m_ref = centre_ref = bounds_ref = flags_ref = qseg_ref = kseg_ref = None
  if has_segments:
    (qseg_ref, kseg_ref), refs = refs[:2], refs[2:]
  if mode == "cert":
    m_ref, o_ref, lse_ref = refs
  elif mode == "keys":
    centre_ref, bounds_ref, o_ref, lse_ref, flags_ref = refs
  else:
    o_ref, lse_ref = refs
  dtype, head_dim = q_ref.dtype, q_ref.shape[-1]
  batch, head = lax.axis_index("batch"), lax.axis_index("heads")
  cta_row0 = cta_first_row(q_ref.shape[1], block_q, causal=causal)
  kv_range = functools.partial(kv_blocks, causal=causal, block_kv=block_kv, num_kv_blocks=k_ref.shape[1] // block_kv,
                               kv_len=kv_len)
  _, cta_blocks = kv_range(cta_row0, COMPUTE_WARPGROUPS * block_q)  # what the memory warpgroup loads

  def body(qo_smem, k_smem, v_smem, row_smem, k_ready, v_ready, q_ready, m_ready, k_free, v_free, schedule,
           *extra_scratch):
    wg = lax.axis_index("wg")
    keys_scratch = extra_scratch[:7] if mode == "keys" else ()
    qseg_smem, kseg_smem, qseg_ready, kseg_ready = extra_scratch[-4:] if has_segments else (None,) * 4
    kv_head = lax.div(head, jnp.int32(group))

    def take_turn():  # hand the tensor cores to the other compute warpgroup and wait for them back
      plgpu.barrier_arrive(schedule)
      plgpu.barrier_wait(schedule)

    def turn():  # take_turn inside the KV loop, when the warpgroups ping-pong
      if pingpong:
        take_turn()

    @pl.when(wg < COMPUTE_WARPGROUPS)
    def _compute():
      plgpu.set_max_registers(232, action="increase")
      q_smem, rows = qo_smem.at[wg], row_smem.at[wg]
      row0 = cta_row0 + wg * block_q
      full, total = kv_range(row0, block_q)
      plgpu.copy_gmem_to_smem(q_ref.at[batch, pl.ds(row0, block_q), head], q_smem, q_ready.at[wg])
      if mode == "cert":
        plgpu.copy_gmem_to_smem(m_ref.at[batch, head, pl.ds(row0, block_q)], rows, m_ready.at[wg])
      if mode == "keys":
        centre_smem, kdiag_smem, flag_smem, bounds_smem, kdiag_ready, bounds_ready, centre_ready = keys_scratch
        if not row_centres:  # one centre per (batch, kv head); rows with their own load them in bound_rows
          plgpu.copy_gmem_to_smem(centre_ref.at[batch, 0, kv_head], centre_smem.at[wg], centre_ready.at[wg])
        plgpu.copy_gmem_to_smem(bounds_ref.at[batch, kv_head, :, pl.ds(row0, block_q)], bounds_smem.at[wg],
                                bounds_ready.at[wg])
        if causal:  # each row's own key: the lower bound L = t_ii
          plgpu.copy_gmem_to_smem(k_ref.at[batch, pl.ds(row0, block_q), kv_head], kdiag_smem.at[wg],
                                  kdiag_ready.at[wg])
      if has_segments:
        plgpu.copy_gmem_to_smem(qseg_ref.at[batch, pl.ds(row0, block_q)], qseg_smem.at[wg], qseg_ready.at[wg])
      plgpu.barrier_wait(q_ready.at[wg])
      q_ids = None
      if has_segments:
        plgpu.barrier_wait(qseg_ready.at[wg])
        q_ids = plgpu.load(qseg_smem.at[wg], layout=plgpu.Layout.WGMMA.reduce(1))

      def bound_rows():
        """(M, passes) per row of this warpgroup from the K/V pre-pass (stabilizer.row_bounds and
        stabilize, as the Triton kernel's prologue). Radius, headroom, threshold and the centre's
        rounding slack arrive per row through TMA, as M does in "cert" mode. Packed rows each have
        their segment's centre when bidirectional (row_centres), rounded to q's dtype: one [block_q, D]
        buffer serves both warpgroups, so those warpgroups run this one after the other."""
        plgpu.barrier_wait(bounds_ready.at[wg])
        q = plgpu.load(q_smem, layout=plgpu.Layout.WGMMA).astype(jnp.float32)
        if row_centres:
          plgpu.copy_gmem_to_smem(centre_ref.at[batch, pl.ds(row0, block_q), kv_head], centre_smem,
                                  centre_ready.at[wg])
          plgpu.barrier_wait(centre_ready.at[wg])
          centre = plgpu.load(centre_smem, layout=plgpu.Layout.WGMMA).astype(jnp.float32)
        else:
          plgpu.barrier_wait(centre_ready.at[wg])
          centre = lax.broadcast_in_dim(plgpu.load(centre_smem.at[wg], layout=plgpu.Layout.WGMMA.reduce(0)),
                                        q.shape, [1])
        radius, headroom, threshold, slack = (
            plgpu.load(bounds_smem.at[wg, j], layout=plgpu.Layout.WGMMA.reduce(1)) for j in range(4))
        k_diag = None
        if causal:
          plgpu.barrier_wait(kdiag_ready.at[wg])
          k_diag = plgpu.load(kdiag_smem.at[wg], layout=plgpu.Layout.WGMMA).astype(jnp.float32)
        upper, lower = row_bounds(q, centre, radius, k_diag, sigma2=sigma2)  # radius includes the slack
        if k_diag is None:  # L = σ₂·q·c with the rounded centre c' can exceed σ₂·q·c by σ₂·‖q‖·‖c − c'‖
          lower = lower - sigma2 * jnp.sqrt(jnp.sum(q * q, axis=1)) * slack
        m, row_ok = stabilize(upper, lower, headroom, threshold)  # rows the API padded are zero: they pass
        row_ok = row_ok.astype(jnp.int32)
        if has_segments:  # packed padding rows (id 0) see no key: they pass, as in stabilize()
          row_ok = jnp.maximum(row_ok, (q_ids == 0).astype(jnp.int32))
        return m, row_ok

      def decide(row_ok):
        """The tile passes when every row does (a warpgroup-wide min); the flag goes out per row."""
        certified = jnp.min(row_ok)
        flag_smem.at[wg][...] = plgpu.layout_cast(jnp.full((block_q,), certified.astype(jnp.float32)),
                                                  plgpu.Layout.WGMMA.reduce(1))
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(flag_smem.at[wg], flags_ref.at[batch, head, pl.ds(row0, block_q)])
        return certified > 0

      def certify_here():
        """(M, certified): the rows' bounds in both warpgroups at once, then the two decisions in
        turn (only the min shares scratch); rows' own centres share one buffer, so in turn too."""
        if row_centres:
          return one_warpgroup_at_a_time(lambda: (lambda m, row_ok: (m, decide(row_ok)))(*bound_rows()))
        m, row_ok = bound_rows()
        return m, one_warpgroup_at_a_time(lambda: decide(row_ok))

      def attend(fixed: bool, m_fixed=None):
        if fixed:  # M is loop-invariant: the loop closes over it and carries (acc, l)
          m0 = m_fixed
        else:
          # A finite floor, not −inf: a block whose keys are all masked then leaves m at the floor
          # and adds weight 2^(−inf − floor) = 0; no step forms −inf − (−inf).
          m0 = plgpu.layout_cast(jnp.full((block_q,), ONLINE_FLOOR, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
        l0 = plgpu.layout_cast(jnp.zeros((block_q,), jnp.float32), plgpu.Layout.WGMMA.reduce(1))
        carry = (plgpu.layout_cast(jnp.zeros((block_q, head_dim), jnp.float32), plgpu.Layout.WGMMA),
                 *(() if fixed else (m0,)), l0)
        plgpu.barrier_wait(k_ready.at[0])
        pl.when(wg == 1)(turn)  # warpgroup 1 starts half a step behind warpgroup 0

        def visible(qk, i, slot, masked: bool):
          """Block i's logits with −inf where a key is hidden; releases the block's K (read now)."""
          if has_segments:  # every step: a query sees keys of its own segment (padding keys are −1)
            plgpu.barrier_wait(kseg_ready.at[slot])
            k_ids = plgpu.load(kseg_smem.at[slot], layout=plgpu.Layout.WGMMA.reduce(0))
            same = lax.broadcast_in_dim(q_ids, qk.shape, [0]) == lax.broadcast_in_dim(k_ids, qk.shape, [1])
            # −inf is safe: the online loop's max starts at ONLINE_FLOOR, so a block wholly of other
            # segments adds 2^(−inf − floor) = 0; rows that never see a key are padding (zeroed below).
            qk = jnp.where(same, qk, -jnp.inf)
          plgpu.barrier_arrive(k_free.at[slot])  # k and its segment ids are read
          if masked:
            q_pos = row0 + plgpu.broadcasted_iota(jnp.int32, qk.shape, 0, layout=plgpu.Layout.WGMMA)
            k_pos = i * block_kv + plgpu.broadcasted_iota(jnp.int32, qk.shape, 1, layout=plgpu.Layout.WGMMA)
            qk = jnp.where(q_pos >= k_pos if causal else k_pos < kv_len, qk, -jnp.inf)
          return qk

        def step(i, carry, masked: bool):
          acc, m, l = (carry[0], m0, carry[1]) if fixed else carry
          slot = lax.rem(i, jnp.int32(slots))

          def qk_scope(acc_ref):
            plgpu.wgmma(acc_ref, q_smem, k_smem.at[slot].T)
            turn()
            return acc_ref[...]

          qk = visible(pl.run_scoped(qk_scope, plgpu.ACC((block_q, block_kv), jnp.float32)), i, slot, masked)
          if fixed:  # the certified step: one FMA and one exp2 per weight, no max, no rescale
            p = jnp.exp2(qk * sigma2 - lax.broadcast_in_dim(m, qk.shape, [0]))
            l = l + p.sum(axis=1)  # the unrounded weights: see the module docstring
            p_low = p.astype(dtype)
          else:
            m_new = jnp.maximum(m, qk.max(axis=1) * sigma2)
            alpha = jnp.exp2(m - m_new)
            p = jnp.exp2(qk * sigma2 - lax.broadcast_in_dim(m_new, qk.shape, [0]))
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
            l = l * alpha + p.sum(axis=1)
            m, p_low = m_new, p.astype(dtype)
          if fixed:
            acc, l, p_low = lax.optimization_barrier((acc, l, p_low))
          else:
            acc, m, l, p_low = lax.optimization_barrier((acc, m, l, p_low))
          if pingpong:
            plgpu.barrier_arrive(schedule)  # softmax done
          plgpu.barrier_wait(v_ready.at[slot])
          if pingpong:
            plgpu.barrier_wait(schedule)  # tensor cores free again

          def pv(acc_ref):
            plgpu.wgmma(acc_ref, p_low, v_smem.at[slot])

            @pl.when(i + 1 < total)
            def _():
              plgpu.barrier_wait(k_ready.at[lax.rem(i + 1, jnp.int32(slots))])

          acc = pl.run_state(pv)(plgpu.ACC.init(acc))
          plgpu.barrier_arrive(v_free.at[slot])
          return (acc, l) if fixed else (acc, m, l)

        def overlapped_step(i, carry, masked: bool):
          """The certified step with block i+1's Q·Kᵀ issued before block i's exp2 (p_i depends on
          nothing of step i−1, so the tensor cores work while this warpgroup exponentiates)."""
          acc, l, qk = carry  # qk: block i's logits, already computed
          slot, nxt = lax.rem(i, jnp.int32(slots)), lax.rem(i + 1, jnp.int32(slots))
          qk = visible(qk, i, slot, masked)

          def scope(next_ref):
            @pl.when(i + 1 < total)
            def _():
              plgpu.barrier_wait(k_ready.at[nxt])
              plgpu.wgmma(next_ref, q_smem, k_smem.at[nxt].T)

            p = jnp.exp2(qk * sigma2 - lax.broadcast_in_dim(m0, qk.shape, [0]))
            new_l, p_low = l + p.sum(axis=1), p.astype(dtype)
            plgpu.barrier_wait(v_ready.at[slot])
            new_acc = pl.run_state(lambda r: plgpu.wgmma(r, p_low, v_smem.at[slot]))(plgpu.ACC.init(acc))
            return new_acc, new_l, next_ref[...]

          carry = pl.run_scoped(scope, plgpu.ACC((block_q, block_kv), jnp.float32))
          plgpu.barrier_arrive(v_free.at[slot])
          return carry

        masked_steps = causal or kv_len is not None
        if fixed and overlap:
          def first_qk(acc_ref):
            plgpu.wgmma(acc_ref, q_smem, k_smem.at[0].T)
            return acc_ref[...]

          carry = (*carry, pl.run_scoped(first_qk, plgpu.ACC((block_q, block_kv), jnp.float32)))
          carry = lax.fori_loop(0, full, functools.partial(overlapped_step, masked=False), carry)
          if masked_steps:
            carry = lax.fori_loop(full, total, functools.partial(overlapped_step, masked=True), carry)
          carry = carry[:2]
        else:
          carry = lax.fori_loop(0, full, functools.partial(step, masked=False), carry)
          if masked_steps:
            carry = lax.fori_loop(full, total, functools.partial(step, masked=True), carry)
        if causal:  # blocks the other warpgroup still needs: release them in step with its loop
          def drain(i, _):
            slot = lax.rem(i, jnp.int32(slots))
            if not pingpong:  # without the schedule's lockstep, wait for each block before releasing it
              for barrier in (k_ready, v_ready) + ((kseg_ready,) if has_segments else ()):
                plgpu.barrier_wait(barrier.at[slot])
            plgpu.barrier_arrive(k_free.at[slot])
            plgpu.barrier_arrive(v_free.at[slot])
            turn()
            turn()

          lax.fori_loop(total, cta_blocks, drain, None)
        pl.when(wg == 0)(turn)
        acc, m, l = (carry[0], m0, carry[1]) if fixed else carry
        o = acc * lax.broadcast_in_dim(1.0 / l, acc.shape, [0])
        lse = m + jnp.log2(l)
        if has_segments:  # padding rows (id 0) see no key: o = 0 and EMPTY_LSE, as every backend
          empty = q_ids == 0
          o = jnp.where(lax.broadcast_in_dim(empty, acc.shape, [0]), 0.0, o)
          lse = jnp.where(empty, EMPTY_LSE, lse)
        q_smem[...] = o.astype(dtype)
        rows[...] = lse
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(q_smem, o_ref.at[batch, pl.ds(row0, block_q), head])
        plgpu.copy_smem_to_gmem(rows, lse_ref.at[batch, head, pl.ds(row0, block_q)])
        plgpu.wait_smem_to_gmem(0)

      def one_warpgroup_at_a_time(decide):
        """Runs decide() in warpgroup 0, then in warpgroup 1 (one schedule-barrier phase each).
        Its warpgroup-wide min goes through shared scratch that the two compute warpgroups share:
        run together, each could read the other's result (H200: both tiles of a CTA took the
        same decision)."""
        pl.when(wg == 1)(take_turn)
        result = decide()
        pl.when(wg == 0)(take_turn)
        return result

      def read_certificate():  # M per row, FAILED_TILE_M where the XLA certificate failed the tile
        plgpu.barrier_wait(m_ready.at[wg])
        m_rows = plgpu.load(rows, layout=plgpu.Layout.WGMMA.reduce(1))
        return m_rows, jnp.min((m_rows < FAILED_TILE_M / 2).astype(jnp.int32)) > 0

      if mode in ("cert", "keys"):
        m_fixed, certified = one_warpgroup_at_a_time(read_certificate) if mode == "cert" else certify_here()
        pl.when(certified)(lambda: attend(True, m_fixed))
        pl.when(jnp.logical_not(certified))(lambda: attend(False))
      else:
        attend(False)

    @pl.when(wg == COMPUTE_WARPGROUPS)
    def _memory():
      plgpu.set_max_registers(40, action="decrease")

      stream_kv(k_ref, v_ref, kseg_ref, k_smem, v_smem, kseg_smem, k_ready, v_ready, kseg_ready, batch=batch,
                kv_head=kv_head, block_kv=block_kv, num_blocks=cta_blocks, slots=slots, free=(k_free, v_free))

  pl.run_scoped(
      body,
      plgpu.SMEM((COMPUTE_WARPGROUPS, block_q, head_dim), dtype, transforms=swizzled()),  # q, then o
      plgpu.SMEM((slots, block_kv, head_dim), dtype, transforms=swizzled()),  # k blocks
      plgpu.SMEM((slots, block_kv, head_dim), dtype, transforms=swizzled()),  # v blocks
      plgpu.SMEM((COMPUTE_WARPGROUPS, block_q), jnp.float32),  # M in, lse out
      plgpu.Barrier(num_barriers=slots),  # k_ready
      plgpu.Barrier(num_barriers=slots),  # v_ready
      plgpu.Barrier(num_barriers=COMPUTE_WARPGROUPS),  # q_ready
      plgpu.Barrier(num_barriers=COMPUTE_WARPGROUPS),  # m_ready
      plgpu.Barrier(num_arrivals=COMPUTE_WARPGROUPS, num_barriers=slots),  # k_free
      plgpu.Barrier(num_arrivals=COMPUTE_WARPGROUPS, num_barriers=slots),  # v_free
      plgpu.Barrier(num_arrivals=COMPUTE_WARPGROUPS),  # schedule
      *(() if mode != "keys" else (
          plgpu.SMEM((block_q, head_dim), dtype, transforms=swizzled()) if row_centres  # rows' own centres
          else plgpu.SMEM((COMPUTE_WARPGROUPS, head_dim), jnp.float32),  # the centre
          plgpu.SMEM((COMPUTE_WARPGROUPS, block_q, head_dim), dtype, transforms=swizzled()),  # diagonal keys
          plgpu.SMEM((COMPUTE_WARPGROUPS, block_q), jnp.float32),  # certified flag out
          plgpu.SMEM((COMPUTE_WARPGROUPS, 4, block_q), jnp.float32),  # radius, headroom, threshold, slack
          plgpu.Barrier(num_barriers=COMPUTE_WARPGROUPS),  # kdiag_ready
          plgpu.Barrier(num_barriers=COMPUTE_WARPGROUPS),  # bounds_ready
          plgpu.Barrier(num_barriers=COMPUTE_WARPGROUPS))),  # centre_ready
      *(() if not has_segments else (
          plgpu.SMEM((COMPUTE_WARPGROUPS, block_q), jnp.int32),  # query segment ids
          plgpu.SMEM((slots, block_kv), jnp.int32),  # key segment ids, one block per slot
          plgpu.Barrier(num_barriers=COMPUTE_WARPGROUPS),  # qseg_ready
          plgpu.Barrier(num_barriers=slots))),  # kseg_ready
      collective_axes="wg",
  )


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


def _no_window_or_cap(window, softcap):
  if window is not None or softcap is not None:
    raise ValueError("implementation='pallas_mgpu' has no local window or logits soft cap; use "
                     "implementation='pallas_gpu' (the default picks it when either is asked for)")


def forward(q, k, v, segment_ids, cert: Certificate | None, *, causal, scale, kv_len, block_sizes: BlockSizes,
            keys: KeyBounds | None = None, seq_len: int | None = None, window=None, softcap=None, interpret=False):
  """Returns (o [B, S, Hq, D], lse [B, Hq, S] f32 base 2, certified tiles [B, Hq, S/64] or None).

  The stabilizer comes from `keys` (the K/V pre-pass; each warpgroup certifies its rows in the
  prologue, bidirectional packed rows against their segment's centre), from `cert` (the whole XLA pre-pass, for
  granularity="head"), or neither (online).
  S must be a multiple of block_sizes.multiple (the API pads with zeros, which the in-kernel
  certificate relies on: zero rows pass). seq_len: accepted for the API's call, not needed.
  """
  if cert is not None and keys is not None:
    raise ValueError("pass the stabilizer as cert or as keys, not both")
  _no_window_or_cap(window, softcap)
  _check(q, k, cert, scale, interpret)
  batch, seq, num_heads, _ = q.shape
  bs = block_sizes
  if seq % bs.multiple or k.shape[1] % bs.multiple:
    raise ValueError(f"{bs.multiple=} must divide the padded lengths {q.shape[1]=} and {k.shape[1]=}")
  mode = "keys" if keys is not None else "cert" if cert is not None else "online"
  row_centres = keys is not None and keys.centre.shape[1] != 1
  kernel = functools.partial(
      _kernel, mode=mode, causal=causal, sigma2=scale * LOG2E, block_q=bs.block_q,
      block_kv=bs.block_kv, slots=min(bs.slots, k.shape[1] // bs.block_kv), kv_len=kv_len,
      group=num_heads // k.shape[2], has_segments=segment_ids is not None, row_centres=row_centres,
      pingpong=bs.pingpong,
      overlap=bs.overlap)
  args = [q, k, v]
  if segment_ids is not None:  # key id 0 (padding) becomes −1: it then matches no query, padding included
    args += [segment_ids.q.astype(jnp.int32), jnp.where(segment_ids.kv == 0, -1, segment_ids.kv).astype(jnp.int32)]
  out_type = [out_struct(q.shape, q.dtype, q), out_struct((batch, num_heads, seq), jnp.float32, q)]
  if mode == "cert":  # the kernel reads the certificate per row, with M
    args += [jnp.where(_per_row(cert.certified, tile=bs.tile, seq=seq), cert.m, FAILED_TILE_M)]
  if mode == "keys":
    if row_centres and segment_ids is None:
      raise ValueError(f"keys.centre.shape={keys.centre.shape}: one centre per position needs segment_ids "
                       "(stabilizer.key_bounds gives it for bidirectional packed rows only)")
    args += list(kernel_key_inputs(keys, row_centres=row_centres, dtype=q.dtype, seq=seq, tile=bs.tile))
    out_type.append(out_struct((batch, num_heads, seq), jnp.float32, q))  # certified flag per row
  outs = plgpu.kernel(
      kernel,
      out_type=tuple(out_type),
      grid=(num_heads, seq // (COMPUTE_WARPGROUPS * bs.block_q), batch),
      grid_names=("heads", "q_tiles", "batch"),
      num_threads=COMPUTE_WARPGROUPS + 1,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True),
  )(*args)
  o, lse = outs[:2]
  if mode == "keys":
    return o, lse, outs[2].reshape(batch, num_heads, seq // bs.tile, bs.tile)[..., 0] > 0.5
  return o, lse, None if cert is None else cert.certified


def backward(q, k, v, segment_ids, o, lse, do, *, causal, scale, kv_len, block_sizes: BlockSizes, window=None,
             softcap=None, interpret=False):
  """The backward block_sizes.backward names (Triton or Mosaic GPU), from this forward's o and base-2 lse."""
  _no_window_or_cap(window, softcap)
  if isinstance(block_sizes.backward, pallas_mgpu_vjp.BlockSizes):
    return pallas_mgpu_vjp.backward(q, k, v, segment_ids, o, lse, do, causal=causal, scale=scale, kv_len=kv_len,
                                    block_sizes=block_sizes.backward)
  return pallas_gpu_vjp.backward(q, k, v, segment_ids, o, lse, do, causal=causal, scale=scale, kv_len=kv_len,
                                 block_sizes=block_sizes.backward, interpret=interpret)
