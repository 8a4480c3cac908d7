"""Context parallelism: attention over a sequence split along one mesh axis, called inside `jax.shard_map`.

Layout (zig-zag, for causal load balance): the global sequence is cut into 2n chunks of equal length for n
devices on the axis, and device r holds chunks r and 2n − 1 − r, back to back (`to_zigzag` / `from_zigzag`
reorder a [B, S, ...] array). Every device then owns as many causal (query, key) pairs as any other.

Each (query chunk, key chunk) pair is one kernel call: the diagonal pair causal (or bidirectional), a key
chunk wholly before the query chunk bidirectional (every key visible but for segment ids), a later one
skipped. Keys reach the queries by a ring of `ppermute`s (strategy "ring": one shard in flight, dK/dV
partials ride the ring home in the backward) or by one `all_gather` (strategy "all_gather": every key at
once, dK/dV return by `psum_scatter`).

The CLiS combination. Before any key moves, each device summarises its key chunks by the block bound
(stabilizer.block_bounds: a centre and radius per 16 keys, 32 exceptional keys per head): 1/16 of K's size,
all-gathered. Every query row then gets one upper bound U over every key it may see, one lower bound L from
its own chunk, and one stabilizer M = max(L, U − h) for all shards (h from the global key count and the
global max |v|). A certified row runs M in every partial call, so partials add: acc = Σ_s l_s·o_s,
l = Σ_s l_s with l_s = 2^(lse_s − M), no running max and no rescale. Uncertified rows combine the online way
(running max of the partials' lse, rescaled). combine="online" takes the online way for every row (the
baseline a ring attention without a certificate has).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from clis_kernels import api, masks
from clis_kernels import plan as plan_lib
from clis_kernels import stabilizer as certificate
from clis_kernels.api import AttentionStats, check_inputs
from clis_kernels.common import dot_precision, varying_like
from clis_kernels.stabilizer import EMPTY_LSE, LOG2E, NEG

STRATEGIES = ("ring", "all_gather")
LAYOUTS = ("zigzag", "contiguous")
COMBINES = ("clis", "online")
NONE, FULL, DIAGONAL = 0, 1, 2  # what a (query chunk, key chunk) pair is: skipped, all keys visible, the diagonal


def zigzag_order(seq_len: int, shards: int) -> np.ndarray:
  """[S] int: position p of the zig-zag layout holds token order[p] of the natural order."""
  if seq_len % (2 * shards):
    raise ValueError(f"{seq_len=} must be a multiple of 2 * {shards=} (two chunks per device)")
  chunk = seq_len // (2 * shards)
  pieces = [c for r in range(shards) for c in (r, 2 * shards - 1 - r)]
  return np.concatenate([np.arange(c * chunk, (c + 1) * chunk) for c in pieces])


def to_zigzag(x, shards: int, axis: int = 1):
  """x reordered along `axis` (the sequence) into the zig-zag layout for `shards` devices."""
  return jnp.take(x, zigzag_order(x.shape[axis], shards), axis=axis)


def from_zigzag(x, shards: int, axis: int = 1):
  """The inverse of `to_zigzag`: the natural order back."""
  return jnp.take(x, np.argsort(zigzag_order(x.shape[axis], shards)), axis=axis)


@dataclasses.dataclass(frozen=True)
class _Static:
  """What the custom_vjp closes over (hashable)."""

  plan: plan_lib.Plan
  axis_name: str
  shards: int
  causal: bool
  scale: float
  softcap: float | None
  tau: float
  strategy: str
  combine: str
  certify: bool  # stabilizer="clis"
  layout: str = "zigzag"

  def chunks_of(self, shard):
    """The global chunk indices (first, second) that device `shard` holds (shard may be traced)."""
    if self.layout == "contiguous":
      return 2 * shard, 2 * shard + 1
    return shard, 2 * self.shards - 1 - shard

  def pair(self, q_chunk, k_chunk):
    """NONE, FULL or DIAGONAL for a (query chunk, key chunk) pair of global chunk indices."""
    if not self.causal:
      return jnp.where(q_chunk == k_chunk, DIAGONAL, FULL)
    return jnp.where(k_chunk < q_chunk, FULL, jnp.where(k_chunk == q_chunk, DIAGONAL, NONE))


def _split(x, axis=1):
  """A device's [B, 2c, ...] array (or None) as its two chunks."""
  return (None, None) if x is None else tuple(jnp.split(x, 2, axis=axis))


