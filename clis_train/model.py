"""A Llama-style decoder in Flax: RMSNorm, RoPE, SwiGLU, GQA. Read top to bottom.

The attention options of the other popular families ride on the same blocks: an explicit head dim
(Gemma: 256), a value head dim other than the q·k one (MLA's shapes: 192 / 128), a logits soft cap and a
final-logits cap (Gemma 2), a sliding window on some or all layers (Mistral, Gemma 2/3, gpt-oss) and learned
per-head sink logits (gpt-oss). `block="gemma2"` is Gemma 2's block: norms after attention and after the MLP too,
a GeGLU MLP (tanh GELU), embeddings scaled by sqrt(dim), and q·k scaled by query_pre_attn_scalar^-1/2; "gemma3" is
the same block, with QK norms (`qk_norm`) and its windowed layers' own RoPE base (`local_rope_theta`);
`qkv_bias` adds Qwen 2's q, k and v biases and `qk_norm` Qwen 3's RMSNorm of each q and k head. The other families'
MLPs and norms stay Llama's: their presets take their attention's shape.

Parameters are float32 (master weights); activations run in `dtype` (bf16 by default).
Attention has one call site, `Attention.__call__`, which calls the function the trainer
built from `attention:` (clis_train/attention.py); its post-RoPE q, k, v are sown into the
"activations" collection, which costs nothing unless an analysis applies the model with it mutable.
Layout: tokens [B, S] int32; positions and segment_ids [B, S] from packing (segment 0 = padding).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from clis_train.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class ModelDims:
  vocab_size: int
  dim: int
  n_layers: int
  n_heads: int
  n_kv_heads: int
  ffn_dim: int
  rope_theta: float = 500000.0
  norm_eps: float = 1e-5
  tie_embeddings: bool = False
  qk_head_dim: int | None = None  # None: dim // n_heads
  v_head_dim: int | None = None  # None: the q·k head dim (MLA: q·k 192, v 128)
  attn_soft_cap: float | None = None  # attention logits become c·tanh(s / c) (Gemma 2: 50)
  final_soft_cap: float | None = None  # the output logits too (Gemma 2: 30)
  sliding_window: int | None = None  # local layers: each query sees this many keys, itself included (Hugging
                                     #   Face's sliding_window, as Mistral, Gemma 2/3 and gpt-oss configs give it)
  global_every: int | None = None  # with a window: layers global_every, 2·global_every, ... (1-based) see every
                                   #   key (Gemma 2, gpt-oss: 2; Gemma 3: 6); None: every layer is local
  sinks: bool = False  # a learned sink logit per query head (gpt-oss): one more term in the softmax's denominator
  rope_scaling: tuple[float, float, float, float] | None = None  # Llama 3.1+'s: (factor, low_freq_factor,
                                                                 #   high_freq_factor, original_max_positions)
  block: str = "llama"  # llama | gemma2 | gemma3 (BLOCKS)
  query_pre_attn_scalar: float | None = None  # q·k scaled by its −1/2 power instead of the head dim's (Gemma 2)
  qkv_bias: bool = False  # biases on the q, k and v projections (Qwen 2)
  qk_norm: bool = False  # an RMSNorm over each q and k head before RoPE (Qwen 3, Gemma 3)
  local_rope_theta: float | None = None  # RoPE base of the windowed layers (Gemma 3: 10,000); None: rope_theta
  rope_linear_factor: float | None = None  # positions ÷ this in the RoPE of layers that see every key (Gemma 3 4B+)

  @property
  def head_dim(self) -> int:
    """The q·k head dim."""
    return self.qk_head_dim or self.dim // self.n_heads

  @property
  def kind(self) -> "BlockKind":
    """What `block` changes in the layers (BLOCKS)."""
    return BLOCKS[self.block]

  @property
  def value_dim(self) -> int:
    return self.v_head_dim or self.head_dim

  def layer_window(self, layer: int) -> int | None:
    """Keys before each query that layer `layer` (0-based) sees (the attention's left window: sliding_window − 1);
    None: all of them."""
    if self.sliding_window is None or (self.global_every and (layer + 1) % self.global_every == 0):
      return None
    return self.sliding_window - 1

  def layer_rope(self, layer: int) -> tuple:
    """(theta, Llama 3 scaling, linear factor) of layer `layer`'s RoPE: windowed layers take local_rope_theta
    unscaled when it is set (Gemma 3), every other layer rope_theta with the scalings."""
    if self.local_rope_theta is not None and self.layer_window(layer) is not None:
      return self.local_rope_theta, None, None
    return self.rope_theta, self.rope_scaling, self.rope_linear_factor

  def num_params(self) -> int:
    hd, vd = self.head_dim, self.value_dim
    attn = self.dim * (hd * (self.n_heads + self.n_kv_heads) + vd * (self.n_kv_heads + self.n_heads))
    norms = 4 if self.kind.sandwich_norms else 2
    extra = (hd * (self.n_heads + self.n_kv_heads) + vd * self.n_kv_heads if self.qkv_bias else 0) + (
        2 * hd if self.qk_norm else 0) + (self.n_heads if self.sinks else 0)
    layer = attn + 3 * self.dim * self.ffn_dim + norms * self.dim + extra
    embed = self.vocab_size * self.dim * (1 if self.tie_embeddings else 2)
    return self.n_layers * layer + embed + self.dim


PRESETS = {
    "tiny": ModelDims(vocab_size=384, dim=128, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=384,
                      rope_theta=10000.0, tie_embeddings=True),
    "small": ModelDims(vocab_size=32000, dim=768, n_layers=12, n_heads=12, n_kv_heads=4, ffn_dim=2048),
    "1b": ModelDims(vocab_size=128256, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192,
                    tie_embeddings=True, rope_scaling=(32.0, 1.0, 4.0, 8192.0)),  # Llama-3.2-1B's
    "3b": ModelDims(vocab_size=128256, dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, ffn_dim=8192,
                    tie_embeddings=True, rope_scaling=(32.0, 1.0, 4.0, 8192.0)),  # Llama-3.2-3B's (head dim 128)
    "8b": ModelDims(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336,
                    rope_scaling=(8.0, 1.0, 4.0, 8192.0)),  # Llama-3.1-8B's
    "qwen2_5_7b": ModelDims(vocab_size=152064, dim=3584, n_layers=28, n_heads=28, n_kv_heads=4, ffn_dim=18944,
                            rope_theta=1000000.0, norm_eps=1e-6, qkv_bias=True),  # Qwen2.5-7B's
    "qwen3_8b": ModelDims(vocab_size=151936, dim=4096, n_layers=36, n_heads=32, n_kv_heads=8, ffn_dim=12288,
                          rope_theta=1000000.0, norm_eps=1e-6, qk_head_dim=128, qk_norm=True),  # Qwen3-8B's
    # Gemma 2 and 3 with their own blocks, and the other families' attention on Llama blocks (their MLPs, norms and
    # mixtures of experts are not modelled): gpt-oss-20b's (64/8 heads of 64, learned sinks, window 128 on
    # alternate layers; a dense MLP of its experts' width) and DeepSeek-V2-Lite's MLA shapes (16 heads, q·k 192,
    # v 128; K and V as MLA decompresses them, no low-rank cache); each with a tiny twin for CPUs and tests.
    "gemma2_2b": ModelDims(vocab_size=256000, dim=2304, n_layers=26, n_heads=8, n_kv_heads=4, ffn_dim=9216,
                           rope_theta=10000.0, norm_eps=1e-6, tie_embeddings=True, qk_head_dim=256,
                           attn_soft_cap=50.0, final_soft_cap=30.0, sliding_window=4096, global_every=2,
                           block="gemma2", query_pre_attn_scalar=256.0),  # Gemma-2-2B's, its blocks too
    "gemma3_1b": ModelDims(vocab_size=262144, dim=1152, n_layers=26, n_heads=4, n_kv_heads=1, ffn_dim=6912,
                           rope_theta=1000000.0, norm_eps=1e-6, tie_embeddings=True, qk_head_dim=256,
                           sliding_window=512, global_every=6, block="gemma3", query_pre_attn_scalar=256.0,
                           qk_norm=True, local_rope_theta=10000.0),  # Gemma-3-1B's (text)
    "gemma2_tiny": ModelDims(vocab_size=384, dim=128, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=384,
                             rope_theta=10000.0, norm_eps=1e-6, tie_embeddings=True, qk_head_dim=128,
                             attn_soft_cap=50.0, final_soft_cap=30.0, sliding_window=32, global_every=2,
                             block="gemma2"),
    "gemma3_tiny": ModelDims(vocab_size=384, dim=128, n_layers=3, n_heads=2, n_kv_heads=1, ffn_dim=384,
                             rope_theta=1000000.0, norm_eps=1e-6, tie_embeddings=True, qk_head_dim=128,
                             sliding_window=32, global_every=3, block="gemma3", qk_norm=True,
                             local_rope_theta=10000.0),
    "gpt_oss_20b": ModelDims(vocab_size=201088, dim=2880, n_layers=24, n_heads=64, n_kv_heads=8, ffn_dim=2880,
                             rope_theta=150000.0, qk_head_dim=64, sliding_window=128, global_every=2, sinks=True),
    "gpt_oss_tiny": ModelDims(vocab_size=384, dim=128, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=384,
                              rope_theta=10000.0, tie_embeddings=True, qk_head_dim=32, sliding_window=32,
                              global_every=2, sinks=True),
    "deepseek_v2_lite": ModelDims(vocab_size=102400, dim=2048, n_layers=27, n_heads=16, n_kv_heads=16,
                                  ffn_dim=10944, rope_theta=10000.0, norm_eps=1e-6, qk_head_dim=192, v_head_dim=128),
    "deepseek_tiny": ModelDims(vocab_size=384, dim=128, n_layers=2, n_heads=4, n_kv_heads=4, ffn_dim=384,
                               rope_theta=10000.0, tie_embeddings=True, qk_head_dim=48, v_head_dim=32),
}


@dataclasses.dataclass(frozen=True)
class BlockKind:
  """What a `model.block` value changes in the decoder layer, read once here instead of by name at each use."""
  sandwich_norms: bool  # a norm on each branch's output too (attention_out_norm, mlp_out_norm)
  gelu_mlp: bool  # GeGLU with the tanh GELU instead of SwiGLU
  scaled_embeddings: bool  # embeddings times sqrt(dim)
  norm_offset: float  # Hugging Face stores its norm weights as w of (offset + w) (hf.py adds / removes it)


_LLAMA = BlockKind(sandwich_norms=False, gelu_mlp=False, scaled_embeddings=False, norm_offset=0.0)
_GEMMA = BlockKind(sandwich_norms=True, gelu_mlp=True, scaled_embeddings=True, norm_offset=1.0)
BLOCKS = {"llama": _LLAMA, "gemma2": _GEMMA, "gemma3": _GEMMA}  # gemma3 differs in its dims (qk_norm, two RoPEs)


class RMSNorm(nn.Module):
  eps: float
  dtype: jnp.dtype

  @nn.compact
  def __call__(self, x):
    scale = self.param("scale", INITIALIZERS["scale"], (x.shape[-1],), jnp.float32)
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return (x32 * scale).astype(self.dtype)


def rope_frequencies(half: int, theta: float, scaling=None):
  """[half] f32 inverse wavelengths of the rotary embedding; `scaling` = Llama 3.1+'s (factor, low_freq_factor,
  high_freq_factor, original_max_positions): long wavelengths slow down by `factor`, short ones stay, and the
  band between blends the two."""
  freqs = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
  if scaling is None:
    return freqs
  factor, low, high, original = scaling
  wavelength = 2 * math.pi / freqs
  blend = jnp.clip((original / wavelength - low) / (high - low), 0.0, 1.0)  # 0: long wavelengths, 1: short ones
  return (1 - blend) * freqs / factor + blend * freqs


def rope(x, positions, theta, scaling=None, linear=None):
  """Rotary embedding on [B, S, H, D] with the rotate-half layout Hugging Face's Llama uses; `linear` divides the
  positions (HF's linear RoPE scaling)."""
  half = x.shape[-1] // 2
  freqs = rope_frequencies(half, theta, scaling)
  if linear is not None:
    freqs = freqs / linear
  angles = positions.astype(jnp.float32)[..., None, None] * freqs  # [B, S, 1, D/2]
  cos, sin = jnp.cos(angles), jnp.sin(angles)
  x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


# Every parameter's initialiser, by its leaf name: the modules below take theirs from here, and
# `init_params` draws each leaf from it directly, so initialising never traces the forward.
WEIGHT_INIT = nn.initializers.normal(0.02)  # Dense kernels and the embedding
INITIALIZERS = {"kernel": WEIGHT_INIT, "embedding": WEIGHT_INIT, "scale": nn.initializers.ones,
                "bias": nn.initializers.zeros, "sinks": nn.initializers.zeros}


def _dense(features, name, dtype, bias: bool = False):
  return nn.Dense(features, use_bias=bias, dtype=dtype, param_dtype=jnp.float32, name=name,
                  kernel_init=INITIALIZERS["kernel"], bias_init=INITIALIZERS["bias"])


def soft_cap(x, cap):
  """cap·tanh(x / cap), or x when cap is None."""
  return x if cap is None else cap * jnp.tanh(x / cap)


def cached_attention(q, k_cache, v_cache, positions, *, window=None, softcap=None, sinks=None):
  """Decoding: queries [B, s, Hq, D] at `positions` [B, s] attend to every cached key at or before
  their own position (k_cache [B, L, Hkv, D], v_cache [B, L, Hkv, Dv]), and within `window` keys of it when a
  window is given. Dense XLA in float32: a few query rows have nothing to tile, so the CLiS kernels are not
  used here."""
  b, s, hq, d = q.shape
  hkv, dv = k_cache.shape[2], v_cache.shape[3]
  qg = q.astype(jnp.float32).reshape(b, s, hkv, hq // hkv, d)
  logits = soft_cap(jnp.einsum("bshgd,bkhd->bhgsk", qg, k_cache.astype(jnp.float32)) * d ** -0.5, softcap)
  keys = jnp.arange(k_cache.shape[1])[None, None, :]
  visible = keys <= positions[:, :, None]  # [B, s, L]
  if window is not None:
    visible &= keys >= positions[:, :, None] - window
  logits = jnp.where(visible[:, None, None], logits, -jnp.inf)
  if sinks is not None:  # the sink: one more logit per head with no value
    sink = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(1, hkv, hq // hkv, 1, 1), logits.shape[:-1] + (1,))
    logits = jnp.concatenate([logits, sink], axis=-1)
  weights = jax.nn.softmax(logits, axis=-1)[..., :k_cache.shape[1]]
  out = jnp.einsum("bhgsk,bkhd->bshgd", weights, v_cache.astype(jnp.float32))
  return out.reshape(b, s, hq, dv).astype(q.dtype)


class Attention(nn.Module):
  dims: ModelDims
  attend: Callable  # (q, k, v, segment_ids, sinks, *, window, softcap) -> (out, certified_fraction)
  dtype: jnp.dtype
  decode: bool = False  # keep K/V in the "cache" collection, sized by the input at init ([B, max_len])
  window: int | None = None  # this layer's sliding window (ModelDims.layer_window)
  rope: tuple | None = None  # this layer's (theta, scaling, linear factor) (ModelDims.layer_rope); None: the dims'

  @nn.compact
  def __call__(self, x, positions, segment_ids):
    d, b, s = self.dims, x.shape[0], x.shape[1]
    hd, vd = d.head_dim, d.value_dim
    q = _dense(d.n_heads * hd, "wq", self.dtype, d.qkv_bias)(x).reshape(b, s, d.n_heads, hd)
    k = _dense(d.n_kv_heads * hd, "wk", self.dtype, d.qkv_bias)(x).reshape(b, s, d.n_kv_heads, hd)
    v = _dense(d.n_kv_heads * vd, "wv", self.dtype, d.qkv_bias)(x).reshape(b, s, d.n_kv_heads, vd)
    if d.qk_norm:
      q, k = RMSNorm(d.norm_eps, self.dtype, name="q_norm")(q), RMSNorm(d.norm_eps, self.dtype, name="k_norm")(k)
    sinks = self.param("sinks", INITIALIZERS["sinks"], (d.n_heads,), jnp.float32) if d.sinks else None
    theta, scaling, linear = self.rope or (d.rope_theta, d.rope_scaling, d.rope_linear_factor)
    q, k = rope(q, positions, theta, scaling, linear), rope(k, positions, theta, scaling, linear)
    if d.query_pre_attn_scalar is not None:  # the kernels scale q·k by hd^-1/2; Gemma 2 wants this scalar's
      q = (q.astype(jnp.float32) * (hd / d.query_pre_attn_scalar) ** 0.5).astype(q.dtype)
    self.sow("activations", "qkv", (q, k, v))  # kept only when applied with mutable=["activations"]
    if self.decode:
      out, certified = self._decode(q, k, v, positions, sinks), jnp.zeros((), jnp.float32)
    else:
      out, certified = self.attend(q, k, v, segment_ids, sinks, window=self.window, softcap=d.attn_soft_cap)
    self.sow("intermediates", "certified_fraction", certified)
    return _dense(d.dim, "wo", self.dtype)(out.reshape(b, s, d.n_heads * vd))

  def _decode(self, q, k, v, positions, sinks):
    """Writes k, v into the cache at positions[:, 0] onwards, then attends over the cache."""
    ready = self.has_variable("cache", "k")
    k_cache = self.variable("cache", "k", jnp.zeros, k.shape, k.dtype)
    v_cache = self.variable("cache", "v", jnp.zeros, v.shape, v.dtype)
    if not ready:  # init: only the cache's shape is being made
      return jnp.zeros(q.shape[:3] + v.shape[3:], q.dtype)
    start = positions[0, 0]
    k_cache.value = jax.lax.dynamic_update_slice(k_cache.value, k.astype(k_cache.value.dtype), (0, start, 0, 0))
    v_cache.value = jax.lax.dynamic_update_slice(v_cache.value, v.astype(v_cache.value.dtype), (0, start, 0, 0))
    return cached_attention(q, k_cache.value, v_cache.value, positions, window=self.window,
                            softcap=self.dims.attn_soft_cap, sinks=sinks)


class MLP(nn.Module):
  dims: ModelDims
  dtype: jnp.dtype

  @nn.compact
  def __call__(self, x):
    """SwiGLU (Llama), or GeGLU with the tanh GELU (Gemma 2)."""
    gate = _dense(self.dims.ffn_dim, "w1", self.dtype)(x)
    up = _dense(self.dims.ffn_dim, "w3", self.dtype)(x)
    act = nn.gelu(gate, approximate=True) if self.dims.kind.gelu_mlp else nn.silu(gate)
    return _dense(self.dims.dim, "w2", self.dtype)(act * up)


class Block(nn.Module):
  dims: ModelDims
  attend: Callable
  dtype: jnp.dtype
  decode: bool = False
  window: int | None = None
  rope: tuple | None = None

  @nn.compact
  def __call__(self, x, positions, segment_ids):
    """Pre-norm residual blocks; Gemma 2 and 3 also norm each branch's output before adding it."""
    sandwich = self.dims.kind.sandwich_norms
    norm = lambda name, h: RMSNorm(self.dims.norm_eps, self.dtype, name=name)(h)
    attention = Attention(self.dims, self.attend, self.dtype, self.decode, self.window, self.rope, name="attention")
    h = attention(norm("attention_norm", x), positions, segment_ids)
    x = x + (norm("attention_out_norm", h) if sandwich else h)
    h = MLP(self.dims, self.dtype, name="mlp")(norm("mlp_norm", x))
    return x + (norm("mlp_out_norm", h) if sandwich else h)


class Transformer(nn.Module):
  dims: ModelDims
  attend: Callable
  dtype: jnp.dtype = jnp.bfloat16
  remat: str = "none"  # none | full | dots (save matmul outputs, recompute the rest)
  decode: bool = False  # generation: attention keeps a K/V cache (clis_train/generate.py)

  @nn.compact
  def __call__(self, tokens, positions, segment_ids):
    """Returns float32 logits [B, S, vocab]."""
    embed = nn.Embed(self.dims.vocab_size, self.dims.dim, dtype=self.dtype, param_dtype=jnp.float32,
                     embedding_init=INITIALIZERS["embedding"], name="embed")
    block = Block
    if self.remat != "none":
      policy = jax.checkpoint_policies.checkpoint_dots if self.remat == "dots" else None
      block = nn.remat(Block, policy=policy)
    x = embed(tokens)
    if self.dims.kind.scaled_embeddings:  # Gemma's: times sqrt(dim), in the compute dtype
      x = x * jnp.asarray(self.dims.dim ** 0.5, self.dtype)
    for i in range(self.dims.n_layers):
      layer = block(self.dims, self.attend, self.dtype, self.decode, self.dims.layer_window(i),
                    self.dims.layer_rope(i), name=f"layer_{i}")
      x = layer(x, positions, segment_ids)
    x = RMSNorm(self.dims.norm_eps, self.dtype, name="norm")(x)
    if self.dims.tie_embeddings:
      logits = embed.attend(x).astype(jnp.float32)
    else:
      logits = _dense(self.dims.vocab_size, "lm_head", self.dtype)(x).astype(jnp.float32)
    return soft_cap(logits, self.dims.final_soft_cap)


def abstract_params(transformer: Transformer, batch_shape: tuple[int, int]):
  """The parameter tree as ShapeDtypeStructs, from tokens of `batch_shape` [B, S] traced abstractly
  (jax.eval_shape: nothing is compiled)."""
  tokens = jax.ShapeDtypeStruct(batch_shape, jnp.int32)
  return jax.eval_shape(transformer.init, jax.random.PRNGKey(0), tokens, tokens, tokens)["params"]


def init_params(abstract, rng, shardings=None):
  """Draws every leaf of `abstract` (abstract_params's tree) from INITIALIZERS by its name, leaf i from
  fold_in(rng, i), each by a small jitted program made once per (initialiser, shape, sharding) and placed by
  `shardings` (a tree like `abstract`; None: the default device). Nothing of the forward is traced, and layers
  of one shape share one compile: one program for the whole tree compiled for a minute on the H200."""
  leaves, treedef = jax.tree_util.tree_flatten_with_path(abstract)
  placements = [None] * len(leaves) if shardings is None else jax.tree.leaves(shardings)
  out = []
  for i, ((path, leaf), sharding) in enumerate(zip(leaves, placements)):
    name = str(getattr(path[-1], "key", path[-1]))
    if name not in INITIALIZERS:
      raise ValueError(f"parameter {jax.tree_util.keystr(path)} has no initialiser: add {name!r} to INITIALIZERS")
    out.append(_leaf_initializer(name, leaf.shape, jnp.dtype(leaf.dtype), sharding)(rng, i))
  return jax.tree_util.tree_unflatten(treedef, out)


@functools.cache
def _leaf_initializer(name, shape, dtype, sharding):
  init = INITIALIZERS[name]
  return jax.jit(lambda rng, i: init(jax.random.fold_in(rng, i), shape, dtype), out_shardings=sharding)


def resolve_dims(model_cfg, tokenizer_vocab: int) -> ModelDims:
  """The preset's dims with the config's explicit values on top; vocab fits the tokenizer."""
  if model_cfg.preset not in PRESETS:
    raise ConfigError(f"model.preset={model_cfg.preset!r} is not one of {sorted(PRESETS)}")
  base = PRESETS[model_cfg.preset]
  overrides = {f.name: getattr(model_cfg, f.name) for f in dataclasses.fields(ModelDims)
               if getattr(model_cfg, f.name, None) is not None}
  dims = dataclasses.replace(base, **overrides)
  if model_cfg.vocab_size is None and dims.vocab_size < tokenizer_vocab:
    dims = dataclasses.replace(dims, vocab_size=-(-tokenizer_vocab // 128) * 128)
  if dims.vocab_size < tokenizer_vocab:
    raise ConfigError(f"model.vocab_size={dims.vocab_size} is smaller than the tokenizer's {tokenizer_vocab} ids")
  if min(dims.dim, dims.n_heads, dims.n_kv_heads, dims.n_layers, dims.ffn_dim) < 1:
    raise ConfigError(f"model dims must be positive; got {dims}")
  if dims.n_heads % dims.n_kv_heads or (dims.qk_head_dim is None and dims.dim % dims.n_heads):
    raise ConfigError(f"model.n_heads={dims.n_heads} must divide by n_kv_heads={dims.n_kv_heads}, and "
                      f"model.dim={dims.dim} by n_heads unless model.qk_head_dim is set")
  if dims.head_dim % 2:
    raise ConfigError(f"the q·k head dim {dims.head_dim} (model.qk_head_dim, or model.dim / n_heads = {dims.dim} / "
                      f"{dims.n_heads}) must be even for RoPE; change model.dim, model.n_heads or model.qk_head_dim")
  for name in ("qk_head_dim", "v_head_dim", "sliding_window", "global_every"):
    value = getattr(dims, name)
    if value is not None and value < 1:
      raise ConfigError(f"model.{name}={value} must be >= 1, or null")
  if dims.block not in BLOCKS:
    raise ConfigError(f"model.block={dims.block!r} must be one of {tuple(BLOCKS)}")
  for name, what in (("attn_soft_cap", "logits become c·tanh(s / c)"), ("final_soft_cap", "logits become c·tanh(s / c)"),
                     ("query_pre_attn_scalar", "q·k is scaled by its −1/2 power"),
                     ("local_rope_theta", "the windowed layers' RoPE base"),
                     ("rope_linear_factor", "RoPE positions are divided by it")):
    value = getattr(dims, name)
    if value is not None and not (math.isfinite(value) and value > 0):
      raise ConfigError(f"model.{name}={value} must be a positive number ({what}), or null")
  if dims.rope_scaling is not None and (len(dims.rope_scaling) != 4 or not dims.rope_scaling[2] > dims.rope_scaling[1]):
    raise ConfigError(f"model.rope_scaling={list(dims.rope_scaling)} must be [factor, low_freq_factor, "
                      "high_freq_factor, original_max_positions] with high_freq_factor > low_freq_factor (Llama 3.1+)")
  if dims.global_every is not None and dims.sliding_window is None:
    raise ConfigError(f"model.global_every={dims.global_every} says which layers see every key, but "
                      "model.sliding_window is null: set the window of the other layers, or global_every=null")
  return dims


def attention_keys_per_query(dims: ModelDims, layer: int, seq_len: int) -> float:
  """The mean number of keys a causal query of a seq_len-long sequence sees in `layer` (its window's, if any)."""
  w = dims.layer_window(layer)
  if w is None or seq_len <= w + 1:
    return (seq_len + 1) / 2
  return (w * (w + 1) / 2 + (seq_len - w) * (w + 1)) / seq_len


def flops_per_token(dims: ModelDims, seq_len: int) -> float:
  """Training FLOPs per token: 6·N for the matmuls plus causal attention's two matmuls (fwd 2·keys·Hq·(D + Dv),
  three times that with the backward) over the keys each query sees."""
  matmul_params = dims.num_params() - dims.vocab_size * dims.dim * (0 if dims.tie_embeddings else 1) - dims.dim
  per_key = 6.0 * dims.n_heads * (dims.head_dim + dims.value_dim)
  return 6.0 * matmul_params + sum(per_key * attention_keys_per_query(dims, i, seq_len) for i in range(dims.n_layers))
