"""CLiS attention forward as a Pallas Mosaic TPU kernel.

Splash-attention habits: head-major layout [B, H, S, D]; grid (batch, head, q_block,
kv_block) with the kv blocks on the minor, sequential ("arbitrary") axis; f32 scratch
accumulators that live across that axis; blocks above the causal diagonal are neither
fetched (their index map repeats the last needed block, so no DMA is issued) nor
computed. The per-tile certificate arrives as a scalar-prefetched SMEM table, so each
tile picks the fixed-stabilizer update (no max, no rescale) or the online softmax.
We have no TPU: this kernel is checked in Pallas TPU interpret mode on the CPU.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from clis_kernels import masks
from clis_kernels.common import dot_precision, out_struct
from clis_kernels.plan import Mode, stabilizer_inputs
from clis_kernels.stabilizer import LOG2E, NEG, Certificate, empty_rows, saved_lse, soft_cap


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Forward tiles (block_q, block_k) and backward tiles; multiples of 128 on a real TPU.
  document_ranges: causal packed calls neither fetch nor compute the block pairs where no documents meet
  (masks.segment_block_ranges, scalar-prefetched; splash attention masks them instead). On by default (bit-identical to the full loops in interpret
  mode); not timed on a TPU."""

  block_q: int = 512
  block_k: int = 512
  block_q_dq: int = 512
  block_k_dq: int = 512
  block_q_dkv: int = 512
  block_k_dkv: int = 512
  document_ranges: bool = True

  def __post_init__(self):
    for field in dataclasses.fields(self):
      value = getattr(self, field.name)
      if field.name.startswith("block") and (value < 8 or value & (value - 1)):
        raise ValueError(f"{field.name}={value} must be a power of two >= 8 (128 or more on a real TPU)")

  @property
  def tile(self) -> int:
    return self.block_q

  @property
  def multiple(self) -> int:
    return max(getattr(self, f.name) for f in dataclasses.fields(self) if f.name.startswith("block"))

  @property
  def skip_tiles(self) -> tuple[int, int]:
    """(rows, keys) of a temporal-skipping tile: the forward's tiles."""
    return self.block_q, self.block_k


def default_block_sizes(head_dim: int, seq_len: int, dtype) -> BlockSizes:
  """Large tiles amortise the per-step overhead on TPU; shrunk for short sequences."""
  del head_dim, dtype
  cap = max(128, 1 << (max(seq_len, 1) - 1).bit_length())
  return BlockSizes(*(min(512, cap),) * 6)


def interpret_mode(interpret):
  """pallas_call's `interpret`: a `pltpu.InterpretParams` as given (the TPU interpreter, which simulates VMEM, SMEM
  and each DMA and checks them; several times slower), True for Pallas's plain interpreter (the grid run as XLA
  loops: the same arithmetic, what the tests use), False to compile for the TPU."""
  return interpret if isinstance(interpret, pltpu.InterpretParams) else bool(interpret)


def compiler_params(dimension_semantics: tuple[str, ...], interpret: bool) -> pltpu.CompilerParams:
  """The grid's dimension semantics for the compiler. Interpret mode gets none: JAX 0.11.2's TPU
  interpreter zips them with the grid without the axes `jax.vmap` prepends (the compiled lowering
  accounts for those, mosaic/lowering.py), so `vmap` of an interpreted kernel would fail; without
  semantics it runs the grid in order, which is what it does for "parallel" axes anyway."""
  return pltpu.CompilerParams() if interpret else pltpu.CompilerParams(dimension_semantics=dimension_semantics)



def nt_dot(a, b, precision):
  """a @ b.T in f32 without materialising the transpose."""
  return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=precision,
                             preferred_element_type=jnp.float32)


def tn_dot(a, b, precision):
  """a.T @ b in f32."""
  return jax.lax.dot_general(a, b, (((0,), (0,)), ((), ())), precision=precision,
                             preferred_element_type=jnp.float32)


def nn_dot(a, b, precision):
  return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=precision,
                             preferred_element_type=jnp.float32)


