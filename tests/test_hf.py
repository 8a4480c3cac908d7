"""Our Flax Llama equals Hugging Face transformers' Llama (PyTorch, CPU) after the safetensors import."""

from __future__ import annotations

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


@pytest.fixture(scope="module")
def hf_tiny(tmp_path_factory):
  if not pathlib.Path(HF_PYTHON).exists():
    if os.environ.get("CLIS_REQUIRE_HF") == "1":  # scripts/test.sh's full run (CI) sets it
      pytest.fail(f"{HF_PYTHON} is missing: scripts/setup.sh makes it (Python 3.11 + torch + transformers)")
    pytest.skip(f"{HF_PYTHON} is missing (scripts/setup.sh makes it); CI requires it")
  out = tmp_path_factory.mktemp("hf_tiny")
  subprocess.run([HF_PYTHON, str(ROOT / "scripts" / "hf_reference.py"), "--out", str(out)], check=True)
  return out


@pytest.mark.parametrize("attention", ["clis", "dot_product"])
def test_logits_match_transformers_llama(hf_tiny, tmp_path, attention):
  cfg = load_config(str(ROOT / "recipes" / "cpt_tiny.yaml"), [
      f"run_dir={tmp_path}", f"attention={attention}", "model.dtype=float32", "model.dim=128", "model.n_layers=2",
      "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_dim=384", "model.vocab_size=384",
      "model.rope_theta=10000.0", "model.norm_eps=1e-5", "model.tie_embeddings=false", "data.seq_len=64",
      "mesh.data=1"])
  trainer = Trainer(cfg)
  params = checkpoint.load_params(str(hf_tiny), trainer.abstract_state["params"])
  tokens = np.load(hf_tiny / "tokens.npy").astype(np.int32)
  want = np.load(hf_tiny / "logits.npy")
  got = np.asarray(trainer.logits(params, tokens))
  rel = np.linalg.norm(got - want) / np.linalg.norm(want)
  assert rel < 1e-4, rel
  assert np.abs(got - want).max() < 1e-3 * np.abs(want).max()
