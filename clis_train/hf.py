"""Hugging Face Llama, Mistral, Qwen 2/3, Gemma 2 and Gemma 3 (text) weights (safetensors) into the Flax model's
parameter tree, and Llama and Gemma 2 back out.

HF stores linear weights as [out, in]; Flax Dense kernels are [in, out]. Names map as
model.layers.{i}.self_attn.{q,k,v,o}_proj → layer_{i}/attention/w{q,k,v,o},
mlp.{gate,up,down}_proj → mlp/w{1,3,2}, input_layernorm → attention_norm,
post_attention_layernorm → mlp_norm; embed_tokens → embed; model.norm → norm; lm_head. Gemma 2's four norms a
layer: input_layernorm → attention_norm, post_attention_layernorm → attention_out_norm, pre_feedforward_layernorm →
mlp_norm, post_feedforward_layernorm → mlp_out_norm; its norms multiply by (1 + w), so the import adds one
(Gemma 3's too, its QK norms included).
Qwen 2's self_attn.{q,k,v}_proj.bias → attention/w{q,k,v}/bias; Qwen 3's self_attn.{q,k}_norm → attention/{q,k}_norm.
Both sides use the rotate-half RoPE layout, so no permutation is needed. A folder's config.json says what it
holds: Llama, Mistral, Qwen 2/3, Gemma 2 and Gemma 3 text load (their dims must match the model's); other
architectures get one error that names what our blocks lack for them.
"""

from __future__ import annotations

import json
import pathlib
import shutil

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import safe_open

from clis_train import model

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
    ("attention", "wq", "bias"): "self_attn.q_proj.bias",  # Qwen 2
    ("attention", "wk", "bias"): "self_attn.k_proj.bias",
    ("attention", "wv", "bias"): "self_attn.v_proj.bias",
    ("attention", "q_norm", "scale"): "self_attn.q_norm.weight",  # Qwen 3
    ("attention", "k_norm", "scale"): "self_attn.k_norm.weight",
}


_GEMMA2_LAYER = {**{k: v for k, v in _LAYER.items() if k[0] != "mlp_norm"},
                 ("attention_out_norm", "scale"): "post_attention_layernorm.weight",
                 ("mlp_norm", "scale"): "pre_feedforward_layernorm.weight",
                 ("mlp_out_norm", "scale"): "post_feedforward_layernorm.weight"}

LLAMA_LIKE = ("llama", "mistral", "qwen2", "qwen3")  # model.block llama (Qwen 2: model.qkv_bias, 3: model.qk_norm)
GEMMA = {"gemma2": "gemma2", "gemma3_text": "gemma3"}  # model_type -> model.block
LOADS = (*LLAMA_LIKE, *GEMMA)  # model_type values whose weights load
# model_type -> what our blocks lack to run that architecture's weights (its attention shape may still be a preset)
MISSING = {
    "gemma": "GeGLU MLPs, (1 + w) norm weights and sqrt(dim)-scaled embeddings",
    "gemma3": "the vision tower of Gemma 3's multimodal checkpoints (text-only ones, model_type gemma3_text such "
              "as Gemma 3 1B, load)",
    "gpt_oss": "the mixture-of-experts MLP and the attention biases (model.preset=gpt_oss_20b trains its "
               "attention's shape from scratch)",
    "deepseek_v2": "MLA's low-rank query and key/value projections with their decoupled RoPE, and the "
                   "mixture-of-experts MLPs (model.preset=deepseek_v2_lite trains MLA's head dims from scratch)",
    "deepseek_v3": "MLA's low-rank query and key/value projections with their decoupled RoPE, and the "
                   "mixture-of-experts MLPs",
}


def _rope_theta(config: dict):
  return config.get("rope_theta", (config.get("rope_parameters") or {}).get("rope_theta"))


