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
from clis_train.config import Config, load_run_config
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
  dummy = jnp.zeros((1, seq_len), jnp.int32)
  return jax.eval_shape(module.init, jax.random.PRNGKey(0), dummy, dummy, jnp.ones_like(dummy))["params"]


def load_run(run_dir: str, *, step: int | None = None, attention: str | None = None, overrides=(),
             init: bool = False) -> LoadedRun:
  """Loads run_dir's newest checkpoint (or `step`); init=True gives the run's model at initialisation
  (its seed), which needs no checkpoint."""
  cfg = load_run_config(run_dir, overrides)
  tokenizer, dims, module = build_module(cfg, attention=attention)
  if init:
    dummy = jnp.zeros((1, 8), jnp.int32)
    params = jax.jit(module.init)(jax.random.PRNGKey(cfg.seed), dummy, dummy, jnp.ones_like(dummy))["params"]
    return LoadedRun(cfg, tokenizer, dims, module, params, None)
  if not (pathlib.Path(run_dir) / "checkpoints").is_dir():
    raise CheckpointError(f"run_dir={run_dir!r} has no checkpoints/ folder yet: train it first (checkpoint.every "
                          "sets how often a run saves)")
  steps = checkpoint.saved_steps(run_dir, "run_dir")
  params = checkpoint.load_params(run_dir, abstract_params(module), step=step, what="run_dir")
  return LoadedRun(cfg, tokenizer, dims, module, params, steps[-1] if step is None else step)
