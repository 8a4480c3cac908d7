"""One plan per attention call: which backend entry runs it (forward, backward, and the skip forward
for temporal tile skipping), with which tiles, padded to what, in which stabilizer mode.

Every caller (`attention`, `diffusion.attention`, the example sampler, the benchmarks, the trainer)
reaches a kernel through `make_plan`; nothing else decides a backend. The registry is ordered by
priority: `implementation=None` takes the first entry that supports the call (and runs it online where that
entry's certified loop does not pay: `certifies_by_default`), and a named entry that cannot run it says why.
The platform is a parameter (`Platform.detect()` by default), so a test plans for an H200 on a CPU without
patching anything.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import importlib
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp


class Mode(enum.Enum):
  """Where a call's stabilizer comes from; each kernel runs the loop its mode names."""

  ONLINE = "online"  # flash attention's online softmax everywhere (stabilizer="online")
  KEYS = "keys"  # the kernel certifies each tile in its prologue from stabilizer.KeyBounds
  CERTIFICATE = "certificate"  # an XLA pre-pass (stabilizer.certify_rows) certified each tile
  BLOCKS = "blocks"  # an XLA pre-pass with the block bound (stabilizer.certify_blocks)
  CAP = "cap"  # the soft cap bounds every logit: M from the cap and max |v| alone (stabilizer.certify_cap)


def stabilizer_inputs(stab, mode: Mode):
  """(keys, cert) a kernel takes in `mode`: stabilizer.KeyBounds for KEYS, a stabilizer.Certificate for
  CERTIFICATE and BLOCKS, neither for ONLINE; anything else is an error naming what was expected."""
  from clis_kernels import stabilizer  # the math module; plan.py itself stays free of kernels' imports
  want = {Mode.KEYS: stabilizer.KeyBounds, Mode.CERTIFICATE: stabilizer.Certificate,
          Mode.BLOCKS: stabilizer.Certificate, Mode.CAP: stabilizer.Certificate, Mode.ONLINE: type(None)}[Mode(mode)]
  if not isinstance(stab, want):
    raise ValueError(f"{mode=} takes the stabilizer as {want.__name__}; got {type(stab).__name__}")
  return (stab, None) if mode is Mode.KEYS else (None, stab)


@dataclasses.dataclass(frozen=True)
class Platform:
  name: str  # "cpu" | "gpu" | "tpu"
  hopper: bool = False  # an NVIDIA GPU of compute capability 9 (H100, H200)

  @classmethod
  def detect(cls) -> Platform:
    device = jax.devices()[0]
    return cls(device.platform, str(getattr(device, "compute_capability", "")).startswith("9"))


HOPPER = Platform("gpu", hopper=True)


class Backend(NamedTuple):
  """An entry's functions and tunables, imported when a plan first needs them."""

  forward: Callable
  backward: Callable
  block_sizes_type: type
  default_block_sizes: Callable[[int, int, Any], Any]
  backward_block_sizes_type: type
  default_backward_block_sizes: Callable[..., Any]  # (head_dim, seq_len, dtype, *, softcap)
  skip_forward: Callable | None
  row_bounds: Any  # the block bound's (U, L) kernel module (supports, row_bounds), or None: XLA