def _pair_ids(q_ids, k_ids):
  """The kernel's segment ids for a pair (the query chunk's and the key chunk's), or None (unpacked)."""
  return None if q_ids is None else masks.SegmentIds(q_ids, k_ids)


def _partial_forward(static, q, k, v, q_ids, k_ids, cert, kind):
  """(o [B, c, Hq, Dv] f32, lse [B, Hq, c]) of q against one key chunk; kind NONE gives lse = EMPTY_LSE."""
  plan = static.plan

  def run(causal):
    def call():
      o, lse, _ = plan.backend.forward(q, k, v, _pair_ids(q_ids, k_ids), cert, mode=plan.mode, causal=causal,
                                       scale=static.scale, kv_len=None, block_sizes=plan.block_sizes, window=None,
                                       softcap=static.softcap, interpret=plan.interpret)
      return varying_like(o.astype(jnp.float32), q), varying_like(lse, q)  # (a GPU kernel's outputs carry none)
    return call

  def skip():
    b, c, hq, _ = q.shape
    return (varying_like(jnp.zeros((b, c, hq, v.shape[-1]), jnp.float32), q),
            varying_like(jnp.full((b, hq, c), EMPTY_LSE, jnp.float32), q))

  return jax.lax.switch(kind, (skip, run(False), run(static.causal)))


def _partial_backward(static, q, k, v, q_ids, k_ids, o, lse, do, kind):
  """(dq, dk, dv) of one pair from the combined output and lse (the rows' global softmax)."""
  plan = static.plan

  def run(causal):
    return lambda: tuple(varying_like(g, q) for g in plan.backend.backward(
        q, k, v, _pair_ids(q_ids, k_ids), o, lse, do, causal=causal, scale=static.scale, kv_len=None,
        block_sizes=plan.backward_block_sizes, window=None, softcap=static.softcap, interpret=plan.interpret))

  zeros = lambda: tuple(varying_like(jnp.zeros_like(x), q) for x in (q, k, v))
  return jax.lax.switch(kind, (zeros, run(False), run(static.causal)))


class _Rows:
  """One query chunk's running combination: acc [B, c, Hq, Dv] f32, m and l [B, Hq, c]; `fixed` [B, Hq, c]
  rows (certified) keep m = M, so their partials add with no rescale; the others take the online max."""

  def __init__(self, q, fixed, m_fixed, value_head_dim: int):
    b, c, hq, _ = q.shape
    self.fixed = fixed
    self.acc = jnp.zeros((b, c, hq, value_head_dim), jnp.float32)
    self.m = jnp.full(fixed.shape, NEG) if m_fixed is None else jnp.where(fixed, m_fixed, NEG)
    self.l = jnp.zeros((b, hq, c), jnp.float32)

  def add(self, o, lse):
    # A row that saw no key of this chunk adds nothing, whatever a kernel left there: EMPTY_LSE (padding rows),
    # log2(0) = −inf and o = 0/0 (a certified row of the Mosaic GPU kernel whose keys are all of other documents),
    # or NEG + log2(count) (an online row whose every key was masked).
    seen = (lse > NEG / 2) & (lse < EMPTY_LSE / 2)
    o = jnp.where(jnp.swapaxes(seen, 1, 2)[..., None], o, 0.0)
    m_new = jnp.where(self.fixed, self.m, jnp.maximum(self.m, jnp.where(seen, lse, NEG)))
    alpha = jnp.exp2(self.m - m_new)
    weight = jnp.where(seen, jnp.exp2(lse - m_new), 0.0)
    rows = lambda x: jnp.swapaxes(x, 1, 2)[..., None]
    self.acc = self.acc * rows(alpha) + o * rows(weight)
    self.m, self.l = m_new, self.l * alpha + weight

  def result(self, dtype):
    """(o [B, c, Hq, D] in dtype, lse [B, Hq, c] base 2; EMPTY_LSE where no key was seen)."""
    empty = self.l == 0.0
    l_safe = jnp.where(empty, 1.0, self.l)
    o = jnp.where(jnp.swapaxes(empty, 1, 2)[..., None], 0.0, self.acc / jnp.swapaxes(l_safe, 1, 2)[..., None])
    return o.astype(dtype), jnp.where(empty, EMPTY_LSE, self.m + jnp.log2(l_safe))


