"""Hugging Face Llama weights (safetensors) into the Flax model's parameter tree, and back out.

HF stores linear weights as [out, in]; Flax Dense kernels are [in, out]. Names map as
model.layers.{i}.self_attn.{q,k,v,o}_proj → layer_{i}/attention/w{q,k,v,o},
mlp.{gate,up,down}_proj → mlp/w{1,3,2}, input_layernorm → attention_norm,
post_attention_layernorm → mlp_norm; embed_tokens → embed; model.norm → norm; lm_head.
Both sides use the rotate-half RoPE layout, so no permutation is needed.
"""

from __future__ import annotations

import json
import pathlib
import shutil

import jax
import jax.numpy as jnp
import numpy as np
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


def llama_config(dims, *, max_positions: int, bos_id, eos_id) -> dict:
  """transformers' LlamaConfig for our dims (rope_theta both flat, for transformers 4, and in
  rope_parameters, as transformers 5 writes it)."""
  return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": dims.vocab_size,
          "hidden_size": dims.dim, "intermediate_size": dims.ffn_dim, "num_hidden_layers": dims.n_layers,
          "num_attention_heads": dims.n_heads, "num_key_value_heads": dims.n_kv_heads, "head_dim": dims.head_dim,
          "hidden_act": "silu", "rms_norm_eps": dims.norm_eps, "rope_theta": dims.rope_theta,
          "rope_parameters": {"rope_type": "default", "rope_theta": dims.rope_theta},
          "tie_word_embeddings": dims.tie_embeddings, "max_position_embeddings": max_positions,
          "attention_bias": False, "mlp_bias": False, "bos_token_id": bos_id, "eos_token_id": eos_id,
          "torch_dtype": "float32"}


def save_llama_safetensors(params, dims, folder: pathlib.Path, *, max_positions: int, tokenizer_path: str | None,
                           bos_id=None, eos_id=None) -> list[pathlib.Path]:
  """Writes model.safetensors (float32, Hugging Face names and [out, in] layout) and config.json,
  plus tokenizer.json when the run had one; returns the files written. The folder must not exist or
  be empty: an export never overwrites."""
  from safetensors.numpy import save_file
  folder = pathlib.Path(folder)
  if folder.exists() and any(folder.iterdir()):
    raise FileExistsError(f"--hf {str(folder)!r} exists and is not empty; choose a new folder (an export never "
                          "overwrites)")
  folder.mkdir(parents=True, exist_ok=True)
  tensors = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    keys = tuple(p.key for p in path)
    value = np.asarray(leaf, np.float32)
    tensors[_hf_name(keys)] = np.ascontiguousarray(value.T if keys[-1] == "kernel" else value)
  written = [folder / "model.safetensors", folder / "config.json"]
  save_file(tensors, str(written[0]), metadata={"format": "pt"})
  written[1].write_text(json.dumps(llama_config(dims, max_positions=max_positions, bos_id=bos_id, eos_id=eos_id),
                                   indent=1))
  if tokenizer_path is not None:
    written.append(folder / "tokenizer.json")
    shutil.copyfile(tokenizer_path, written[-1])
  return written
