"""The Mosaic GPU forward's KV loop and epilogue (pallas_mgpu_kernel.py's compute warpgroups run them).

`attend` walks a compute warpgroup's KV blocks: `_step` per block (Q·Kᵀ, then `_weights`, the softmax: certified with
the fixed M, or online with the running max; then P·V), or with BlockSizes.overlap the certified `_overlapped_step`
(block i+1's Q·Kᵀ issued before block i's exp2); `_visible` masks a block (segments, causal, window, kv_len) and
`_capped` applies the soft cap (`cap_tanh`); `_drain` releases the blocks only the other warpgroup needs;
`_epilogue` (with `_add_sink`'s learned sinks) writes o and lse. `take_turn` / `turn` are the two warpgroups' hand-over
of the tensor cores (FA3's ping-pong) on an mbarrier; with BlockSizes.named_barriers `_pass_turn` / `_await_turn` hand
them over on hardware barriers and `_release` frees K/V slots on them (FA3's and tokamax's way).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from clis_kernels import masks
from clis_kernels.common import int32_loop
from clis_kernels.mgpu_pipeline import CONSUMED_THREADS, SCHEDULE_THREADS, finish_stores, named_barrier
from clis_kernels.stabilizer import CAP_TANH_ERROR, EMPTY_LSE, LOG2E

if TYPE_CHECKING:
  from clis_kernels.pallas_mgpu_kernel import Config, Refs, Rows, Scratch

ONLINE_FLOOR = -1e20  # the online loop's starting max (base 2): below any real logit
TANHS = ("approx", "exp2")  # BlockSizes.soft_cap_tanh
TANH_ERROR = {"approx": CAP_TANH_ERROR, "exp2": 2.0**-20}  # above twice each one's largest absolute error in tanh
SUM_COLUMNS = 16  # columns of the ones tile the tensor-core sum multiplies by (32-byte rows: wgmma's least swizzle)


def take_turn(s: Scratch):
  """Hands the tensor cores to the other compute warpgroup and waits for them back."""
  plgpu.barrier_arrive(s.schedule)
  plgpu.barrier_wait(s.schedule)


def turn(c: Config, s: Scratch):
  """take_turn inside the KV loop, when the warpgroups ping-pong."""
  if c.pingpong:
    take_turn(s)


def _pass_turn(c: Config, s: Scratch, r: Rows):
  """Once this warpgroup's Q·Kᵀ is issued: the tensor cores go to the other warpgroup (named: arrive on the barrier it
  syncs on before its P·V; else the mbarrier rendezvous)."""
  if c.named:
    named_barrier("arrive", c.barriers.schedule + 1 - r.wg, SCHEDULE_THREADS)
  else:
    turn(c, s)


def _await_turn(c: Config, s: Scratch, r: Rows):
  """Before this warpgroup's P·V: wait until the other one has issued its Q·Kᵀ (named), or met it again."""
  if c.named:
    named_barrier("sync", c.barriers.schedule + r.wg, SCHEDULE_THREADS)
  elif c.pingpong:
    plgpu.barrier_wait(s.schedule)


def _release(c: Config, free, slot, which: str):
  """This warpgroup has read the slot's K (which "k") or V ("v"): its streaming warp may refill it once both have."""
  if c.named:
    first = c.barriers.k_free if which == "k" else c.barriers.v_free
    named_barrier("arrive", first + slot, CONSUMED_THREADS)
  else:
    plgpu.barrier_arrive(free.at[slot])



def attend(c: Config, g: Refs, s: Scratch, ss, r: Rows, fixed: bool, m_fixed=None):
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
  if c.named:  # warpgroup 1 starts half a step behind warpgroup 0
    pl.when(r.wg == 1)(lambda: named_barrier("sync", c.barriers.schedule + 1, SCHEDULE_THREADS))
  else:
    pl.when(r.wg == 1)(r.turn)
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
    int32_loop(r.total, r.cta_blocks, functools.partial(_drain, c, s, ss, r), None)
  if c.named:  # the last turn: warpgroup 1's last P·V
    pl.when(r.wg == 0)(lambda: named_barrier("arrive", c.barriers.schedule + 1, SCHEDULE_THREADS))
  else:
    pl.when(r.wg == 0)(r.turn)
  acc, m, l, l_lse = (carry[0], m0, *carry[1:]) if fixed else (*carry, None)
  if fixed and c.tc_sum:
    l = l.sum(axis=1) * (1.0 / SUM_COLUMNS)
  _epilogue(c, g, s, r, acc, m, l, l_lse)


def _visible(c: Config, s: Scratch, ss, r: Rows, qk, i, slot, masked: bool):
  """Block i's logits with −inf where a key is hidden; releases the block's K (read now)."""
  if c.has_segments:  # every step: a query sees keys of its own segment (padding keys are −1)
    plgpu.barrier_wait(ss.kseg_ready.at[slot])
    k_ids = plgpu.load(ss.kseg.at[slot], layout=plgpu.Layout.WGMMA.reduce(0))
    same = lax.broadcast_in_dim(r.q_ids, qk.shape, [0]) == lax.broadcast_in_dim(k_ids, qk.shape, [1])
    # −inf is safe: the online loop's max starts at ONLINE_FLOOR, so a block wholly of other
    # segments adds 2^(−inf − floor) = 0; rows that never see a key are padding (zeroed below).
    qk = jnp.where(same, qk, -jnp.inf)
  _release(c, s.k_free, slot, "k")  # k and its segment ids are read
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