def check_config(folder: pathlib.Path, dims) -> None:
  """One ValueError if folder/config.json (when there is one) is not a Llama-like model of `dims`' shape: it
  names the architecture's missing parts, or each setting that differs and the model.* key to set."""
  path = pathlib.Path(folder) / "config.json"
  if not path.is_file():
    return
  config = json.loads(path.read_text())
  kind = config.get("model_type")
  if kind not in LOADS:
    lacks = MISSING.get(kind, "its layers (only Llama-architecture weights load)")
    raise ValueError(f"{str(folder)!r} holds a {kind!r} model (config.json model_type); clis-train's model loads "
                     f"Llama, Mistral, Qwen 2/3, Gemma 2 and Gemma 3 text weights and lacks {lacks}")
  if kind in GEMMA:
    _check_gemma(folder, config)
  if config.get("attention_bias") or config.get("mlp_bias"):
    raise ValueError(f"{str(folder)!r} has biases (attention_bias / mlp_bias in config.json); clis-train's model "
                     "has q, k and v biases only (model.qkv_bias, Qwen 2's)")
  if kind == "qwen2" and config.get("use_sliding_window"):
    raise ValueError(f"{str(folder)!r} config.json use_sliding_window=true (Qwen 2's window on layers past "
                     "max_window_layers); clis-train's model windows all layers or alternate ones")
  scaling = config.get("rope_scaling") or config.get("rope_parameters") or {}
  kind_of_rope = scaling.get("rope_type", scaling.get("type", "default"))
  if kind_of_rope not in ("default", "llama3"):
    raise ValueError(f"{str(folder)!r} uses RoPE scaling {kind_of_rope!r}; clis-train's model applies none or "
                     "Llama 3's (rope_type llama3)")
  rope_scaling = None if kind_of_rope == "default" else [
      float(scaling[k]) for k in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")]
  want = {
      "dim": config.get("hidden_size"), "n_layers": config.get("num_hidden_layers"),
      "n_heads": config.get("num_attention_heads"),
      "n_kv_heads": config.get("num_key_value_heads", config.get("num_attention_heads")),
      "ffn_dim": config.get("intermediate_size"), "vocab_size": config.get("vocab_size"),
      "head_dim": config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"],
      "rope_theta": _rope_theta(config), "norm_eps": config.get("rms_norm_eps"),
      "tie_embeddings": config.get("tie_word_embeddings", False),
      "sliding_window": config.get("sliding_window") if kind in ("mistral", *GEMMA) else None,
      "rope_scaling": rope_scaling, "block": GEMMA.get(kind, "llama"),
      "qkv_bias": kind == "qwen2", "qk_norm": kind in ("qwen3", "gemma3_text"),
  }
  if kind in GEMMA:
    want.update(attn_soft_cap=config.get("attn_logit_softcapping"), final_soft_cap=config.get("final_logit_softcapping"),
                query_pre_attn_scalar=config.get("query_pre_attn_scalar"), global_every=_global_every(config),
                tie_embeddings=config.get("tie_word_embeddings", True))
  if kind == "gemma3_text":
    want.update(_gemma3_rope(folder, config))
  ours = {name: getattr(dims, name) for name in want}
  if kind not in GEMMA:
    ours["sliding_window"] = dims.sliding_window if dims.global_every is None else "on some layers only"
  ours["rope_scaling"] = None if dims.rope_scaling is None else list(dims.rope_scaling)
  same = lambda a, b: (a == b if not isinstance(a, float) or not isinstance(b, float)
                       else abs(a - b) <= 1e-9 * abs(a))
  differ = [f"model.{'qk_head_dim' if k == 'head_dim' else k}={v!r} (ours: {ours[k]!r})" for k, v in want.items()
            if v is not None and not same(v, ours[k])]
  for name in ("sliding_window", "rope_scaling") + (
      ("attn_soft_cap", "final_soft_cap", "query_pre_attn_scalar", "local_rope_theta", "rope_linear_factor")
      if kind in GEMMA else ()):  # absent in the checkpoint: ours must be off too
    if name not in want:
      continue
    if want[name] is None and ours[name] is not None:
      differ.append(f"model.{name}=null (ours: {ours[name]!r})")
  if differ:
    raise ValueError(f"{str(folder)!r} config.json differs from the model: set {', '.join(differ)}")


def _global_every(config: dict) -> int:
  """model.global_every of a Gemma config: Gemma 2 alternates (2), Gemma 3 takes sliding_window_pattern (6)."""
  return 2 if config.get("model_type") == "gemma2" else int(config.get("sliding_window_pattern", 6))


def _check_gemma(folder, config: dict) -> None:
  """What a Gemma 2 / 3 config must say for our gemma blocks to be its model: the tanh GELU, and global_every − 1
  sliding layers before each full one (model.global_every)."""
  act = config.get("hidden_activation") or config.get("hidden_act")
  if act not in (None, "gelu_pytorch_tanh"):
    raise ValueError(f"{str(folder)!r} config.json hidden_activation={act!r}; clis-train's gemma blocks run "
                     "gelu_pytorch_tanh")
  kinds, every = config.get("layer_types"), _global_every(config)
  if kinds is not None and list(kinds) != ["full_attention" if (i + 1) % every == 0 else "sliding_attention"
                                           for i in range(len(kinds))]:
    raise ValueError(f"{str(folder)!r} config.json layer_types={kinds!r}; clis-train's model puts a full attention "
                     f"layer after every {every - 1} sliding ones (model.global_every={every})")


def _gemma3_rope(folder, config: dict) -> dict:
  """Gemma 3's two RoPEs as model.* values: rope_theta and rope_linear_factor (full layers), local_rope_theta."""
  params = config.get("rope_parameters") or {}
  full, local = params.get("full_attention", {}), params.get("sliding_attention", {})
  if full.get("rope_type", "default") not in ("default", "linear") or local.get("rope_type", "default") != "default":
    raise ValueError(f"{str(folder)!r} config.json rope_parameters={params!r}; clis-train's gemma3 block takes "
                     "default or linear RoPE on full layers and default RoPE on sliding ones")
  return {"rope_theta": full.get("rope_theta"), "local_rope_theta": local.get("rope_theta"),
          "rope_linear_factor": full.get("factor") if full.get("rope_type") == "linear" else None}


def _hf_name(path: tuple[str, ...], sandwich: bool = False) -> str:
  """Hugging Face's name of our parameter at `path` (Gemma's layer names where the block has sandwich norms)."""
  if path[0] == "embed":
    return "model.embed_tokens.weight"
  if path[0] == "norm":
    return "model.norm.weight"
  if path[0] == "lm_head":
    return "lm_head.weight"
  layer = int(path[0].removeprefix("layer_"))
  return f"model.layers.{layer}.{(_GEMMA2_LAYER if sandwich else _LAYER)[path[1:]]}"


def load_llama_safetensors(folder: pathlib.Path, abstract_params, dims=None):
  """Reads every *.safetensors file in `folder` into a float32 tree shaped like abstract_params (after
  check_config against `dims`, when given)."""
  if dims is not None:
    check_config(folder, dims)
  kind = model.BLOCKS["llama" if dims is None else dims.block]
  tensors = {}
  for file in sorted(folder.glob("*.safetensors")):
    with safe_open(str(file), framework="flax") as f:
      for name in f.keys():
        tensors[name] = f.get_tensor(name)

  def convert(path, leaf):
    keys = tuple(p.key for p in path)
    name = _hf_name(keys, kind.sandwich_norms)
    if name not in tensors:
      raise ValueError(f"{folder}: no tensor {name!r} for parameter {'/'.join(keys)} (is this a Llama checkpoint "
                       "with the configured number of layers?)")
    value = jnp.asarray(tensors[name], jnp.float32)
    if keys[-1] == "kernel":
      value = value.T
    if keys[-1] == "scale":  # Gemma's norms multiply by (1 + w): our scale is 1 + w
      value = value + kind.norm_offset
    if value.shape != tuple(leaf.shape):
      raise ValueError(f"{folder}: {name} has shape {value.shape} but the model expects {tuple(leaf.shape)} "
                       f"for {'/'.join(keys)}; set model.* to the checkpoint's config")
    return value

  return jax.tree_util.tree_map_with_path(convert, abstract_params)


def llama_config(dims, *, max_positions: int, bos_id, eos_id) -> dict:
  """transformers' LlamaConfig for our dims (rope_theta and Llama 3's scaling both flat, for transformers 4, and in
  rope_parameters, as transformers 5 writes it). Dims beyond Llama's (a window, caps, sinks, a split v head dim)
  have no Llama config: an error names them."""
  beyond = [name for name in ("v_head_dim", "attn_soft_cap", "final_soft_cap", "sliding_window", "sinks",
                              "query_pre_attn_scalar", "qkv_bias", "qk_norm") if getattr(dims, name) not in (None, False)]
  if dims.block != "llama":
    beyond.append(f"block={dims.block!r}")
  if beyond:
    raise ValueError(f"a model with {', '.join(beyond)} set has no Hugging Face Llama config; export it as an "
                     "orbax checkpoint (its run folder) instead")
  rope = {"rope_type": "default", "rope_theta": dims.rope_theta}
  if dims.rope_scaling is not None:
    factor, low, high, original = dims.rope_scaling
    rope = {"rope_type": "llama3", "rope_theta": dims.rope_theta, "factor": factor, "low_freq_factor": low,
            "high_freq_factor": high, "original_max_position_embeddings": int(original)}
  return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": dims.vocab_size,
          "hidden_size": dims.dim, "intermediate_size": dims.ffn_dim, "num_hidden_layers": dims.n_layers,
          "num_attention_heads": dims.n_heads, "num_key_value_heads": dims.n_kv_heads, "head_dim": dims.head_dim,
          "hidden_act": "silu", "rms_norm_eps": dims.norm_eps, "rope_theta": dims.rope_theta,
          "rope_scaling": None if dims.rope_scaling is None else {k: v for k, v in rope.items() if k != "rope_theta"},
          "rope_parameters": rope,
          "tie_word_embeddings": dims.tie_embeddings, "max_position_embeddings": max_positions,
          "attention_bias": False, "mlp_bias": False, "bos_token_id": bos_id, "eos_token_id": eos_id,
          "torch_dtype": "float32"}


