"""The other families' attention in the trainer's model (clis_train/model.py presets gemma2_*, gpt_oss_*,
deepseek_*): sliding windows on alternate layers, logits soft caps, learned sinks and split q·k / v head dims,
through the CPU backends, the cached decoder, the trainer and its config checks."""

from __future__ import annotations

import dataclasses
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from clis_train import model
from clis_train.attention import make_attention
from clis_train.config import ConfigError, load_config
from clis_train.train import Trainer

RECIPES = pathlib.Path(__file__).parent.parent / "recipes"
FAMILIES = ("gemma2_tiny", "gemma3_tiny", "gpt_oss_tiny", "deepseek_tiny")


def _transformer(dims, attention="clis", **kw):
  return model.Transformer(dims, make_attention(attention, None), dtype=jnp.float32, **kw)


def _tokens(seed, batch, seq, vocab):
  tokens = jax.random.randint(jax.random.PRNGKey(seed), (batch, seq), 0, vocab)
  positions = jnp.broadcast_to(jnp.arange(seq), (batch, seq))
  return tokens, positions, jnp.ones_like(tokens)


def _params(dims, seed=0, seq=64):
  params = model.init_params(model.abstract_params(_transformer(dims), (1, seq)), jax.random.PRNGKey(seed))
  if dims.sinks:  # learned sinks start at 0; give each head its own, as a trained model has
    params = jax.tree_util.tree_map_with_path(
        lambda p, x: jnp.linspace(-2.0, 3.0, x.shape[0]) if p[-1].key == "sinks" else x, params)
  return params


def test_layer_windows_follow_the_family():
  gemma, oss = model.PRESETS["gemma2_2b"], model.PRESETS["gpt_oss_20b"]
  # sliding_window counts the query itself (Hugging Face's convention); layer_window is the keys before it
  assert [gemma.layer_window(i) for i in range(4)] == [4095, None, 4095, None]  # local first, then global
  assert [oss.layer_window(i) for i in range(4)] == [127, None, 127, None]
  gemma3_like = dataclasses.replace(gemma, global_every=6, sliding_window=1024)
  assert [gemma3_like.layer_window(i) for i in range(7)] == [1023] * 5 + [None, 1023]
  mistral_like = dataclasses.replace(model.PRESETS["8b"], sliding_window=4096)
  assert {mistral_like.layer_window(i) for i in range(32)} == {4095}
  assert {model.PRESETS["8b"].layer_window(i) for i in range(32)} == {None}
  deepseek = model.PRESETS["deepseek_v2_lite"]
  assert (deepseek.head_dim, deepseek.value_dim) == (192, 128)


def test_keys_per_query_counts_every_visible_key():
  for window, global_every, seq in ((None, None, 37), (8, None, 37), (8, 2, 37), (50, None, 37), (8, None, 9)):
    dims = dataclasses.replace(model.PRESETS["tiny"], sliding_window=window, global_every=global_every)
    for layer in range(2):
      w = dims.layer_window(layer)
      seen = [min(i, w if w is not None else i) + 1 for i in range(seq)]
      assert model.attention_keys_per_query(dims, layer, seq) == pytest.approx(np.mean(seen))


@pytest.mark.parametrize("preset", FAMILIES)
def test_clis_matches_dense_attention_forward_and_gradients(preset):
  """The model on the CLiS path (the reference kernel on a CPU) and on dense XLA attention with the same options:
  the same logits and parameter gradients, with packed documents."""
  dims = model.PRESETS[preset]
  params = _params(dims)
  tokens, positions, _ = _tokens(1, 2, 64, dims.vocab_size)
  segment_ids = jnp.where(jnp.arange(64) < 40, 1, 2)[None].repeat(2, 0)
  loss = {}
  for attention in ("clis", "dot_product"):
    module = _transformer(dims, attention)

    def f(p):
      logits = module.apply({"params": p}, tokens, positions, segment_ids, mutable=["intermediates"])[0]
      return jnp.mean(jax.nn.log_softmax(logits)[..., 0]), logits

    loss[attention] = jax.value_and_grad(f, has_aux=True)(params)
  (_, clis_logits), clis_grads = loss["clis"]
  (_, dense_logits), dense_grads = loss["dot_product"]
  np.testing.assert_allclose(clis_logits, dense_logits, rtol=2e-5, atol=2e-5)
  for (path, g), d in zip(jax.tree_util.tree_flatten_with_path(clis_grads)[0], jax.tree.leaves(dense_grads)):
    assert float(jnp.linalg.norm(g - d)) <= 1e-4 * float(jnp.linalg.norm(d)) + 1e-8, jax.tree_util.keystr(path)
  if dims.sinks:
    assert float(jnp.abs(clis_grads["layer_0"]["attention"]["sinks"]).max()) > 0  # the sinks learn