@dataclasses.dataclass(frozen=True)
class Entry:
  """A backend in the registry. forward/backward/skip: 'module' or 'module:function' under clis_kernels;
  a module provides BlockSizes and default_block_sizes (and padded_head_dim, split_head_dims, supports,
  takes_head_dims, if it needs)."""

  name: str
  priority: int  # implementation=None: the highest-priority entry that supports the call
  platforms: tuple[str, ...]  # where it runs compiled; Pallas entries also run interpreted anywhere
  forward: str
  backward: str
  certifies_in_kernel: bool  # takes KeyBounds and certifies each tile itself (Mode.KEYS)
  interpretable: bool = True  # runs in Pallas interpret mode
  hopper_only: bool = False
  skip: str | None = None  # the temporal-skipping forward (kernels/clis_kernels/diffusion), if it has one
  automatic: bool = True  # may implementation=None pick it
  backward_tiles: str | None = None  # 'module' or 'module:heuristic' with the backward's BlockSizes (None: the forward's)
  row_bounds: str | None = None  # module of the block bound's (U, L) kernel (Mode.BLOCKS), None: XLA
  certifies_by_default: bool = True  # implementation=None certifies on it (False: runs online, where it does not pay)
  blocks_from: int | None = None  # bound=None: the block bound from this many keys on (its kernel pays), else radius
  folds_sinks: bool = False  # its forward takes sinks= and adds them in its epilogue (else stabilizer.fold_sinks)

  def supports(self, call: Call, platform: Platform, *, automatic: bool = False) -> str | None:
    """None when this entry can run the call, else why not, phrased to follow its name. automatic:
    also ask the kernel module's `supports(dtype, head_dim)` (a named entry's kernel raises its own
    error for inputs it does not take)."""
    if not isinstance(call.interpret, bool) and self.name != "pallas_tpu":
      return (f"takes interpret=True or False; got {type(call.interpret).__name__} (a pltpu.InterpretParams is for "
              "implementation='pallas_tpu')")
    if call.interpret and not self.interpretable:
      return "has no interpret mode; use implementation='pallas_gpu' with interpret=True to run the GPU kernels " \
             "on a CPU"
    if not call.interpret and platform.name not in self.platforms:
      return (f"needs a {'/'.join(self.platforms).upper()} device but this platform is {platform.name!r}: pass "
              "interpret=True to run it in Pallas interpret mode, or implementation='reference'")
    if self.hopper_only and not call.interpret and not platform.hopper:
      return "needs an NVIDIA Hopper GPU (H100, H200); use implementation='pallas_gpu'"
    backward = _module(self.backward)
    takes = getattr(backward, "takes_head_dims", None)  # a backward's limit, where it has one
    if takes is not None and not takes(*self.head_dims(call.head_dim, call.value_head_dim)):
      return (f"takes head dims up to {backward.MAX_HEAD_DIM}, {getattr(backward, 'WIDE_HEAD_DIMS', ())} and the "
              f"(q·k, v) pairs {backward.SPLIT_HEAD_DIMS}; "
              f"got head_dim={call.head_dim} with v's {call.value_head_dim or call.head_dim}: use "
              "implementation='pallas_mgpu_triton_bwd' on Hopper (the Mosaic GPU forward, the Triton backward) or "
              "'pallas_gpu'")
    if call.skipping and self.skip is None:
      return ("has no temporal-skipping forward (kernels/clis_kernels/diffusion); use 'pallas_mgpu', 'pallas_gpu', 'pallas_tpu' "
              "or 'reference'")
    check = getattr(_module(self.forward), "supports", None)
    if automatic and check is not None and not check(call.dtype, call.head_dim):
      return f"does not take dtype {jnp.dtype(call.dtype).name} with head_dim {call.head_dim}"
    return None

  def head_dims(self, head_dim: int, value_head_dim: int | None = None) -> tuple[int, int]:
    """(q·k, v) head dims the kernels run at, the API padding with zero columns up to them: a pair the forward
    module's `split_head_dims` gives and the backward module's `takes_head_dims` accepts (MLA's 192/128 on
    Hopper), else both at the forward's `padded_head_dim` of the wider (zero v columns are cut off the output)."""
    value_head_dim = head_dim if value_head_dim is None else value_head_dim
    forward, backward = _module(self.forward), _module(self.backward)
    split, takes = getattr(forward, "split_head_dims", None), getattr(backward, "takes_head_dims", None)
    pair = None if value_head_dim == head_dim or split is None or takes is None else split(head_dim, value_head_dim)
    if pair is not None and takes(*pair):
      return pair
    width = getattr(forward, "padded_head_dim", lambda d: d)(max(head_dim, value_head_dim))
    return width, width

  def load(self) -> Backend:
    tiles = self.backward_tiles or self.forward
    fwd, bwd = _module(self.forward), _module(tiles)
    return Backend(_function(self.forward, "forward"), _function(self.backward, "backward"), fwd.BlockSizes,
                   fwd.default_block_sizes, bwd.BlockSizes, _function(tiles, "default_block_sizes"),
                   None if self.skip is None else _function(self.skip, "forward"),
                   None if self.row_bounds is None else _module(self.row_bounds))