def _int_if_whole(x):
  return int(x) if float(x).is_integer() else x


def gemma2_config(dims, *, max_positions: int, bos_id, eos_id) -> dict:
  """transformers' Gemma2Config for a model.block=gemma2 model: its layers all full (no window) or alternating
  from a sliding one (global_every=2); other dims beyond Gemma 2's get an error naming them."""
  beyond = [name for name in ("v_head_dim", "sinks", "rope_scaling", "qkv_bias", "qk_norm")
            if getattr(dims, name) not in (None, False)]
  if dims.sliding_window is not None and dims.global_every != 2:
    beyond.append(f"global_every={dims.global_every} (Gemma 2 alternates from a sliding layer: 2)")
  if beyond:
    raise ValueError(f"a gemma2 model with {', '.join(beyond)} has no Hugging Face Gemma 2 config; export it as an "
                     "orbax checkpoint (its run folder) instead")
  kinds = ["sliding_attention" if dims.sliding_window is not None and i % 2 == 0 else "full_attention"
           for i in range(dims.n_layers)]
  return {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "vocab_size": dims.vocab_size,
          "hidden_size": dims.dim, "intermediate_size": dims.ffn_dim, "num_hidden_layers": dims.n_layers,
          "num_attention_heads": dims.n_heads, "num_key_value_heads": dims.n_kv_heads, "head_dim": dims.head_dim,
          "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": dims.norm_eps, "rope_theta": dims.rope_theta,
          "rope_parameters": {"rope_type": "default", "rope_theta": dims.rope_theta},
          "query_pre_attn_scalar": _int_if_whole(dims.query_pre_attn_scalar or dims.head_dim),  # Gemma2Config: int
          "sliding_window": dims.sliding_window or max_positions, "layer_types": kinds,
          "attn_logit_softcapping": dims.attn_soft_cap, "final_logit_softcapping": dims.final_soft_cap,
          "tie_word_embeddings": dims.tie_embeddings, "max_position_embeddings": max_positions,
          "attention_bias": False, "bos_token_id": bos_id, "eos_token_id": eos_id, "torch_dtype": "float32"}


