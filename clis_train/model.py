"""A Llama-style decoder in Flax: RMSNorm, RoPE, SwiGLU, GQA. Read top to bottom.

Parameters are float32 (master weights); activations run in `dtype` (bf16 by default).
Attention has one call site, `Attention.__call__`, which calls the function the trainer
built from `attention:` (clis_train/attention.py); its post-RoPE q, k, v are sown into the
"activations" collection, which costs nothing unless an analysis applies the model with it mutable.
Layout: tokens [B, S] int32; positions and segment_ids [B, S] from packing (segment 0 = padding).
"""

from __future__ import annotations

import dataclasses
import functools
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

  @property
  def head_dim(self) -> int:
    return self.dim // self.n_heads

  def num_params(self) -> int:
    attn = self.dim * self.head_dim * (2 * self.n_heads + 2 * self.n_kv_heads)
    layer = attn + 3 * self.dim * self.ffn_dim + 2 * self.dim
    embed = self.vocab_size * self.dim * (1 if self.tie_embeddings else 2)
    return self.n_layers * layer + embed + self.dim


PRESETS = {
    "tiny": ModelDims(vocab_size=384, dim=128, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=384,
                      rope_theta=10000.0, tie_embeddings=True),
    "small": ModelDims(vocab_size=32000, dim=768, n_layers=12, n_heads=12, n_kv_heads=4, ffn_dim=2048),
    "1b": ModelDims(vocab_size=128256, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192,
                    tie_embeddings=True),  # Llama-3.2-1B's shape
    "3b": ModelDims(vocab_size=128256, dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, ffn_dim=8192,
                    tie_embeddings=True),  # Llama-3.2-3B's shape (head dim 128)
    "8b": ModelDims(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336),
}


class RMSNorm(nn.Module):
  eps: float
  dtype: jnp.dtype

  @nn.compact
  def __call__(self, x):
    scale = self.param("scale", INITIALIZERS["scale"], (x.shape[-1],), jnp.float32)
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return (x32 * scale).astype(self.dtype)


def rope(x, positions, theta):
  """Rotary embedding on [B, S, H, D] with the rotate-half layout Hugging Face's Llama uses."""
  half = x.shape[-1] // 2
  freqs = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
  angles = positions.astype(jnp.float32)[..., None, None] * freqs  # [B, S, 1, D/2]
  cos, sin = jnp.cos(angles), jnp.sin(angles)
  x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


# Every parameter's initialiser, by its leaf name: the modules below take theirs from here, and
# `init_params` draws each leaf from it directly, so initialising never traces the forward.
WEIGHT_INIT = nn.initializers.normal(0.02)  # Dense kernels and the embedding
INITIALIZERS = {"kernel": WEIGHT_INIT, "embedding": WEIGHT_INIT, "scale": nn.initializers.ones}


def _dense(features, name, dtype):
  return nn.Dense(features, use_bias=False, dtype=dtype, param_dtype=jnp.float32, name=name,
                  kernel_init=INITIALIZERS["kernel"])


