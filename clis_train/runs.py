"""A trained model loaded back from its run folder: the config it trained with, its tokenizer, the
Flax module and the parameters of one checkpoint step. What `generate`, `eval`, `export` and the
activation analysis start from.
"""

from __future__ import annotations

import dataclasses
import pathlib

import jax
import jax.numpy as jnp

from clis_train import checkpoint, data, model
from clis_train.attention import make_attention
from clis_train.config import Config, load_config, load_run_config
from clis_train.errors import CheckpointError


@dataclasses.dataclass
class LoadedRun:
  cfg: Config
  tokenizer: object
  dims: model.ModelDims
  module: model.Transformer
  params: dict
  step: int | None  # None: freshly initialised (no checkpoint)

  def logits(self, tokens, positions=None, segment_ids=None):
    """Float32 logits [B, S, vocab] for int32 tokens [B, S] (one document per row by default)."""
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape) if positions is None else positions
    segment_ids = jnp.ones_like(tokens) if segment_ids is None else segment_ids
    return self.module.apply({"params": self.params}, tokens, positions, segment_ids, mutable=["intermediates"])[0]


def build_module(cfg: Config, *, attention: str | None = None):
  """(tokenizer, dims, module) for a config; `attention` replaces cfg.attention (e.g. dot_product on CPU)."""
  tokenizer = data.make_tokenizer(cfg.data.tokenizer)
  dims = model.resolve_dims(cfg.model, tokenizer.vocab_size)
  module = model.Transformer(dims, make_attention(attention or cfg.attention, None,
                                                  granularity=cfg.attention_granularity),
                             dtype=jnp.dtype(cfg.model.dtype))
  return tokenizer, dims, module


def abstract_params(module, seq_len: int = 8):
  return model.abstract_params(module, (1, seq_len))


def load_run(path: str, *, step: int | None = None, attention: str | None = None, overrides=(),
             init: bool = False, checkpoint_path: str | None = None) -> LoadedRun:
  """A run folder (its config.json and newest checkpoint, or `step`), or a recipe YAML whose run_dir
  (or checkpoint.init_from) holds the weights; `checkpoint_path` (a run folder, an orbax checkpoint
  folder or Hugging Face safetensors) overrides where they come from. init=True gives the model at
  initialisation (the config's seed), which needs no checkpoint."""
  is_recipe = pathlib.Path(path).suffix in (".yaml", ".yml")
  cfg = load_config(path, overrides) if is_recipe else load_run_config(path, overrides)
  tokenizer, dims, module = build_module(cfg, attention=attention)
  if init:
    params = model.init_params(abstract_params(module), jax.random.PRNGKey(cfg.seed))  # the trainer's step 0
    return LoadedRun(cfg, tokenizer, dims, module, params, None)
  source = checkpoint_path or _weights_of(cfg, path, is_recipe)
  what = "--checkpoint" if checkpoint_path else ("run_dir" if not is_recipe else f"{path}: run_dir")
  hf = pathlib.Path(source).is_dir() and bool(list(pathlib.Path(source).glob("*.safetensors")))
  params = checkpoint.load_params(source, abstract_params(module), step=step, what=what, dims=dims)
  if not hf and step is None:
    step = checkpoint.saved_steps(source, what)[-1]
  return LoadedRun(cfg, tokenizer, dims, module, params, None if hf else step)


def _weights_of(cfg: Config, path: str, is_recipe: bool) -> str:
  run_dir = pathlib.Path(path if not is_recipe else cfg.run_dir)
  if (run_dir / "checkpoints").is_dir() and checkpoint.saved_steps(str(run_dir), "run_dir"):
    return str(run_dir)
  if is_recipe and cfg.checkpoint.init_from:
    return cfg.checkpoint.init_from
  raise CheckpointError(f"run_dir={str(run_dir)!r} holds no checkpoint yet: train it first, or pass --checkpoint "
                        "(a run folder, an orbax checkpoint or a Hugging Face safetensors folder)")