def _capped(c: Config, qk):
  """Q·Kᵀ as the loop takes it: `c.logit_scale` times the result is the base-2 logit, σ₂·qk, or with a soft cap
  cap2·tanh(σ₂·qk / cap2) (stabilizer.soft_cap; the result is then the tanh, as tokamax's). Before the mask: tanh
  would turn a hidden −inf into a finite −cap."""
  if c.cap2 is None:
    return qk
  return cap_tanh(qk * (c.sigma2 / c.cap2), c.tanh)


def _step(c: Config, s: Scratch, ss, r: Rows, fixed: bool, m0, i, carry, masked: bool):
  """One KV block: Q·Kᵀ, the weights (certified: one FMA and one exp2 each; online: running max and
  rescale), P·V; the warpgroups hand the tensor cores over around the softmax when they ping-pong. The named scopes
  are the regions Mosaic GPU's profiler times (mgpu_pipeline.compiler_params); they change nothing otherwise."""
  acc, m, l, l_lse = (carry[0], m0, *carry[1:]) if fixed else (*carry, None)
  slot = lax.rem(i, jnp.int32(c.slots))

  def qk_scope(acc_ref):
    plgpu.wgmma(acc_ref, r.q_smem, s.k.at[slot].T)
    with jax.named_scope("turn_after_qk"):
      _pass_turn(c, s, r)
    with jax.named_scope("qk_wait"):
      return acc_ref[...]

  qk = pl.run_scoped(qk_scope, plgpu.ACC((c.block_q, c.block_kv), jnp.float32))
  with jax.named_scope("softmax"):
    acc, m, l, l_lse, p_low = _weights(c, s, ss, r, fixed, i, slot, masked, qk, acc, m, l, l_lse)
  if c.pingpong and not c.named:
    plgpu.barrier_arrive(s.schedule)  # softmax done
  if fixed and c.exact_sum and not c.tc_sum:  # while the other warpgroup holds the tensor cores
    with jax.named_scope("rounded_sum"):
      l = l + p_low.astype(jnp.float32).sum(axis=1)
  with jax.named_scope("await_turn"):
    plgpu.barrier_wait(s.v_ready.at[slot])
    _await_turn(c, s, r)  # tensor cores free again

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
  _release(c, s.v_free, slot, "v")
  return (acc, l, l_lse) if fixed else (acc, m, l)


def _weights(c: Config, s: Scratch, ss, r: Rows, fixed: bool, i, slot, masked: bool, qk, acc, m, l, l_lse):
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
      l = l + p.sum(axis=1)  # the unrounded weights: see pallas_mgpu.py's docstring (BlockSizes.exact_sum)
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


def _overlapped_step(c: Config, s: Scratch, ss, r: Rows, m0, i, carry, masked: bool):
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


def _record_row_max(c: Config, r: Rows, i, row_max):
  """Writes step i's row maxima [block_q] (log2 units) to rowmax[batch, head, block, rows] through one of
  two shared-memory buffers; the store issued two steps ago must have read this buffer first."""
  buf = r.lists.rowmax.at[r.wg, lax.rem(i, jnp.int32(2))]
  plgpu.wait_smem_to_gmem(1, wait_read_only=True)
  buf[...] = row_max
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(buf, r.rowmax.at[r.batch, r.head, r.block_of(i), pl.ds(r.row0, c.block_q)])


def _drain(c: Config, s: Scratch, ss, r: Rows, i, _):
  """Releases block i, which this warpgroup does not need but the other one does (causal). Each thread tracks every
  barrier's phase itself (Mosaic GPU keeps the parities in a per-thread variable), so a warpgroup that goes on to
  another head (heads_per_cta) waits for the drained blocks too: skipping those waits leaves its parities one phase
  behind, so its next head's wait on that slot waits for a load that never comes (most likely the hang seen on an
  H100 on 2026-12-07 with 64-key blocks, where the two warpgroups' causal ranges differ by a block). Named barriers
  wait too: an arrival for a block not yet loaded would complete its slot's barrier for the block before."""
  slot = lax.rem(i, jnp.int32(c.slots))
  if not c.pingpong or c.heads > 1 or c.named:  # no lockstep, another head next, or named: wait for the block
    for barrier in (s.k_ready, s.v_ready) + ((ss.kseg_ready,) if c.has_segments else ()):
      plgpu.barrier_wait(barrier.at[slot])
  _release(c, s.k_free, slot, "k")
  _release(c, s.v_free, slot, "v")
  if c.named:
    _pass_turn(c, s, r)
    _await_turn(c, s, r)
  else:
    turn(c, s)
    turn(c, s)


def _add_sink(r: Rows, m, l, l_lse):
  """(m, l, l_lse, the factor on acc) with the head's sink logit t as one more term of the rows' softmax, of value
  0: the stabilizer becomes max(m, t) and the sums take 2^(t − max) (stabilizer.fold_sinks's arithmetic, in
  registers). Exact for any t, so neither the loop nor the certificate changes."""
  buf, ready = r.sink
  plgpu.barrier_wait(ready)
  t = plgpu.load(buf, layout=plgpu.Layout.WGMMA.reduce(1))
  m_new = jnp.maximum(m, t)
  old, sink = jnp.exp2(m - m_new), jnp.exp2(t - m_new)
  return m_new, l * old + sink, None if l_lse is None else l_lse * old + sink, old


def _epilogue(c: Config, g: Refs, s: Scratch, r: Rows, acc, m, l, l_lse=None):
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