def cached_attention(q, k_cache, v_cache, positions):
  """Decoding: queries [B, s, Hq, D] at `positions` [B, s] attend to every cached key at or before
  their own position (k_cache, v_cache [B, L, Hkv, D]). Dense XLA in float32: a few query rows have
  nothing to tile, so the CLiS kernels are not used here."""
  b, s, hq, d = q.shape
  hkv = k_cache.shape[2]
  qg = q.astype(jnp.float32).reshape(b, s, hkv, hq // hkv, d)
  logits = jnp.einsum("bshgd,bkhd->bhgsk", qg, k_cache.astype(jnp.float32)) * d ** -0.5
  visible = jnp.arange(k_cache.shape[1])[None, None, :] <= positions[:, :, None]  # [B, s, L]
  weights = jax.nn.softmax(jnp.where(visible[:, None, None], logits, -jnp.inf), axis=-1)
  out = jnp.einsum("bhgsk,bkhd->bshgd", weights, v_cache.astype(jnp.float32))
  return out.reshape(b, s, hq, d).astype(q.dtype)


class Attention(nn.Module):
  dims: ModelDims
  attend: Callable  # (q, k, v, segment_ids) -> (out, certified_fraction)
  dtype: jnp.dtype
  decode: bool = False  # keep K/V in the "cache" collection, sized by the input at init ([B, max_len])

  @nn.compact
  def __call__(self, x, positions, segment_ids):
    d, b, s = self.dims, x.shape[0], x.shape[1]
    q = _dense(d.n_heads * d.head_dim, "wq", self.dtype)(x).reshape(b, s, d.n_heads, d.head_dim)
    k = _dense(d.n_kv_heads * d.head_dim, "wk", self.dtype)(x).reshape(b, s, d.n_kv_heads, d.head_dim)
    v = _dense(d.n_kv_heads * d.head_dim, "wv", self.dtype)(x).reshape(b, s, d.n_kv_heads, d.head_dim)
    q, k = rope(q, positions, d.rope_theta), rope(k, positions, d.rope_theta)
    self.sow("activations", "qkv", (q, k, v))  # kept only when applied with mutable=["activations"]
    if self.decode:
      out, certified = self._decode(q, k, v, positions), jnp.zeros((), jnp.float32)
    else:
      out, certified = self.attend(q, k, v, segment_ids)
    self.sow("intermediates", "certified_fraction", certified)
    return _dense(d.dim, "wo", self.dtype)(out.reshape(b, s, d.n_heads * d.head_dim))

  def _decode(self, q, k, v, positions):
    """Writes k, v into the cache at positions[:, 0] onwards, then attends over the cache."""
    ready = self.has_variable("cache", "k")
    k_cache = self.variable("cache", "k", jnp.zeros, k.shape, k.dtype)
    v_cache = self.variable("cache", "v", jnp.zeros, v.shape, v.dtype)
    if not ready:  # init: only the cache's shape is being made
      return jnp.zeros_like(q)
    start = positions[0, 0]
    k_cache.value = jax.lax.dynamic_update_slice(k_cache.value, k.astype(k_cache.value.dtype), (0, start, 0, 0))
    v_cache.value = jax.lax.dynamic_update_slice(v_cache.value, v.astype(v_cache.value.dtype), (0, start, 0, 0))
    return cached_attention(q, k_cache.value, v_cache.value, positions)


class MLP(nn.Module):
  dims: ModelDims
  dtype: jnp.dtype

  @nn.compact
  def __call__(self, x):
    gate = _dense(self.dims.ffn_dim, "w1", self.dtype)(x)
    up = _dense(self.dims.ffn_dim, "w3", self.dtype)(x)
    return _dense(self.dims.dim, "w2", self.dtype)(nn.silu(gate) * up)


class Block(nn.Module):
  dims: ModelDims
  attend: Callable
  dtype: jnp.dtype
  decode: bool = False

  @nn.compact
  def __call__(self, x, positions, segment_ids):
    h = RMSNorm(self.dims.norm_eps, self.dtype, name="attention_norm")(x)
    x = x + Attention(self.dims, self.attend, self.dtype, self.decode, name="attention")(h, positions, segment_ids)
    h = RMSNorm(self.dims.norm_eps, self.dtype, name="mlp_norm")(x)
    return x + MLP(self.dims, self.dtype, name="mlp")(h)


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
    for i in range(self.dims.n_layers):
      x = block(self.dims, self.attend, self.dtype, self.decode, name=f"layer_{i}")(x, positions, segment_ids)
    x = RMSNorm(self.dims.norm_eps, self.dtype, name="norm")(x)
    if self.dims.tie_embeddings:
      return embed.attend(x).astype(jnp.float32)
    return _dense(self.dims.vocab_size, "lm_head", self.dtype)(x).astype(jnp.float32)


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
  if dims.dim % dims.n_heads or dims.n_heads % dims.n_kv_heads:
    raise ConfigError(f"model.dim={dims.dim} must divide by n_heads={dims.n_heads}, "
                      f"and n_heads by n_kv_heads={dims.n_kv_heads}")
  if (dims.dim // dims.n_heads) % 2:
    raise ConfigError(f"model.dim / n_heads = {dims.dim} / {dims.n_heads} = {dims.dim // dims.n_heads} is the head "
                      "dim, which RoPE needs even; change model.dim or model.n_heads")
  return dims


def flops_per_token(dims: ModelDims, seq_len: int) -> float:
  """Training FLOPs per token: 6·N for the matmuls plus causal attention's 6·L·S·D."""
  matmul_params = dims.num_params() - dims.vocab_size * dims.dim * (0 if dims.tie_embeddings else 1) - dims.dim
  return 6.0 * matmul_params + 6.0 * dims.n_layers * seq_len * dims.dim