@pytest.mark.parametrize("preset", FAMILIES)
def test_cached_decoding_matches_the_full_forward(preset):
  """model.cached_attention (dense, written apart from the kernels) applies the same window, cap and sinks: decoding
  token by token gives the full forward's logits."""
  dims = model.PRESETS[preset]
  params = _params(dims, seed=2)
  seq = 48  # past gemma2_tiny's and gpt_oss_tiny's window of 32
  tokens, positions, segment_ids = _tokens(3, 1, seq, dims.vocab_size)
  full = _transformer(dims).apply({"params": params}, tokens, positions, segment_ids, mutable=["intermediates"])[0]
  decoder = _transformer(dims, decode=True)
  cache = decoder.init(jax.random.PRNGKey(0), tokens, positions, segment_ids)["cache"]
  step = jax.jit(lambda cache, *xs: decoder.apply({"params": params, "cache": cache}, *xs,
                                                 mutable=["cache", "intermediates"]))
  prompt = 40
  logits, state = step(cache, tokens[:, :prompt], positions[:, :prompt], segment_ids[:, :prompt])
  np.testing.assert_allclose(logits, full[:, :prompt], rtol=2e-5, atol=2e-5)
  for i in range(prompt, seq):
    logits, state = step(state["cache"], tokens[:, i:i + 1], positions[:, i:i + 1], segment_ids[:, i:i + 1])
    np.testing.assert_allclose(logits[:, 0], full[:, i], rtol=2e-5, atol=2e-5)


def test_a_window_limits_what_each_layer_sees():
  """Two local layers of window 16 (each query sees itself and the 15 keys before it): a token reaches 30 positions
  ahead and no further; one global layer (global_every=2) lets it reach every later position."""
  tokens, positions, segment_ids = _tokens(4, 1, 96, 384)
  changed = tokens.at[0, 0].set((tokens[0, 0] + 1) % 384)
  for global_every, reach in ((None, 30), (2, 95)):
    dims = dataclasses.replace(model.PRESETS["gemma2_tiny"], sliding_window=16, global_every=global_every)
    module = _transformer(dims)
    params = _params(dims, seed=5)
    run = lambda t: module.apply({"params": params}, t, positions, segment_ids, mutable=["intermediates"])[0]
    moved = np.abs(np.asarray(run(changed) - run(tokens))).max(-1)[0]
    assert (moved[:reach + 1] > 0).all() and (moved[reach + 1:] == 0).all(), global_every


def test_family_presets_train(tmp_path):
  """gpt_oss_tiny (sinks, alternating window) through the trainer: finite losses that fall, certified fraction
  logged, sinks updated."""
  cfg = load_config(str(RECIPES / "cpt_tiny.yaml"), [
      f"run_dir={tmp_path}", "model.preset=gpt_oss_tiny", "data.seq_len=128", "data.per_device_batch=4", "mesh.data=1",
      "train.progress_bar=false", "train.eval_every=1000", "train.steps=6", "train.log_every=1", "optim.lr=3e-3",
      "optim.warmup_steps=0"])
  trainer = Trainer(cfg)
  records = [r for r in trainer.run() if "loss" in r]
  assert len(records) == 6 and all(np.isfinite(r["loss"]) for r in records)
  assert records[-1]["loss"] < records[0]["loss"]
  assert all(0.0 <= r["certified_fraction"] <= 1.0 for r in records)


def test_options_a_backend_cannot_run_are_one_config_error(tmp_path):
  base = [f"run_dir={tmp_path}", "data.seq_len=128", "mesh.data=1"]
  cases = {
      ("model.preset=gpt_oss_tiny", "attention=tokamax"): "attention='tokamax' takes no sinks",
      ("model.preset=gemma2_tiny", "mesh.context=2"): "with mesh.context=2 takes no sliding window",
      ("model.preset=tiny", "model.global_every=2"): "model.sliding_window is null",
      ("model.preset=deepseek_tiny", "model.qk_head_dim=33"): "must be even for RoPE",
      ("model.preset=gemma2_tiny", "model.attn_soft_cap=-1"): r"model.attn_soft_cap=-1(\.0)? must be a positive number",
  }
  for overrides, message in cases.items():
    with pytest.raises(ConfigError, match=message):
      Trainer(load_config(str(RECIPES / "cpt_tiny.yaml"), [*base, *overrides]))
