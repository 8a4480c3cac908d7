"""Our Flax Llama equals Hugging Face transformers' Llama (PyTorch, CPU) after the safetensors import."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess

import numpy as np
import pytest

from clis_train import checkpoint
from clis_train.config import load_config
from clis_train.train import Trainer

pytestmark = pytest.mark.hf

ROOT = pathlib.Path(__file__).parent.parent
HF_PYTHON = os.environ.get("CLIS_HF_PYTHON", str(ROOT / ".venv-hf" / "bin" / "python"))


def _hf_reference(tmp_path_factory, name, *args):
  if not pathlib.Path(HF_PYTHON).exists():
    if os.environ.get("CLIS_REQUIRE_HF") == "1":  # scripts/test.sh's full run (CI) sets it
      pytest.fail(f"{HF_PYTHON} is missing: scripts/setup.sh makes it (Python 3.11 + torch + transformers)")
    pytest.skip(f"{HF_PYTHON} is missing (scripts/setup.sh makes it); CI requires it")
  out = tmp_path_factory.mktemp(name)
  subprocess.run([HF_PYTHON, str(ROOT / "scripts" / "hf_reference.py"), "--out", str(out), *args], check=True)
  return out


@pytest.fixture(scope="module")
def hf_tiny(tmp_path_factory):
  return _hf_reference(tmp_path_factory, "hf_tiny")


@pytest.fixture(scope="module")
def hf_tiny_llama3(tmp_path_factory):
  """Llama 3.1+'s RoPE scaling with an original context of 32, so that 64 tokens meet all three bands."""
  return _hf_reference(tmp_path_factory, "hf_tiny_llama3", "--rope-scaling", "8", "1", "4", "32")


@pytest.fixture(scope="module")
def hf_tiny_mistral(tmp_path_factory):
  """A Mistral whose sliding window (16) is shorter than the 64 tokens compared."""
  return _hf_reference(tmp_path_factory, "hf_tiny_mistral", "--mistral-window", "16")


@pytest.fixture(scope="module", params=[2, 3], ids=["qwen2", "qwen3"])
def hf_tiny_qwen(request, tmp_path_factory):
  """(version, folder): a Qwen 2 (q, k, v biases) or Qwen 3 (QK norms) of TINY's dims."""
  return request.param, _hf_reference(tmp_path_factory, f"hf_tiny_qwen{request.param}", "--qwen", str(request.param))


@pytest.fixture(scope="module")
def hf_tiny_gemma2(tmp_path_factory):
  return _hf_reference(tmp_path_factory, "hf_tiny_gemma2", "--gemma2")


# scripts/hf_reference.py's GEMMA2, as model.* keys
GEMMA2 = ["model.dtype=float32", "model.preset=gemma2_tiny", "model.dim=128", "model.n_layers=3", "model.n_heads=4",
          "model.n_kv_heads=2", "model.qk_head_dim=32", "model.ffn_dim=384", "model.vocab_size=384",
          "model.rope_theta=10000.0", "model.norm_eps=1e-6", "model.sliding_window=16", "model.global_every=2",
          "model.attn_soft_cap=2.0", "model.final_soft_cap=3.0", "model.query_pre_attn_scalar=24",
          "data.seq_len=64", "mesh.data=1"]


@pytest.fixture(scope="module")
def hf_tiny_gemma3(tmp_path_factory):
  return _hf_reference(tmp_path_factory, "hf_tiny_gemma3", "--gemma3")


# scripts/hf_reference.py's GEMMA3, as model.* keys
GEMMA3 = ["model.dtype=float32", "model.preset=tiny", "model.block=gemma3", "model.qk_norm=true", "model.dim=128",
          "model.n_layers=3", "model.n_heads=4", "model.n_kv_heads=2", "model.qk_head_dim=32", "model.ffn_dim=384",
          "model.vocab_size=384", "model.tie_embeddings=true", "model.norm_eps=1e-6", "model.sliding_window=16",
          "model.global_every=3", "model.rope_theta=1000000.0", "model.local_rope_theta=10000.0",
          "model.rope_linear_factor=8.0", "model.query_pre_attn_scalar=24", "data.seq_len=64", "mesh.data=1"]


TINY = ["model.dtype=float32", "model.dim=128", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
        "model.ffn_dim=384", "model.vocab_size=384", "model.rope_theta=10000.0", "model.norm_eps=1e-5",
        "model.tie_embeddings=false", "data.seq_len=64", "mesh.data=1"]