def save_llama_safetensors(params, dims, folder: pathlib.Path, *, max_positions: int, tokenizer_path: str | None,
                           bos_id=None, eos_id=None) -> list[pathlib.Path]:
  """Writes model.safetensors (float32, Hugging Face names and [out, in] layout) and config.json (Llama's, or
  Gemma 2's for model.block=gemma2, whose norms go out as w of (1 + w)), plus tokenizer.json when the run had one;
  returns the files written. The folder must not exist or be empty: an export never overwrites."""
  from safetensors.numpy import save_file
  folder = pathlib.Path(folder)
  if folder.exists() and any(folder.iterdir()):
    raise FileExistsError(f"--hf {str(folder)!r} exists and is not empty; choose a new folder (an export never "
                          "overwrites)")
  make_config = gemma2_config if dims.block == "gemma2" else llama_config
  config = make_config(dims, max_positions=max_positions, bos_id=bos_id, eos_id=eos_id)  # before any file
  folder.mkdir(parents=True, exist_ok=True)
  tensors = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    keys = tuple(p.key for p in path)
    value = np.asarray(leaf, np.float32)
    if keys[-1] == "scale":
      value = value - dims.kind.norm_offset
    tensors[_hf_name(keys, dims.kind.sandwich_norms)] = np.ascontiguousarray(value.T if keys[-1] == "kernel" else value)
  written = [folder / "model.safetensors", folder / "config.json"]
  save_file(tensors, str(written[0]), metadata={"format": "pt"})
  written[1].write_text(json.dumps(config, indent=1))
  if tokenizer_path is not None:
    written.append(folder / "tokenizer.json")
    shutil.copyfile(tokenizer_path, written[-1])
  return written