def _ring_shards(static, k, v, ids):
  """Yields (shard index, k, v, ids) for every device's key shard, as this device receives them."""
  n, me = static.shards, jax.lax.axis_index(static.axis_name)
  if static.strategy == "all_gather":
    gathered = [None if x is None else jax.lax.all_gather(x, static.axis_name) for x in (k, v, ids)]
    for s in range(n):
      yield s, *(None if x is None else x[s] for x in gathered)
    return
  ring = [(i, (i + 1) % n) for i in range(n)]
  for t in range(n):
    yield (me - t) % n, k, v, ids
    if t + 1 < n:
      k, v, ids = (None if x is None else jax.lax.ppermute(x, static.axis_name, ring) for x in (k, v, ids))


def _global_certificate(static, q, k, v, ids):
  """The certificate of this device's two query chunks against every key of the axis, from the block bounds
  all-gathered (stabilizer.py states the bound). Returns a Certificate per query chunk."""
  plan, n = static.plan, static.shards
  me = jax.lax.axis_index(static.axis_name)
  chunk = q.shape[1] // 2
  sigma2, cap2 = static.scale * LOG2E, None if static.softcap is None else static.softcap * LOG2E
  key_block = min(certificate.KEY_BLOCK, plan.tile)
  qs, ks, idss = _split(q), _split(k), _split(ids)
  local = [certificate.block_bounds(kc, ic, block=key_block, seq_len=chunk) for kc, ic in zip(ks, idss)]
  gather = lambda x: jax.lax.all_gather(jnp.stack(x), static.axis_name)  # [n, 2, ...]
  centres = gather([b.centres for b in local])  # [n, 2, B, nb, Hkv, D]
  radii = gather([b.radii for b in local])  # [n, 2, B, Hkv, nb]
  exceptional = gather([jnp.take_along_axis(kc, b.exceptional.transpose(0, 2, 1)[..., None], axis=1)
                        for kc, b in zip(ks, local)])  # [n, 2, B, E, Hkv, D]
  is_exceptional = gather([b.is_exceptional for b in local])  # [n, 2, B, Hkv, E]
  e_ids = None if ids is None else gather([jnp.take_along_axis(ic[:, None, :], b.exceptional, axis=2)
                                           for ic, b in zip(idss, local)])  # [n, 2, B, Hkv, E]
  chunk_of = jnp.stack(static.chunks_of(jnp.arange(n)), axis=1)  # [n, 2]: global chunk of (shard, slot)
  nb = centres.shape[3]
  flat = lambda x, axis: jnp.moveaxis(x.reshape(2 * n, *x.shape[2:]), 0, axis)
  centres = flat(centres, 1).reshape(q.shape[0], 2 * n * nb, *centres.shape[4:])  # [B, 2n·nb, Hkv, D]
  radii = flat(radii, 2).reshape(q.shape[0], -1, 2 * n * nb)  # [B, Hkv, 2n·nb]
  e = exceptional.shape[3]
  exceptional = jnp.moveaxis(exceptional, 2, 0).reshape(q.shape[0], 2 * n * e, *exceptional.shape[4:])
  is_exceptional = jnp.moveaxis(is_exceptional, 2, 0)  # [B, n, 2, Hkv, E]
  is_exceptional = jnp.moveaxis(is_exceptional, 3, 1).reshape(q.shape[0], -1, 2 * n * e)  # [B, Hkv, 2n·E]
  if e_ids is not None:
    e_ids = jnp.moveaxis(jnp.moveaxis(e_ids, 2, 0), 3, 1).reshape(is_exceptional.shape)
  centres, radii = certificate.rounded_centres(centres, radii, q.dtype)  # far products on the matrix units

  vmax = jnp.where(masks.key_is_real(masks.segment_ids_of(ids), k.shape[1], k.shape[1])[..., None, None],
                   jnp.abs(v.astype(jnp.float32)), 0.0).max(axis=(1, 3))
  headroom, floor = certificate.headroom_from(jax.lax.pmax(vmax, static.axis_name), v.dtype, seq_len=n * 2 * chunk)
  threshold = jnp.minimum(static.tau * LOG2E, headroom + floor)

  # the diagonal pair, as a single device bounds it: the backend's (U, L) kernel where it takes the call (GPUs)
  kernel = plan.row_bounds_kernel(causal=static.causal, packed=ids is not None, window=None, separate_ids=False,
                                  same_length=True)
  certs = []
  for slot, (qc, kc, ic, bounds) in enumerate(zip(qs, ks, idss, local)):
    mine = static.chunks_of(me)[slot]
    if kernel is None:
      upper, lower = certificate.block_row_bounds(qc, kc, ic, bounds, causal=static.causal, scale=static.scale,
                                                  block=key_block, kv_len=chunk, own_block=plan.tile)
    else:
      upper, lower = kernel(qc, kc, masks.segment_ids_of(ic), bounds, causal=static.causal, scale=static.scale,
                            block=key_block, kv_len=chunk)
    for g in range(2 * n):  # each other chunk these rows see wholly (a FULL pair); the rest are skipped
      blocks, keys = slice(g * nb, (g + 1) * nb), slice(g * e, (g + 1) * e)
      far = functools.partial(_far_bounds, qc, ic, centres[:, blocks], radii[..., blocks], exceptional[:, keys],
                              is_exceptional[..., keys], None if e_ids is None else e_ids[..., keys], sigma2)
      none = lambda: tuple(varying_like(jnp.full(upper.shape, NEG), qc) for _ in range(2))
      far_upper, far_lower = jax.lax.cond(static.pair(mine, chunk_of.reshape(-1)[g]) == FULL, far, none)
      upper, lower = jnp.maximum(upper, far_upper), jnp.maximum(lower, far_lower)
    upper, lower = certificate.soft_cap(upper, cap2), certificate.soft_cap(lower, cap2)
    certs.append(certificate.certificate_of(upper, lower, headroom, threshold, masks.segment_ids_of(ic),
                                            block_q=plan.tile, seq_len=chunk, granularity="tile"))
  return certs