def _module(path: str):
  return importlib.import_module(f"clis_kernels.{path.partition(':')[0]}")


def _function(path: str, default: str):
  name = path.partition(":")[2] or default
  return getattr(_module(path), name)


# On Hopper implementation=None runs the online loop: the certified Mosaic GPU forward, with the unrounded lse sum
# that makes it as accurate as the online path, measured slower than our online loop in every cell of one H200 run
# per shape on sink-shaped inputs (BENCHMARKS.md §3, 2026-12-03): D 128, 16k-64k, 0.94-0.98x (causal and
# bidirectional); D 64, 8k-32k, 0.88-0.998x; D 256, 32k, 0.95-0.96x; a 4096-key window, causal 32k, 0.96x. Saving
# lse from the rounded sum instead reached only 0.99-1.06x at D 128 and 0.94-1.02x at D 64, so no length or
# head-dim rule pays either.
# Nor where no pre-pass is needed: with Gemma 2's soft cap 50 the cap alone certifies (bound="cap"), and the
# certified loop measured 0.90 / 0.92x online at D 128 (8k / 32k; 0.98x with the rounded sum on the tensor cores) and
# 0.98 / 1.01x at D 256 with a 4096 window (BENCHMARKS.md §1, "the soft cap's own bound", 2026-12-03).
# Naming the backend (implementation="pallas_mgpu", the trainer's clis_mgpu) certifies at every length.
CERTIFY_ON_HOPPER = False
# From this many keys the block bound pays on Gaussian and pretrained-like inputs alike (BENCHMARKS.md,
# issue 16); bound=None takes it there where its kernel takes the call, the radius below.
BLOCKS_FROM_MGPU = 16384

# The TPU takes the block bound at every length: its (U, L) pre-pass (stabilizer.certify_blocks in XLA) is
# matmul-shaped work for the MXU, and the one-radius bound certifies no tile of inputs with sinks or outlier
# channels (tests/test_pallas_tpu.py, interpret mode), where a sound bound that fails is pure loss. Not timed on a
# TPU (none here).
BLOCKS_FROM_TPU = 0

REGISTRY: tuple[Entry, ...] = (
    Entry("pallas_mgpu", 30, ("gpu",), "pallas_mgpu", "pallas_mgpu_vjp", True, interpretable=False,
          hopper_only=True, backward_tiles="pallas_mgpu_vjp", row_bounds="pallas_gpu_bounds",
          certifies_by_default=CERTIFY_ON_HOPPER, blocks_from=BLOCKS_FROM_MGPU, skip="diffusion.pallas_mgpu_skip",
          folds_sinks=True),
    Entry("pallas_mgpu_triton_bwd", 25, ("gpu",), "pallas_mgpu", "pallas_gpu_vjp", True, interpretable=False,
          hopper_only=True, backward_tiles="pallas_gpu:hopper_block_sizes", row_bounds="pallas_gpu_bounds",
          certifies_by_default=CERTIFY_ON_HOPPER, blocks_from=BLOCKS_FROM_MGPU, folds_sinks=True),
    Entry("pallas_gpu", 20, ("gpu",), "pallas_gpu", "pallas_gpu_vjp", True, skip="diffusion.pallas_gpu_skip",
          row_bounds="pallas_gpu_bounds"),
    Entry("pallas_tpu", 20, ("tpu",), "pallas_tpu", "pallas_tpu_vjp", False, skip="diffusion.pallas_tpu_skip",
          blocks_from=BLOCKS_FROM_TPU),
    Entry("reference", 0, ("cpu", "gpu", "tpu"), "reference", "reference", False,
          skip="diffusion.tile_lists:reference_forward"),  # pure JAX: interpret=True changes nothing
)
ENTRIES = {e.name: e for e in REGISTRY}
IMPLEMENTATIONS = (*ENTRIES, "xla")