def _imported_logits(folder, tmp_path, overrides):
  """(ours, transformers') logits on the reference's tokens: the trainer of `overrides` (cpt_tiny.yaml) with the
  reference folder's safetensors imported."""
  trainer = Trainer(load_config(str(ROOT / "recipes" / "cpt_tiny.yaml"), [f"run_dir={tmp_path}", *overrides]))
  params = checkpoint.load_params(str(folder), trainer.abstract_state["params"], dims=trainer.dims)
  tokens = np.load(folder / "tokens.npy").astype(np.int32)
  return np.asarray(trainer.logits(params, tokens)), np.load(folder / "logits.npy")


def _assert_close(got, want):
  rel = np.linalg.norm(got - want) / np.linalg.norm(want)
  assert rel < 1e-4, rel
  assert np.abs(got - want).max() < 1e-3 * np.abs(want).max()


@pytest.mark.parametrize("attention,scaled", [("clis", False), ("dot_product", False), ("clis", True)])
def test_logits_match_transformers_llama(hf_tiny, hf_tiny_llama3, tmp_path, attention, scaled):
  folder = hf_tiny_llama3 if scaled else hf_tiny
  _assert_close(*_imported_logits(folder, tmp_path, [
      f"attention={attention}", *TINY, *(["model.rope_scaling=[8, 1, 4, 32]"] if scaled else [])]))


@pytest.mark.parametrize("attention", ["clis", "dot_product"])
def test_logits_match_transformers_qwen(hf_tiny_qwen, tmp_path, attention):
  """Qwen 2 (model.qkv_bias) and Qwen 3 (model.qk_norm) on Llama's blocks, imported, against transformers."""
  version, folder = hf_tiny_qwen
  key = "qkv_bias" if version == 2 else "qk_norm"
  _assert_close(*_imported_logits(folder, tmp_path, [f"attention={attention}", *TINY, f"model.{key}=true"]))
  plain = Trainer(load_config(str(ROOT / "recipes" / "cpt_tiny.yaml"), [f"run_dir={tmp_path / 'plain'}", *TINY]))
  with pytest.raises(checkpoint.CheckpointError, match=f"set model.{key}=True"):
    checkpoint.load_params(str(folder), plain.abstract_state["params"], dims=plain.dims)


@pytest.mark.parametrize("attention", ["clis", "dot_product"])
def test_logits_match_transformers_gemma2(hf_tiny_gemma2, tmp_path, attention):
  """Gemma 2's block (sandwich norms, GeGLU, (1 + w) norms, sqrt(dim)-scaled embeddings, query_pre_attn_scalar)
  with its alternating window and both soft caps, imported from safetensors, against transformers."""
  _assert_close(*_imported_logits(hf_tiny_gemma2, tmp_path, [f"attention={attention}", *GEMMA2]))


@pytest.mark.parametrize("attention", ["clis", "dot_product"])
def test_logits_match_transformers_gemma3(hf_tiny_gemma3, tmp_path, attention):
  """Gemma 3 text (QK norms with (1 + w), a full layer after every two sliding ones, RoPE base 1e4 on sliding layers
  and 1e6 with linear scaling 8 on full ones), imported, against transformers; a model with one RoPE is told the
  keys to set."""
  _assert_close(*_imported_logits(hf_tiny_gemma3, tmp_path, [f"attention={attention}", *GEMMA3]))
  one_rope = load_config(str(ROOT / "recipes" / "cpt_tiny.yaml"), [f"run_dir={tmp_path / 'one'}", *GEMMA3[:-5],
                                                                   "model.query_pre_attn_scalar=24", *GEMMA3[-2:]])
  trainer = Trainer(one_rope)
  with pytest.raises(checkpoint.CheckpointError, match=r"local_rope_theta=10000\.0 \(ours: None\), "
                                                       r"model\.rope_linear_factor=8\.0 \(ours: None\)"):
    checkpoint.load_params(str(hf_tiny_gemma3), trainer.abstract_state["params"], dims=trainer.dims)