def _far_bounds(q, q_ids, centres, radii, keys, far_keys, key_ids, sigma2):
  """Base-2 (U, L) [B, Hq, c] of rows q [B, c, Hq, D] over one other chunk they see wholly: U is the block bound
  over its blocks (centres [B, nb, Hkv, D] in q's dtype, radii [B, Hkv, nb] widened for that rounding:
  stabilizer.rounded_centres) and its exceptional keys scored as the kernels score them (keys [B, E, Hkv, D] in k's
  dtype, far_keys [B, Hkv, E]: which slots hold one); L the exceptional keys the row sees (its segment,
  q_ids [B, c] against key_ids [B, Hkv, E]; None: unpacked), each a visible logit; NEG where none."""
  b, c, hq, d = q.shape
  hkv = centres.shape[2]
  qg = jax.lax.stop_gradient(q).reshape(b, c, hkv, hq // hkv, d)
  norm = jnp.linalg.norm(qg.astype(jnp.float32), axis=-1)
  ids = jnp.zeros((b, c), jnp.int32) if q_ids is None else q_ids

  def rows(chunk):  # a chunk of rows at a time: [rows, NB] stays small at long lengths
    q_rows, norm_rows, id_rows = chunk
    # q's dtype on the matrix units, f32 sums (the centres were rounded and their radii widened to match); true f32
    # products for f32 inputs
    dot = functools.partial(jnp.einsum, precision=dot_precision(q.dtype), preferred_element_type=jnp.float32)
    per_block = dot("bihgd,buhd->bihgu", q_rows, centres) + norm_rows[..., None] * radii[:, None, :, None]
    per_block = per_block.max(-1)
    scored = dot("bihgd,behd->bihge", q_rows, keys)
    seen = far_keys[:, None, :, None, :]
    if key_ids is not None:
      seen = seen & (id_rows[:, :, None, None, None] == key_ids[:, None, :, None, :])
    return (jnp.maximum(per_block, jnp.where(far_keys[:, None, :, None, :], scored, NEG).max(-1)),
            jnp.where(seen, scored, NEG).max(-1))

  size = math.gcd(c, 1024)
  split = lambda x: jnp.moveaxis(x.reshape(b, c // size, size, *x.shape[2:]), 1, 0)
  bounds = jax.lax.map(rows, (split(qg), split(norm), split(ids)))
  to_heads = lambda x: jnp.where(x > NEG / 2, x * sigma2, NEG).reshape(b, c, hq).transpose(0, 2, 1)
  return tuple(to_heads(jnp.moveaxis(x, 0, 1)) for x in bounds)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _context_parallel(static, q, k, v, ids):
  return _forward(static, q, k, v, ids)[0]


def _forward(static, q, k, v, ids):
  me = jax.lax.axis_index(static.axis_name)
  qs, q_ids = _split(q), _split(ids)
  certs = _global_certificate(static, q, k, v, ids) if static.certify else (None, None)
  rows = []
  for qc, cert in zip(qs, certs):
    if cert is None or static.combine == "online":
      fixed = jnp.zeros((q.shape[0], q.shape[2], qc.shape[1]), bool)
    else:
      fixed = jnp.repeat(cert.certified, static.plan.tile, axis=-1)
    rows.append(_Rows(qc, fixed, None if cert is None else cert.m, v.shape[-1]))
  for shard, ks, vs, kids in _ring_shards(static, k, v, ids):
    for k_slot, (kc, vc, kid) in enumerate(zip(_split(ks), _split(vs), _split(kids))):
      k_chunk = static.chunks_of(shard)[k_slot]
      for slot, (qc, qid) in enumerate(zip(qs, q_ids)):
        kind = static.pair(static.chunks_of(me)[slot], k_chunk)
        rows[slot].add(*_partial_forward(static, qc, kc, vc, qid, kid, certs[slot], kind))
  results = [r.result(q.dtype) for r in rows]
  o = jnp.concatenate([o for o, _ in results], axis=1)
  lse = jnp.concatenate([lse for _, lse in results], axis=2)
  tiles = None if certs[0] is None else jnp.concatenate([c.certified for c in certs], axis=-1)
  return (o, tiles), (q, k, v, ids, o, lse)


def _backward(static, residuals, cotangents):
  q, k, v, ids, o, lse = residuals
  do, _ = cotangents
  me = jax.lax.axis_index(static.axis_name)
  qs, q_ids, os_, dos = _split(q), _split(ids), _split(o), _split(do)
  lses = tuple(jnp.split(lse, 2, axis=2))
  dq = [jnp.zeros(qc.shape, jnp.float32) for qc in qs]
  n = static.shards
  ring = [(i, (i + 1) % n) for i in range(n)]
  dk_all, dv_all = [], []
  dk_travel = dv_travel = None
  for shard, ks, vs, kids in _ring_shards(static, k, v, ids):
    dk_shard, dv_shard = [], []
    for k_slot, (kc, vc, kid) in enumerate(zip(_split(ks), _split(vs), _split(kids))):
      k_chunk = static.chunks_of(shard)[k_slot]
      dk_c, dv_c = jnp.zeros(kc.shape, jnp.float32), jnp.zeros(vc.shape, jnp.float32)
      for slot in range(2):
        kind = static.pair(static.chunks_of(me)[slot], k_chunk)
        dq_p, dk_p, dv_p = _partial_backward(static, qs[slot], kc, vc, q_ids[slot], kid, os_[slot], lses[slot],
                                             dos[slot], kind)
        dq[slot] = dq[slot] + dq_p.astype(jnp.float32)
        dk_c, dv_c = dk_c + dk_p.astype(jnp.float32), dv_c + dv_p.astype(jnp.float32)
      dk_shard.append(dk_c)
      dv_shard.append(dv_c)
    dk_s, dv_s = jnp.concatenate(dk_shard, axis=1), jnp.concatenate(dv_shard, axis=1)
    if static.strategy == "all_gather":
      dk_all.append(dk_s)
      dv_all.append(dv_s)
    else:  # the shard's dK/dV accumulators travel with it and arrive home after n hops
      if dk_travel is not None:
        dk_s, dv_s = dk_s + dk_travel, dv_s + dv_travel
      dk_travel, dv_travel = (jax.lax.ppermute(x, static.axis_name, ring) for x in (dk_s, dv_s))
  if static.strategy == "all_gather":
    dk = jax.lax.psum_scatter(jnp.stack(dk_all), static.axis_name, scatter_dimension=0)
    dv = jax.lax.psum_scatter(jnp.stack(dv_all), static.axis_name, scatter_dimension=0)
  else:
    dk, dv = dk_travel, dv_travel
  dq = jnp.concatenate(dq, axis=1)
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


_context_parallel.defvjp(_forward, _backward)


def context_parallel_attention(q, k, v, segment_ids=None, *, axis_name: str, causal: bool = True, scale=None,
                               logits_soft_cap=None, stabilizer: str = "clis", combine: str = "clis",
                               strategy: str = "ring", layout: str = "zigzag", tau=None, implementation=None, block_sizes=None,
                               backward_block_sizes=None, interpret: bool = False, platform=None,
                               return_stats: bool = False):
  """Attention of this device's queries against every key along mesh axis `axis_name`; call inside
  `jax.shard_map` with the sequence split over that axis in the zig-zag layout (`to_zigzag`).

  q [B, 2c, Hq, D], k and v [B, 2c, Hkv, D] (this device's two chunks); segment_ids [B, 2c] int (packed
  documents; 0 = padding) or None. causal, scale, logits_soft_cap, stabilizer, tau, implementation,
  block_sizes, backward_block_sizes, interpret, platform: as `clis_kernels.attention` (the certificate uses
  the block bound). combine: "clis" (certified rows add the partials under one stabilizer) or "online" (every
  row the online way). strategy: "ring" or "all_gather" (module docstring). layout: "zigzag" (device r holds
  chunks r and 2n − 1 − r: MaxText's dual-chunk swap) or "contiguous" (the sequence in device order: no causal
  load balance). v's head dim Dv may differ from q's (MLA). Returns the output [B, 2c, Hq, Dv]
  (and with return_stats=True this device's AttentionStats).
  """
  check_inputs(q, k, v, segment_ids, causal, stabilizer, "tile", tau, logits_soft_cap=logits_soft_cap)
  if strategy not in STRATEGIES:
    raise ValueError(f"{strategy=} must be one of {STRATEGIES}")
  if layout not in LAYOUTS:
    raise ValueError(f"{layout=} must be one of {LAYOUTS}")
  if combine not in COMBINES:
    raise ValueError(f"{combine=} must be one of {COMBINES}")
  if isinstance(segment_ids, masks.SegmentIds):
    raise ValueError("context parallelism takes one segment_ids array [B, S] for queries and keys (packed "
                     "documents); separate SegmentIds(q=..., kv=...) are not supported")
  shards = jax.lax.axis_size(axis_name)
  local = q.shape[1]
  plan = plan_lib.make_plan(dtype=q.dtype, head_dim=q.shape[-1], value_head_dim=v.shape[-1], seq_len=local // 2,
                            stabilizer=stabilizer,
                            bound="blocks", causal=bool(causal), packed=segment_ids is not None,
                            separate_ids=segment_ids is not None, window_or_cap=logits_soft_cap is not None,
                            implementation=implementation, block_sizes=block_sizes,
                            backward_block_sizes=backward_block_sizes, interpret=interpret, platform=platform,
                            softcap=logits_soft_cap)
  if local % 2:
    raise ValueError(f"each device's sequence ({local}) must be two chunks of equal length: make the global "
                     f"sequence a multiple of {2 * shards}")
  if plan.head_dim != q.shape[-1]:
    raise ValueError(f"context parallelism runs kernels at their own head dims; head_dim={q.shape[-1]} would be "
                     f"padded to {plan.head_dim}: use implementation='pallas_gpu' or 'reference'")
  value_head_dim = v.shape[-1]  # MLA: v pads with zero columns to the plan's (none where the kernels take the pair)
  v = api.pad_axis(v, 3, to=plan.value_head_dim)
  static = _Static(plan, axis_name, shards, bool(causal), float(scale) if scale is not None else
                   1.0 / math.sqrt(q.shape[-1]), None if logits_soft_cap is None else float(logits_soft_cap),
                   certificate.default_tau(q.dtype) if tau is None else float(tau), strategy, combine,
                   plan.mode is not plan_lib.Mode.ONLINE, layout)
  ids = None if segment_ids is None else segment_ids.astype(jnp.int32)
  chunk, padded = local // 2, plan.padded(local // 2)
  if padded != chunk:  # each chunk padded to whole blocks; padding keys get segment id 0, which nothing sees
    ids = jnp.ones(q.shape[:2], jnp.int32) if ids is None else ids
    pad = lambda x: jnp.concatenate([api.pad_seq(c, plan.multiple) for c in _split(x)], axis=1)
    q, k, v, ids = (pad(x) for x in (q, k, v, ids))
  out, tiles = _context_parallel(static, q, k, v, ids)
  out = out[..., :value_head_dim]
  if padded != chunk:
    out = jnp.concatenate([c[:, :chunk] for c in _split(out)], axis=1)
  if not return_stats:
    return out
  tiles = jnp.zeros((q.shape[0], q.shape[2], 2 * padded // plan.tile), bool) if tiles is None else tiles
  frac = tiles.astype(jnp.float32)
  return out, AttentionStats(tiles, frac.mean(), frac.mean(axis=(0, 2)))