@dataclasses.dataclass(frozen=True)
class Call:
  """What the choice of an entry depends on."""

  dtype: Any
  head_dim: int
  window_or_cap: bool = False
  skipping: bool = False
  interpret: Any = False  # bool, or a pltpu.InterpretParams (pallas_tpu only)
  value_head_dim: int | None = None  # v's head dim where it differs from q·k's (MLA), else None


def choose(implementation: str | None, call: Call, platform: Platform) -> Entry:
  """The entry that runs `call`: the named one (an error saying why it cannot), or by priority."""
  if implementation is None:
    for entry in sorted((e for e in REGISTRY if e.automatic), key=lambda e: -e.priority):
      if entry.supports(dataclasses.replace(call, interpret=False), platform, automatic=True) is None:
        return entry
    return ENTRIES["reference"]
  if implementation not in ENTRIES:
    raise ValueError(f"{implementation=} is not one of {IMPLEMENTATIONS} (or None for automatic)")
  entry = ENTRIES[implementation]
  reason = entry.supports(call, platform)
  if reason is not None:
    raise ValueError(f"{implementation=} {reason}")
  return entry


@dataclasses.dataclass(frozen=True)
class Plan:
  """Everything decided before a kernel runs (hashable: the custom_vjp closes over it)."""

  entry: Entry
  mode: Mode
  block_sizes: Any  # the forward's
  backward_block_sizes: Any
  head_dim: int  # q·k's, as the kernels run it (the API zero-pads up to it)
  multiple: int  # sequence lengths are padded to a multiple of this
  tile: int  # query rows per certificate tile
  interpret: Any  # bool, or pallas_tpu's pltpu.InterpretParams
  value_head_dim: int  # v's and the output's, as the kernels run it (head_dim unless the entry takes a split pair)

  @property
  def backend(self) -> Backend:
    return self.entry.load()

  def padded(self, length: int) -> int:
    return -(-length // self.multiple) * self.multiple

  def row_bounds_kernel(self, *, causal: bool, packed: bool, window, separate_ids: bool, same_length: bool):
    """Mode.BLOCKS: the entry's kernel for the block bound's (U, L) where it takes the call, else None
    (stabilizer.block_row_bounds in XLA)."""
    module = self.backend.row_bounds
    if module is None or not module.supports(causal=causal, packed=packed, window=window, separate_ids=separate_ids,
                                             same_length=same_length, multiple=self.multiple, head_dim=self.head_dim):
      return None
    return functools.partial(module.row_bounds, interpret=self.interpret)


def mode_of(stabilizer: str, *, bound: str, granularity: str, separate_ids: bool, entry: Entry,
            head_dim: int = 0) -> Mode:
  """Online; the block bound's pre-pass; the kernel's own certificate (radius bound, per tile,
  one segment_ids array, a head dim its scratch fits); else the XLA certificate."""
  if stabilizer == "online":
    return Mode.ONLINE
  if bound == "blocks":
    return Mode.BLOCKS
  if bound == "cap":
    return Mode.CAP
  keys_max = getattr(_module(entry.forward), "KEYS_MAX_HEAD_DIM", None)  # where the kernel's scratch stops fitting
  in_kernel = entry.certifies_in_kernel and (keys_max is None or head_dim <= keys_max)
  if granularity == "head" or separate_ids or not in_kernel:
    return Mode.CERTIFICATE
  return Mode.KEYS


def automatic_bound(entry: Entry, *, seq_len: int, causal: bool, packed: bool, separate_ids: bool,
                    window_or_cap: bool, cap_certifies: bool = False) -> str:
  """bound=None: "cap" where the soft cap alone certifies (stabilizer.cap_certifies: no pre-pass at all), else
  "blocks" from the entry's `blocks_from` keys on where its (U, L) kernel takes the call (no window or cap, one
  segment_ids, not bidirectional packed), else "radius"."""
  if cap_certifies:
    return "cap"
  kernel_takes = not (window_or_cap or separate_ids or (packed and not causal))
  if entry.blocks_from is not None and seq_len >= entry.blocks_from and kernel_takes:
    return "blocks"
  return "radius"


def make_plan(*, dtype, head_dim: int, seq_len: int, value_head_dim: int | None = None, stabilizer: str = "clis",
              bound: str | None = None,
              causal: bool = True, packed: bool = False,
              granularity: str = "tile", separate_ids: bool = False, window_or_cap: bool = False,
              skipping: bool = False, implementation: str | None = None,
              block_sizes=None,
              backward_block_sizes=None, interpret=False, platform: Platform | None = None,
              softcap: float | None = None, tau: float | None = None) -> Plan:
  """The plan for one call. seq_len: the longer of the query and key lengths (tile heuristics and
  the block bound's length rule); value_head_dim: v's head dim where it differs from q·k's (MLA), else None;
  bound None: `automatic_bound`, which reads causal and packed (segment ids given), and the soft cap against τ
  (None: stabilizer.default_tau of dtype)."""
  from clis_kernels import stabilizer as stabilizer_math
  from jax.experimental.pallas import tpu as pltpu
  interpret = interpret if isinstance(interpret, pltpu.InterpretParams) else bool(interpret)
  platform = Platform.detect() if platform is None else platform
  value_head_dim = None if value_head_dim == head_dim else value_head_dim
  call = Call(jnp.dtype(dtype), head_dim, window_or_cap, skipping, interpret, value_head_dim)
  entry = choose(implementation, call, platform)
  backend = entry.load()
  padded_head, padded_value = entry.head_dims(head_dim, value_head_dim)
  if block_sizes is None:  # the tile heuristics see the head dim the kernels run at (MLA's 192 is not 256)
    block_sizes = backend.default_block_sizes(padded_head, seq_len, dtype)
  elif not isinstance(block_sizes, backend.block_sizes_type):
    raise ValueError(f"block_sizes for implementation={entry.name!r} must be "
                     f"{backend.block_sizes_type.__module__}.BlockSizes; got {type(block_sizes).__name__}")
  if backward_block_sizes is None:
    backward_block_sizes = (block_sizes if backend.backward_block_sizes_type is backend.block_sizes_type
                            else backend.default_backward_block_sizes(padded_head, seq_len, dtype, softcap=softcap))
  elif not isinstance(backward_block_sizes, backend.backward_block_sizes_type):
    raise ValueError(f"backward_block_sizes for implementation={entry.name!r} must be "
                     f"{backend.backward_block_sizes_type.__module__}.BlockSizes; got "
                     f"{type(backward_block_sizes).__name__}")
  if bound is None:
    tau = stabilizer_math.default_tau(dtype) if tau is None else tau
    bound = automatic_bound(entry, seq_len=seq_len, causal=causal, packed=packed, separate_ids=separate_ids,
                            window_or_cap=window_or_cap, cap_certifies=stabilizer_math.cap_certifies(softcap, tau))
  if implementation is None and not entry.certifies_by_default:
    stabilizer = "online"  # the automatic choice: this entry's certified loop does not pay
  mode = mode_of(stabilizer, bound=bound, granularity=granularity, separate_ids=separate_ids, entry=entry,
                 head_dim=padded_head)
  multiple = max(block_sizes.multiple, backward_block_sizes.multiple)
  return Plan(entry, mode, block_sizes, backward_block_sizes, padded_head, multiple, block_sizes.tile, interpret,
              padded_value)