def test_a_gemma2_export_loads_in_transformers_with_the_same_logits(hf_tiny_gemma2, tmp_path):
  """Imported, exported (Gemma 2's config and (1 + w) norms written back as w) and loaded by transformers: the
  original model's logits."""
  from clis_train import hf
  cfg = load_config(str(ROOT / "recipes" / "cpt_tiny.yaml"), [f"run_dir={tmp_path / 'run'}", *GEMMA2])
  trainer = Trainer(cfg)
  params = checkpoint.load_params(str(hf_tiny_gemma2), trainer.abstract_state["params"], dims=trainer.dims)
  folder = tmp_path / "exported"
  hf.save_llama_safetensors(params, trainer.dims, folder, max_positions=512, tokenizer_path=None)
  config = json.loads((folder / "config.json").read_text())
  assert config["layer_types"] == ["sliding_attention", "full_attention", "sliding_attention"]
  subprocess.run([HF_PYTHON, str(ROOT / "scripts" / "hf_reference.py"), "--load", str(folder), "--tokens",
                  str(hf_tiny_gemma2 / "tokens.npy"), "--out", str(tmp_path / "logits.npy")], check=True)
  want, got = np.load(hf_tiny_gemma2 / "logits.npy"), np.load(tmp_path / "logits.npy")
  assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-5


def test_a_gemma2_config_that_our_block_is_not_is_one_clear_error(hf_tiny_gemma2, tmp_path):
  """Each Gemma 2 setting the model does not share is named with its model.* key; a layer pattern or activation our
  block does not run is one error."""
  cfg = load_config(str(ROOT / "recipes" / "cpt_tiny.yaml"), [f"run_dir={tmp_path}", *GEMMA2[:-2],
                                                              "model.query_pre_attn_scalar=32", "model.block=llama",
                                                              "data.seq_len=64", "mesh.data=1"])
  trainer = Trainer(cfg)
  with pytest.raises(checkpoint.CheckpointError, match=r"set model\.block='gemma2' \(ours: 'llama'\), "
                                                          r"model\.query_pre_attn_scalar=24 \(ours: 32\.0\)"):
    checkpoint.load_params(str(hf_tiny_gemma2), trainer.abstract_state["params"], dims=trainer.dims)
  config = json.loads((hf_tiny_gemma2 / "config.json").read_text())
  odd = tmp_path / "odd"
  odd.mkdir()
  (odd / "model.safetensors").symlink_to(hf_tiny_gemma2 / "model.safetensors")
  (odd / "config.json").write_text(json.dumps({**config, "layer_types": ["full_attention"] * 3}))
  with pytest.raises(checkpoint.CheckpointError, match=r"puts a full attention layer after every 1 sliding ones "
                                                       r"\(model\.global_every=2\)"):
    checkpoint.load_params(str(odd), trainer.abstract_state["params"], dims=trainer.dims)


@pytest.mark.parametrize("attention", ["clis", "dot_product"])
def test_logits_match_transformers_mistral_with_a_sliding_window(hf_tiny_mistral, tmp_path, attention):
  """model.sliding_window takes a Hugging Face config's value as it is: each query sees that many keys, itself
  included (one key wider, the convention before, gave a relative logits error of 0.13 here)."""
  _assert_close(*_imported_logits(hf_tiny_mistral, tmp_path, [f"attention={attention}", *TINY,
                                                              "model.sliding_window=16"]))


def test_a_checkpoint_of_another_shape_or_architecture_is_one_clear_error(hf_tiny, tmp_path):
  """config.json is read before any tensor: a setting that differs names the model.* key to set; an architecture
  our blocks cannot run names what they lack."""
  cfg = load_config(str(ROOT / "recipes" / "cpt_tiny.yaml"), [f"run_dir={tmp_path / 'run'}", *TINY,
                                                              "model.rope_theta=500000.0"])
  trainer = Trainer(cfg)
  with pytest.raises(checkpoint.CheckpointError, match=r"set model.rope_theta=10000.0 \(ours: 500000.0\)"):
    checkpoint.load_params(str(hf_tiny), trainer.abstract_state["params"], dims=trainer.dims)
  for kind, lacks in (("gemma3", "vision tower"), ("gpt_oss", "mixture-of-experts MLP"),
                      ("deepseek_v3", "MLA's low-rank")):
    folder = tmp_path / kind
    folder.mkdir()
    for file in hf_tiny.glob("*.safetensors"):
      (folder / file.name).symlink_to(file)
    (folder / "config.json").write_text(json.dumps({"model_type": kind}))
    with pytest.raises(checkpoint.CheckpointError, match=f"holds a '{kind}' model .* lacks .*{lacks}"):
      checkpoint.load_params(str(folder), trainer.abstract_state["params"], dims=trainer.dims)