def mask_branches(*, causal, has_segments, kv_len, window=None) -> tuple[bool, ...]:
  """The `masked` values a kernel traces an update for: the masked one only where some block can
  need a mask, since bidirectional, unpacked, unpadded inputs have none (masks.visible gives None)."""
  may_need_mask = causal or has_segments or kv_len is not None or window is not None
  return (False, True) if may_need_mask else (False,)


def block_flags(q_block, kv_block, *, causal, has_segments, kv_len, block_q, block_k, window=None):
  """(runs, needs_mask) for one (q block, kv block) pair of the grid, as traced bools. A local
  window (left, right) skips blocks outside its band and masks those across its edges."""
  first_row = q_block * block_q
  if causal:
    runs = kv_block * block_k <= first_row + block_q - 1
    needs_mask = (kv_block + 1) * block_k - 1 > first_row
  elif kv_len is not None:  # block padding: skip blocks past kv_len, mask the one across it
    runs = kv_block * block_k < kv_len
    needs_mask = (kv_block + 1) * block_k > kv_len
  else:
    runs, needs_mask = jnp.bool_(True), jnp.bool_(False)
  if has_segments:
    needs_mask = jnp.bool_(True)
  if window is not None:
    left, right = window
    last_row, k_first, k_last = first_row + block_q - 1, kv_block * block_k, (kv_block + 1) * block_k - 1
    runs = runs & (k_last >= first_row - left) & (k_first <= last_row + right)
    needs_mask = needs_mask | (k_first < last_row - left) | (k_last > first_row + right)
  return runs, needs_mask


