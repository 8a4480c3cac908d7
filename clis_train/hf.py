"""Import of Hugging Face Llama weights (safetensors) into the Flax model's parameter tree.

HF stores linear weights as [out, in]; Flax Dense kernels are [in, out]. Names map as
model.layers.{i}.self_attn.{q,k,v,o}_proj → layer_{i}/attention/w{q,k,v,o},
mlp.{gate,up,down}_proj → mlp/w{1,3,2}, input_layernorm → attention_norm,
post_attention_layernorm → mlp_norm; embed_tokens → embed; model.norm → norm; lm_head.
Both sides use the rotate-half RoPE layout, so no permutation is needed.
"""

from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp
from safetensors import safe_open

_LAYER = {
    ("attention", "wq", "kernel"): "self_attn.q_proj.weight",
    ("attention", "wk", "kernel"): "self_attn.k_proj.weight",
    ("attention", "wv", "kernel"): "self_attn.v_proj.weight",
    ("attention", "wo", "kernel"): "self_attn.o_proj.weight",
    ("mlp", "w1", "kernel"): "mlp.gate_proj.weight",
    ("mlp", "w3", "kernel"): "mlp.up_proj.weight",
    ("mlp", "w2", "kernel"): "mlp.down_proj.weight",
    ("attention_norm", "scale"): "input_layernorm.weight",
    ("mlp_norm", "scale"): "post_attention_layernorm.weight",
}


def _hf_name(path: tuple[str, ...]) -> str:
  if path[0] == "embed":
    return "model.embed_tokens.weight"
  if path[0] == "norm":
    return "model.norm.weight"
  if path[0] == "lm_head":
    return "lm_head.weight"
  layer = int(path[0].removeprefix("layer_"))
  return f"model.layers.{layer}.{_LAYER[path[1:]]}"


def load_llama_safetensors(folder: pathlib.Path, abstract_params):
  """Reads every *.safetensors file in `folder` into a float32 tree shaped like abstract_params."""
  tensors = {}
  for file in sorted(folder.glob("*.safetensors")):
    with safe_open(str(file), framework="flax") as f:
      for name in f.keys():
        tensors[name] = f.get_tensor(name)

  def convert(path, leaf):
    keys = tuple(p.key for p in path)
    name = _hf_name(keys)
    if name not in tensors:
      raise ValueError(f"{folder}: no tensor {name!r} for parameter {'/'.join(keys)} (is this a Llama checkpoint "
                       "with the configured number of layers?)")
    value = jnp.asarray(tensors[name], jnp.float32)
    if keys[-1] == "kernel":
      value = value.T
    if value.shape != tuple(leaf.shape):
      raise ValueError(f"{folder}: {name} has shape {value.shape} but the model expects {tuple(leaf.shape)} "
                       f"for {'/'.join(keys)}; set model.* to the checkpoint's config")
    return value

  return jax.tree_util.tree_map_with_path(convert, abstract_params)
