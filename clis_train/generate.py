"""Text generation from a trained run: the same model with a K/V cache (Transformer(decode=True)).

One prompt at a time: the prompt runs as one prefill call, then one jitted step per new token.
Sampling: greedy (temperature 0), or temperature with optional top-k and top-p (nucleus).
SFT runs wrap the prompt in the chat template they trained with (data.SFT_TEMPLATE).
Decode steps use dense XLA attention over the cache (model.cached_attention).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from clis_train import data, model
from clis_train.errors import ConfigError
from clis_train.runs import LoadedRun


@dataclasses.dataclass(frozen=True)
class Sampling:
  max_tokens: int = 64
  temperature: float = 0.0  # 0: greedy
  top_k: int = 0  # 0: off
  top_p: float = 1.0  # 1: off
  seed: int = 0

  def __post_init__(self):
    if self.max_tokens < 1:
      raise ConfigError(f"--max-tokens={self.max_tokens} must be >= 1")
    if self.temperature < 0:
      raise ConfigError(f"--temperature={self.temperature} must be >= 0 (0 is greedy)")
    if self.top_k < 0:
      raise ConfigError(f"--top-k={self.top_k} must be >= 0 (0 turns it off)")
    if not 0 < self.top_p <= 1:
      raise ConfigError(f"--top-p={self.top_p} must be in (0, 1]")


def next_token(logits, key, sampling: Sampling):
  """One token id from float32 logits [vocab]."""
  if sampling.temperature == 0:
    return jnp.argmax(logits)
  logits = logits / sampling.temperature
  if sampling.top_k:
    kth = jnp.sort(logits)[-min(sampling.top_k, logits.shape[-1])]
    logits = jnp.where(logits < kth, -jnp.inf, logits)
  if sampling.top_p < 1:
    order = jnp.argsort(-logits)
    probs = jax.nn.softmax(logits[order])
    before = jnp.cumsum(probs) - probs  # mass of the tokens ranked above each one
    keep = jnp.zeros_like(logits, bool).at[order].set(before < sampling.top_p)
    logits = jnp.where(keep, logits, -jnp.inf)
  return jax.random.categorical(key, logits)


def prompt_ids(run: LoadedRun, prompt: str) -> list[int]:
  """BOS + the prompt, in the chat template for SFT runs (as the trainer built its examples)."""
  text = data.SFT_TEMPLATE.format(prompt=prompt) if run.cfg.data.kind == "sft" else prompt
  tok = run.tokenizer
  return [tok.bos_id] * (tok.bos_id is not None) + tok.encode(text)


class Generator:
  """Holds the decode module and its jitted steps for one run; call `generate(prompt)`."""

  def __init__(self, run: LoadedRun, sampling: Sampling):
    self.run, self.sampling = run, sampling
    self.module = model.Transformer(run.dims, run.module.attend, dtype=run.module.dtype, decode=True)

  def _empty_cache(self, length: int):
    dummy = jnp.zeros((1, length), jnp.int32)
    shapes = jax.eval_shape(self.module.init, jax.random.PRNGKey(0), dummy, dummy, jnp.ones_like(dummy))["cache"]
    return jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes)

  @functools.partial(jax.jit, static_argnums=0)
  def _step(self, params, cache, tokens, positions):
    logits, extra = self.module.apply({"params": params, "cache": cache}, tokens, positions, jnp.ones_like(tokens),
                                      mutable=["cache", "intermediates"])
    return logits[0, -1], extra["cache"]

  def token_ids(self, ids: list[int]) -> list[int]:
    """New token ids after `ids` (stops at EOS, which is not returned, or after max_tokens)."""
    s = self.sampling
    length = -(-(len(ids) + s.max_tokens) // 128) * 128  # cache sizes in steps of 128: fewer compiles
    cache = self._empty_cache(length)
    tokens = jnp.asarray([ids], jnp.int32)
    logits, cache = self._step(self.run.params, cache, tokens, jnp.arange(len(ids))[None])
    key, out, vocab = jax.random.PRNGKey(s.seed), [], self.run.tokenizer.vocab_size
    for i in range(s.max_tokens):
      key, sub = jax.random.split(key)
      token = int(next_token(logits[:vocab], sub, s))  # ids past the tokenizer's were never trained
      if token == self.run.tokenizer.eos_id:
        break
      out.append(token)
      if i + 1 < s.max_tokens:
        position = jnp.asarray([[len(ids) + i]], jnp.int32)
        logits, cache = self._step(self.run.params, cache, jnp.asarray([[token]], jnp.int32), position)
    return out

  def generate(self, prompt: str) -> str:
    return self.run.tokenizer.decode(self.token_ids(prompt_ids(self.run, prompt)))

  def __hash__(self):  # jit's static self: one cache of compiled steps per generator
    return id(self)

  def __eq__(self, other):
    return self is other