def last_visible_kv_block(q_block, *, causal, kv_len, block_q, block_k, num_kv_blocks):
  """The last kv block q block `q_block` sees; index maps repeat it past there, so no DMA is issued."""
  last = num_kv_blocks - 1 if kv_len is None else (kv_len - 1) // block_k
  if causal:
    return jnp.minimum(last, ((q_block + 1) * block_q - 1) // block_k)
  return last


def first_kv_blocks(segment_ids, *, block_q: int, block_k: int):
  """masks.causal_document_ranges's first kv block per q block, flat [B · S/block_q] for scalar prefetch."""
  return masks.causal_document_ranges(segment_ids, block_q=block_q, block_k=block_k)[0].reshape(-1)


def block_mask(q_block, kv_block, qseg_ref, kseg_ref, *, causal, kv_len, block_q, block_k, window=None):
  """[block_q, block_k] visibility from the shared mask rule (masks.visible)."""
  q_seg = None if qseg_ref is None else qseg_ref[:, 0]
  k_seg = None if kseg_ref is None else kseg_ref[0, :]
  return masks.visible(q_block * block_q + jnp.arange(block_q), kv_block * block_k + jnp.arange(block_k),
                       q_seg, k_seg, causal=causal, kv_len=kv_len, window=window)


def tile_update(s, v, m_scr, l_scr, acc_scr, *, fixed: bool, precision, lse_scr=None):
  """Adds one kv tile (base-2 logits s [bq, bk], values v [bk, D]) to the f32 scratch
  accumulators; returns the stabilizer in force after it ([bq, 1]). lse_scr: where a certified tile sums its
  unrounded weights for lse (stabilizer.py, "Normalisation"), or None."""
  m_prev = m_scr[...]
  if fixed:  # the stabilizer is loop-invariant: no max, no rescale
    p32 = jnp.exp2(s - m_prev)
    p = p32.astype(v.dtype)  # l sums the weights that multiplied V
    l_scr[...] += p.astype(jnp.float32).sum(axis=1, keepdims=True)
    if lse_scr is not None:
      lse_scr[...] += p32.sum(axis=1, keepdims=True)
    acc_scr[...] += nn_dot(p, v, precision)
    return m_prev
  m_new = jnp.maximum(m_prev, s.max(axis=1, keepdims=True))
  alpha = jnp.exp2(m_prev - m_new)
  p = jnp.exp2(s - m_new)
  m_scr[...] = m_new
  l_scr[...] = alpha * l_scr[...] + p.sum(axis=1, keepdims=True)
  acc_scr[...] = alpha * acc_scr[...] + nn_dot(p.astype(v.dtype), v, precision)
  return m_new


def finish(acc_scr, m_scr, l_scr, o_ref, lse_ref, lse_sum=None):
  """o = acc / l and lse = M + log2 l (lse_sum: a certified tile's unrounded sum [bq, 1] instead, or None); rows that
  saw no key get 0 and EMPTY_LSE. Returns (empty [bq, 1], l with 1 on empty rows)."""
  l, m = l_scr[...], m_scr[...]
  empty = empty_rows(l, m)
  l_safe = jnp.where(empty, 1.0, l)
  o_ref[...] = jnp.where(empty, 0.0, acc_scr[...] / l_safe).astype(o_ref.dtype)
  lse_ref[...] = saved_lse(m, l_safe, empty, lse_sum)
  return empty, l_safe


def _fwd_kernel(cert_ref, *refs, has_segments, fixed_mode, causal, sigma2, block_q, block_k, kv_len,
                num_q_blocks, num_kv_blocks, num_heads, precision, window, cap2, doc_ranges=False):
  first_ref, refs = (refs[0], refs[1:]) if doc_ranges else (None, refs)
  q_ref, k_ref, v_ref = refs[:3]
  qseg_ref, kseg_ref = refs[3:5] if has_segments else (None, None)
  m_in_ref, o_ref, lse_ref, acc_scr, m_scr, l_scr = refs[-6 - fixed_mode:len(refs) - fixed_mode]
  lse_scr = refs[-1] if fixed_mode else None  # a certified tile's unrounded sum, for lse
  b, h, i, j = (pl.program_id(a) for a in range(4))
  if fixed_mode:
    certified = cert_ref[(b * num_heads + h) * num_q_blocks + i] != 0
  else:
    certified = jnp.bool_(False)

  @pl.when(j == 0)
  def _init():
    m_scr[...] = jnp.where(certified, m_in_ref[...], NEG)
    l_scr[...] = jnp.zeros_like(l_scr)
    if fixed_mode:
      lse_scr[...] = jnp.zeros_like(lse_scr)
    acc_scr[...] = jnp.zeros_like(acc_scr)

  rule = dict(causal=causal, kv_len=kv_len, window=window)

  def update(masked, fixed):
    s = soft_cap(nt_dot(q_ref[...], k_ref[...], precision) * sigma2, cap2)
    if masked:
      mask = block_mask(i, j, qseg_ref, kseg_ref, block_q=block_q, block_k=block_k, **rule)
      s = jnp.where(mask, s, NEG)
    tile_update(s, v_ref[...], m_scr, l_scr, acc_scr, fixed=fixed, precision=precision, lse_scr=lse_scr)

  runs, needs_mask = block_flags(i, j, has_segments=has_segments, block_q=block_q, block_k=block_k, **rule)
  if doc_ranges:  # blocks before the rows' documents' first key hold none of their keys
    runs = runs & (j >= first_ref[b * num_q_blocks + i])
  for masked in mask_branches(has_segments=has_segments, **rule):
    for fixed in ((False, True) if fixed_mode else (False,)):
      cond = runs & (needs_mask if masked else ~needs_mask) & (certified if fixed else ~certified)
      pl.when(cond)(functools.partial(update, masked, fixed))

  @pl.when(j == num_kv_blocks - 1)
  def _finish():
    finish(acc_scr, m_scr, l_scr, o_ref, lse_ref,
           lse_sum=jnp.where(certified, lse_scr[...], l_scr[...]) if fixed_mode else None)


def to_head_major(x):
  return x.transpose(0, 2, 1, 3)


def segment_operands(segment_ids: masks.SegmentIds):
  """Query ids as [B, Sq, 1] (rows on sublanes) and key ids as [B, 1, Sk] (keys on lanes)."""
  return segment_ids.q[:, :, None], segment_ids.kv[:, None, :]


def forward(q, k, v, segment_ids, stab: Certificate | None, *, mode: Mode, causal, scale, kv_len,
            block_sizes: BlockSizes, window=None, softcap=None, interpret=False):
  """Returns (o [B, S, Hq, D], lse [B, Hq, S] f32 base 2, cert.certified or None).
  mode (plan.Mode): CERTIFICATE or BLOCKS, stab the XLA pre-pass's Certificate; ONLINE, None (this
  kernel does not certify in its prologue: no KEYS). window: local (left, right) or None; softcap:
  c of c·tanh(s / c) or None."""
  if mode is Mode.KEYS:
    raise ValueError("pallas_tpu.forward takes no Mode.KEYS: the plan certifies for it in XLA (Mode.CERTIFICATE)")
  _, cert = stabilizer_inputs(stab, mode)
  batch, seq, num_heads, head_dim = q.shape
  group = num_heads // k.shape[2]
  bq, bk = block_sizes.block_q, block_sizes.block_k
  nq, nk = seq // bq, k.shape[1] // bk  # queries and keys may differ in length (cross-attention)
  fixed_mode = cert is not None
  if fixed_mode:
    m_in, cert_flat = cert.m[..., None], cert.certified.astype(jnp.int32).reshape(-1)
  else:
    m_in, cert_flat = jnp.zeros((batch, num_heads, seq, 1), jnp.float32), jnp.zeros((1,), jnp.int32)

  last_kv = functools.partial(last_visible_kv_block, causal=causal, kv_len=kv_len, block_q=bq, block_k=bk,
                              num_kv_blocks=nk)
  doc_ranges = block_sizes.document_ranges and causal and segment_ids is not None and window is None
  prefetch = [cert_flat]
  kv_block = lambda b, i, j, *refs: jnp.minimum(j, last_kv(i))  # steps outside the range repeat a block: no DMA
  if doc_ranges:
    prefetch.append(first_kv_blocks(segment_ids, block_q=bq, block_k=bk))
    kv_block = lambda b, i, j, c, first: jnp.minimum(jnp.maximum(j, first[b * nq + i]), last_kv(i))

  kv_index = lambda b, h, i, j, *refs: (b, h // group, kv_block(b, i, j, *refs), 0)
  q_index = lambda b, h, i, j, *refs: (b, h, i, 0)
  in_specs = [
      pl.BlockSpec((None, None, bq, head_dim), q_index),
      pl.BlockSpec((None, None, bk, head_dim), kv_index),
      pl.BlockSpec((None, None, bk, head_dim), kv_index),
  ]
  args = [to_head_major(q), to_head_major(k), to_head_major(v)]
  if segment_ids is not None:
    in_specs += [pl.BlockSpec((None, bq, 1), lambda b, h, i, j, *refs: (b, i, 0)),
                 pl.BlockSpec((None, 1, bk), lambda b, h, i, j, *refs: (b, 0, kv_block(b, i, j, *refs)))]
    args += list(segment_operands(segment_ids))
  in_specs.append(pl.BlockSpec((None, None, bq, 1), q_index))
  args.append(m_in)
  kernel = functools.partial(
      _fwd_kernel, has_segments=segment_ids is not None, fixed_mode=fixed_mode, causal=causal,
      sigma2=scale * LOG2E, block_q=bq, block_k=bk, kv_len=kv_len, num_q_blocks=nq, num_kv_blocks=nk,
      num_heads=num_heads, precision=dot_precision(q.dtype), window=window,
      cap2=None if softcap is None else softcap * LOG2E, doc_ranges=doc_ranges)
  o, lse = pl.pallas_call(
      kernel,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=len(prefetch),
          grid=(batch, num_heads, nq, nk),
          in_specs=in_specs,
          out_specs=[pl.BlockSpec((None, None, bq, head_dim), q_index), pl.BlockSpec((None, None, bq, 1), q_index)],
          scratch_shapes=[pltpu.VMEM((bq, head_dim), jnp.float32)] + [pltpu.VMEM((bq, 1), jnp.float32)] * (
              2 + fixed_mode)),
      out_shape=[out_struct((batch, num_heads, seq, head_dim), q.dtype, q),
                 out_struct((batch, num_heads, seq, 1), jnp.float32, q)],
      compiler_params=compiler_params(("parallel", "parallel", "parallel", "arbitrary"), interpret),
      interpret=interpret_mode(interpret),
      name="clis_fwd_tpu" if fixed_mode else "online_fwd_tpu",
  )(*prefetch, *args)
  return to_head_major(o), lse[..., 0], None if cert is None else cert.certified
