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
band's blocks and masks its edge blocks (masks.window_full_blocks); a soft cap caps Q·Kᵀ before the mask
(`pallas_mgpu_mainloop.cap_tanh`); learned sinks join the rows' sums in the epilogue (`_add_sink`).
Layout: q [B, S, Hq, D], k [B, S, Hkv, D], v [B, S, Hkv, Dv] (the API's; Dv = D, or MLA's 192/128 natively:
SPLIT_HEAD_DIMS); lse [B, Hq, S] f32 base 2, as both backwards expect (pallas_mgpu_vjp, the default, and
pallas_gpu_vjp's Triton one).

The kernel in three modules: this one (the op: tiles, checks, `forward`, `forward_listed`, `_launch`);
pallas_mgpu_kernel.py (`Config`, `Refs`, the scratch tuples, `Rows`; `kernel` → `_compute_warpgroup`, the prologue →
`_certify_here` or `_read_certificate`); pallas_mgpu_mainloop.py (`attend` → `_step` / `_overlapped_step` per KV
block, `_drain` → `_epilogue`). The memory warpgroup runs mgpu_pipeline.stream_kv. `forward_listed` (temporal
skipping, kernels/clis_kernels/diffusion) runs the same kernel over a kept-tile list per CTA and can write each
visited block's row maxima.
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

from clis_kernels import masks
from clis_kernels.common import out_struct
from clis_kernels.mgpu_pipeline import COMPUTE_WARPGROUPS, MAX_NAMED_SLOTS, RANGE_WIDTH, NamedBarriers, compiler_params
from clis_kernels.pallas_mgpu_kernel import FAILED_TILE_M, Config, kernel, list_shape
from clis_kernels.pallas_mgpu_mainloop import SUM_COLUMNS, TANHS
from clis_kernels.plan import Mode, stabilizer_inputs
from clis_kernels.stabilizer import LOG2E, Certificate, KeyBounds

HEAD_DIMS = (64, 128, 256)
# Head dims whose CTA fits the in-kernel certificate's scratch (Mode.KEYS): at 256 the Q, K and V slots alone take
# 192 KiB of shared memory at block_kv 64, so the plan (plan.mode_of reads this) certifies there with an XLA pre-pass.
KEYS_MAX_HEAD_DIM = 128
WIDE_HEAD_BLOCK_KV = 64  # block_kv above head dim 128: two 128-key slots of K and V overflow shared memory
# (q·k, v) head dims the kernels take without padding v up to q·k's: MLA's (DeepSeek V3, Kimi). The output goes out
# through q's bytes (a RefUnion), so 128-key blocks fit: Q 48 KiB, K 96 KiB, V 64 KiB.
SPLIT_HEAD_DIMS = ((192, 128),)
DTYPES = (jnp.bfloat16, jnp.float16)


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
  soft_cap_tanh: how logits_soft_cap's tanh is computed (`pallas_mgpu_mainloop.cap_tanh`): "approx" (tanh.approx.f32,
  one instruction) or "exp2" (from ex2 and rsqrt, float32-accurate); the backward's BlockSizes has the same field,
  and both should agree.
  heads_per_cta: query heads of one GQA group a CTA walks one after another (the online loop only): the memory
  warpgroup streams the same K/V blocks for each, and each head's q tile is loaded while the one before runs. For
  calls with few KV blocks per CTA, where a CTA's fixed costs (launch, first loads, the epilogue's store) are not
  hidden behind its loop. None (default): `auto_heads_per_cta`. Head dims up to HEADS_PER_CTA_MAX_HEAD_DIM.
  one_memory_warp: only the memory warpgroup's first warp streams the K/V blocks (mgpu_pipeline.stream_blocks), as
  tokamax's forward does; the other three then issue nothing on the schedulers they share with the compute warps. H200,
  2026-12-04, causal GQA 32/8 D 128, online: forward 1.018 / 1.017x four streaming warps at 8k / 32k (ncu at 8k: 281.5M
  instructions issued with four, tokamax's 263.4M with equal step loops); the certified loop within ±1%; the same
  in the backward's kernels measured ~1% slower, so they keep four (BENCHMARKS.md §1). `forward_listed` keeps four:
  its steps read the kept-tile list from shared memory, a load Mosaic GPU refuses inside per-warp code.
  named_barriers: the warpgroups' turns and the K/V slots' release on hardware named barriers (`bar.arrive` /
  `bar.sync`, mgpu_pipeline.NamedBarriers), as FA3 and tokamax's forward do, instead of mbarriers: per step one
  arrive and one sync for the turn (not two mbarrier arrives and two waits) and one arrive per slot released. True
  needs pingpong, one_memory_warp, one head per CTA and no kept-tile list; None (default): `auto_named_barriers`.
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
  named_barriers: bool | None = None

  def __post_init__(self):
    if self.named_barriers and not (self.pingpong and self.one_memory_warp and self.heads_per_cta in (None, 1)):
      raise ValueError(f"named_barriers=True needs pingpong=True, one_memory_warp=True and heads_per_cta 1 or None "
                       f"(got {self.pingpong=}, {self.one_memory_warp=}, {self.heads_per_cta=}): its barriers count "
                       "the two compute warpgroups and one streaming warp, once per head")
    if self.named_barriers:
      NamedBarriers.for_slots(self.slots)  # raises when the slots' barriers do not fit
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
# heads_per_cta keeps two q tiles per compute warpgroup (the next head's loads during this one's loop); at 256 they
# (2 · 2 · 64 · 256 · 2 bytes) do not fit beside K and V. A form without that prefetch hung on an H100 at 256
# (2026-12-07), most likely in the causal drain (pallas_mgpu_mainloop._drain, fixed since); it was withdrawn, not rebuilt.
HEADS_PER_CTA_MAX_HEAD_DIM = 128


def auto_heads_per_cta(*, mode: str, group: int, window, listed: bool, split_dims: bool, head_dim: int) -> int:
  """The default heads_per_cta: the largest divisor of the GQA group up to 8 for online calls with a window at most
  HEADS_PER_CTA_WINDOW keys wide, else 1. H200, 2026-12-03 (BENCHMARKS.md §1): window 128 at GQA 64/8 D 64, forward
  1.32× / 1.38× one head per CTA at 8 heads (8k / 32k rows); window 1024 at GQA 32/8 D 128, 1.07× / 1.03× at 4;
  window 4096 and plain causal 2k rows: within ±4%, so they keep one. Head dims above HEADS_PER_CTA_MAX_HEAD_DIM keep
  one."""
  if (mode != "online" or listed or split_dims or head_dim > HEADS_PER_CTA_MAX_HEAD_DIM or window is None
      or sum(window) + 1 > HEADS_PER_CTA_WINDOW):
    return 1
  return max(n for n in range(1, HEADS_PER_CTA_MAX + 1) if group % n == 0)


NAMED_BARRIERS_HEAD_DIM = 256  # auto_named_barriers: the head dim whose forward measured faster with them


def auto_named_barriers(bs: BlockSizes, *, head_dim: int, value_head_dim: int, heads: int, listed: bool) -> bool:
  """The default named_barriers: on at head dim 256 (q and v alike) where the call fits them (ping-pong, one
  streaming warp, one head per CTA, no kept-tile list, at most 5 slots), else off. H100, 2026-12-08, two runs
  (BENCHMARKS.md §1, "Named barriers as the default at head dim 256"), against mbarriers at 8k / 32k: causal D 256
  online 1.026-1.027 / 1.023-1.038x, certified 1.018-1.032 / 0.997-1.002x; Gemma 2's local layer (cap 50, window
  4096) online 1.023-1.025 / 0.999-1.013x, cap bound 1.024-1.027 / 1.010-1.014x. D 128 within ±1% (2026-12-07),
  so it keeps mbarriers."""
  fits = bs.pingpong and bs.one_memory_warp and heads == 1 and not listed and bs.slots <= MAX_NAMED_SLOTS
  return fits and head_dim == value_head_dim == NAMED_BARRIERS_HEAD_DIM


def _check_heads_per_cta(c: Config, q, v):
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
  if q.shape[-1] > HEADS_PER_CTA_MAX_HEAD_DIM:
    raise ValueError(f"heads_per_cta={c.heads} takes head dims up to {HEADS_PER_CTA_MAX_HEAD_DIM} (got {q.shape[-1]}: "
                     "two q tiles per warpgroup do not fit beside K and V there): use heads_per_cta=1")


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
  config = Config(
      mode=mode, causal=causal, sigma2=scale * LOG2E, block_q=bs.block_q, block_kv=bs.block_kv,
      slots=min(bs.slots, num_kv_blocks), kv_len=kv_len, group=num_heads // k.shape[2],
      has_segments=segment_ids is not None, row_centres=row_centres, pingpong=bs.pingpong, overlap=bs.overlap,
      exact_sum=bs.exact_sum, tc_sum=bs.sum_on_tensor_cores and mode != "online", listed=visit is not None,
      lse_sum=bs.exact_lse and bs.exact_sum and mode != "online",
      track=track and visit is not None, list_width=0 if visit is None else visit.shape[-1],
      doc_ranges=bs.document_ranges and causal and segment_ids is not None and visit is None and window is None,
      window=None if window is None else tuple(int(w) for w in window),
      cap2=None if softcap is None else float(softcap) * LOG2E, tanh=bs.soft_cap_tanh, sinks=sinks is not None,
      one_memory_warp=bs.one_memory_warp, named=bs.named_barriers is True)
  if config.named and config.listed:
    raise ValueError("named_barriers=True takes no kept-tile list (forward_listed streams with four warps): "
                     "use named_barriers=False")
  heads = bs.heads_per_cta
  if heads is None and config.named:
    heads = 1
  elif heads is None:
    heads = auto_heads_per_cta(mode=mode, group=config.group, window=config.window, listed=config.listed,
                               split_dims=q.shape[-1] != v.shape[-1], head_dim=q.shape[-1])
  named = config.named if bs.named_barriers is not None else auto_named_barriers(
      bs, head_dim=q.shape[-1], value_head_dim=v.shape[-1], heads=heads, listed=config.listed)
  config = dataclasses.replace(config, heads=heads, named=named)
  if config.heads > 1:
    _check_heads_per_cta(config, q, v)
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
    args.append(visit.astype(jnp.int32).reshape(visit.shape[:3] + list_shape(visit.shape[-1])))
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
      functools.partial(kernel, config=config),
      out_type=tuple(out_type),
      grid=(num_heads // config.heads, seq // (COMPUTE_WARPGROUPS * bs.block_q), batch),
      grid_names=("heads", "q_tiles", "batch"),
      num_threads=COMPUTE_WARPGROUPS + 1,
      thread_name="wg",
      compiler_params=compiler_params(),
      kernel_name="clis_mgpu_fwd_listed" if config.listed else "clis_mgpu_fwd",  # what ncu and nsys show
  )(*args)
  o, lse = outs[:2]
  rowmax = outs[-1] if config.track else None
  if mode == "keys":
    return o, lse, outs[2].reshape(batch, num_heads, seq // bs.tile, bs.tile)[..., 0] > 0.5, rowmax
  return o, lse, None if cert is None else cert.certified, rowmax

