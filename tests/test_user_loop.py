"""What a user does after training (issue 20): generate, eval, export, TensorBoard, plots, the CLI."""

from __future__ import annotations

import json
import math
import os
import pathlib
import struct
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import yaml

from clis_train import checkpoint, cli, data, hf
from clis_train.config import load_config, to_dict
from clis_train.evaluate import evaluate, examples_for
from clis_train.generate import Generator, Sampling, next_token, prompt_ids
from clis_train.runs import load_run
from clis_train.train import train

ROOT = pathlib.Path(__file__).parent.parent
HF_PYTHON = os.environ.get("CLIS_HF_PYTHON", str(ROOT / ".venv-hf" / "bin" / "python"))
TINY = ["train.steps=6", "train.log_every=3", "train.eval_every=3", "checkpoint.every=3", "data.seq_len=64",
        "data.per_device_batch=4", "mesh.data=1", "train.progress_bar=false", "model.dtype=float32"]


def _train(run_dir, recipe="cpt_tiny.yaml", extra=()):
  return train(load_config(str(ROOT / "recipes" / recipe), [f"run_dir={run_dir}", *TINY, *extra]))


@pytest.fixture(scope="module")
def cpt_run(tmp_path_factory):
  run_dir = tmp_path_factory.mktemp("cpt") / "run"
  _train(run_dir)
  return run_dir


# ----------------------------------------------------------------------------- generate
def test_cached_decoding_gives_the_full_forward_logits(cpt_run):
  run = load_run(str(cpt_run))
  generator = Generator(run, Sampling(max_tokens=5))
  ids = prompt_ids(run, "def f(x):")
  cache = generator._empty_cache(128)
  logits, cache = generator._step(run.params, cache, jnp.asarray([ids]), jnp.arange(len(ids))[None])
  seq = list(ids)
  for _ in range(5):
    want = run.logits(jnp.asarray([seq]))[0, -1]
    np.testing.assert_allclose(np.asarray(logits), np.asarray(want), rtol=1e-5, atol=1e-5)
    token = int(jnp.argmax(want[:run.tokenizer.vocab_size]))
    logits, cache = generator._step(run.params, cache, jnp.asarray([[token]]), jnp.asarray([[len(seq)]]))
    seq.append(token)
  assert generator.token_ids(ids) == seq[len(ids):]  # greedy generation is that argmax chain


def test_sampling_options():
  logits = jnp.asarray([0.0, 3.0, 1.0, 2.9])
  key = jax.random.PRNGKey(0)
  assert int(next_token(logits, key, Sampling())) == 1
  assert int(next_token(logits, key, Sampling(temperature=5.0, top_k=1))) == 1  # top-1 is greedy
  assert int(next_token(logits, key, Sampling(temperature=5.0, top_p=0.01))) == 1  # so is a tiny nucleus
  draws = {int(next_token(logits, k, Sampling(temperature=1.0, top_k=2))) for k in jax.random.split(key, 64)}
  assert draws == {1, 3}  # top-2 keeps exactly the two likeliest
  # p = 0.024, 0.479, 0.065, 0.433: a nucleus of 0.95 keeps 1, 3 (0.911 before it) and 2, not 0 (0.976)
  draws = {int(next_token(logits, k, Sampling(temperature=1.0, top_p=0.95))) for k in jax.random.split(key, 300)}
  assert draws == {1, 2, 3}
  draws = {int(next_token(logits, k, Sampling(temperature=1.0, top_p=0.9))) for k in jax.random.split(key, 300)}
  assert draws == {1, 3}  # 0.479 + 0.433 = 0.911 >= 0.9: the nucleus stops there
  for bad in (dict(max_tokens=0), dict(temperature=-1.0), dict(top_k=-1), dict(top_p=0.0)):
    with pytest.raises(ValueError, match=list(bad)[0].replace("_", "-")):
      Sampling(**bad)


def test_generate_is_reproducible_and_sft_runs_use_their_template(cpt_run, tmp_path):
  run = load_run(str(cpt_run))
  sampled = lambda seed: Generator(run, Sampling(max_tokens=8, temperature=1.0, seed=seed)).generate("The ")
  assert sampled(3) == sampled(3)
  _train(tmp_path / "sft", "sft_tiny.yaml", ["train.steps=3", "checkpoint.every=3"])
  sft = load_run(str(tmp_path / "sft"))
  ids = prompt_ids(sft, "What is a list?")
  assert ids[0] == data.ByteTokenizer.bos_id
  assert bytes(ids[1:]).decode() == data.SFT_TEMPLATE.format(prompt="What is a list?")


def test_generate_command(cpt_run, tmp_path, capsys):
  prompts = tmp_path / "prompts.txt"
  prompts.write_text("import os\n\nclass A:\n")
  assert cli.main(["generate", str(cpt_run), "--prompts-file", str(prompts), "--max-tokens", "4", "--json"]) == 0
  lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
  assert [r["prompt"] for r in lines] == ["import os", "class A:"] and all(r["step"] == 6 for r in lines)
  assert cli.main(["generate", str(cpt_run)]) == 2
  assert "--prompt" in capsys.readouterr().err
  assert cli.main(["generate", str(tmp_path / "nowhere"), "--prompt", "x"]) == 2
  assert "not a run folder" in capsys.readouterr().err


# ----------------------------------------------------------------------------- eval
def test_eval_matches_a_direct_computation(cpt_run, tmp_path):
  run = load_run(str(cpt_run))
  text = tmp_path / "held.txt"
  text.write_text("def add(a, b):\n    return a + b\n" * 8)
  examples = examples_for(run, str(text))
  got = evaluate(run, examples, batch_size=2)
  nats = tokens = 0.0
  for ex in examples:
    logits = run.logits(jnp.asarray(ex["inputs"])[None])[0]
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.asarray(ex["targets"]))
    nats += float((ce * ex["weights"]).sum())
    tokens += float(ex["weights"].sum())
  assert got["tokens"] == tokens and abs(got["loss"] - nats / tokens) < 1e-5
  assert abs(got["perplexity"] - math.exp(got["loss"])) < 1e-6 * got["perplexity"]
  assert 0 < got["bits_per_byte"] and got["examples"] == len(examples)


def test_eval_command_writes_json(cpt_run, tmp_path, capsys):
  out = tmp_path / "eval.json"
  assert cli.main(["eval", str(cpt_run), "--out", str(out), "--step", "3"]) == 0
  result = json.loads(out.read_text())
  assert result["step"] == 3 and result["data"] == "held-out split" and math.isfinite(result["loss"])
  assert json.loads(capsys.readouterr().out) == result
  assert cli.main(["eval", str(cpt_run), "--step", "4"]) == 1
  assert "has no step 4; saved steps: [3, 6]" in capsys.readouterr().err


# ----------------------------------------------------------------------------- export
def _exported(run_dir, folder):
  assert cli.main(["export", str(run_dir), "--hf", str(folder)]) == 0
  return folder


def test_export_loads_back_with_identical_logits(tmp_path, capsys):
  run_dir = tmp_path / "untied"
  _train(run_dir, extra=["model.tie_embeddings=false"])
  folder = _exported(run_dir, tmp_path / "hf")
  assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors"]
  original = load_run(str(run_dir))
  again = load_run(str(ROOT / "recipes" / "cpt_tiny.yaml"), checkpoint_path=str(folder),
                   overrides=[f"run_dir={tmp_path / 'fresh'}", *TINY, "model.tie_embeddings=false"])
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 258, (2, 32)), jnp.int32)
  np.testing.assert_array_equal(np.asarray(original.logits(tokens)), np.asarray(again.logits(tokens)))
  assert cli.main(["export", str(run_dir), "--hf", str(folder)]) == 2  # never overwrites
  assert "not empty" in capsys.readouterr().err


def test_export_copies_the_tokenizer(tmp_path):
  tokenizer = tmp_path / "tokenizer.json"
  tokenizer.write_text("{}")
  run = load_run(str(ROOT / "recipes" / "cpt_tiny.yaml"), init=True, overrides=["model.dtype=float32"])
  written = hf.save_llama_safetensors(run.params, run.dims, tmp_path / "out", max_positions=256,
                                      tokenizer_path=str(tokenizer))
  assert [p.name for p in written] == ["model.safetensors", "config.json", "tokenizer.json"]
  config = json.loads((tmp_path / "out" / "config.json").read_text())
  assert config["num_key_value_heads"] == run.dims.n_kv_heads and config["tie_word_embeddings"] is True


def test_a_run_loaded_at_initialisation_is_the_trainers_step_zero(tmp_path):
  """load_run(init=True) (the analyses' step 0) draws the trainer's initial parameters, leaf by leaf, with no
  forward traced."""
  from clis_train.train import Trainer
  overrides = ["model.dtype=float32", f"run_dir={tmp_path}", "mesh.data=1"]
  run = load_run(str(ROOT / "recipes" / "cpt_tiny.yaml"), init=True, overrides=overrides)
  trainer = Trainer(load_config(str(ROOT / "recipes" / "cpt_tiny.yaml"), overrides))
  want = trainer.init_state(jax.random.PRNGKey(trainer.cfg.seed))["params"]
  for got, expected in zip(jax.tree.leaves(run.params), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))


@pytest.mark.hf
def test_export_matches_transformers(cpt_run, tmp_path):
  if not pathlib.Path(HF_PYTHON).exists():
    if os.environ.get("CLIS_REQUIRE_HF") == "1":
      pytest.fail(f"{HF_PYTHON} is missing: scripts/setup.sh makes it (Python 3.11 + torch + transformers)")
    pytest.skip(f"{HF_PYTHON} is missing (scripts/setup.sh makes it); CI requires it")
  folder = _exported(cpt_run, tmp_path / "hf")
  tokens = np.random.default_rng(1).integers(0, 258, (2, 48)).astype(np.int32)
  np.save(tmp_path / "tokens.npy", tokens)
  subprocess.run([HF_PYTHON, str(ROOT / "scripts" / "hf_reference.py"), "--load", str(folder), "--tokens",
                  str(tmp_path / "tokens.npy"), "--out", str(tmp_path / "logits.npy")], check=True, capture_output=True)
  theirs = np.load(tmp_path / "logits.npy")
  ours = np.asarray(load_run(str(cpt_run)).logits(jnp.asarray(tokens)))
  assert np.linalg.norm(ours - theirs) / np.linalg.norm(theirs) < 1e-4


# ----------------------------------------------------------------------------- watching a run
def _event_scalars(folder: pathlib.Path) -> dict[str, list[tuple[int, float]]]:
  """Scalars of a TensorBoard event file, read with its protobuf (TFRecord framing: length, crc, data, crc)."""
  from tensorboardX.proto import event_pb2
  out = {}
  for path in folder.glob("events.out.tfevents.*"):
    raw = path.read_bytes()
    at = 0
    while at < len(raw):
      (length,) = struct.unpack("<Q", raw[at:at + 8])
      event = event_pb2.Event.FromString(raw[at + 12:at + 12 + length])
      at += 12 + length + 4
      for value in event.summary.value:
        out.setdefault(value.tag, []).append((event.step, value.simple_value))
  return out


def test_console_lines_tensorboard_and_resume(tmp_path, capfd):
  run_dir = tmp_path / "run"
  _train(run_dir, extra=["train.steps=3", "checkpoint.every=3"])
  out = capfd.readouterr().out
  assert "initialised at random (seed 0)" in out
  line = next(l for l in out.splitlines() if l.startswith("step 3/3 |"))
  for field in ("loss", "lr", "grad_norm", "tokens/s", "certified"):
    assert f"| {field} " in line, line
  assert "step 3 | eval_loss" in out
  scalars = _event_scalars(run_dir / "tensorboard")
  assert {"train/loss", "train/lr", "train/grad_norm", "train/tokens_per_s", "train/certified_fraction",
          "eval/loss"} <= set(scalars)
  metrics = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
  assert scalars["train/loss"] == [(3, pytest.approx(metrics[0]["loss"]))]
  _train(run_dir, extra=["train.steps=6", "checkpoint.every=3"])
  assert f"resumed from step 3 ({run_dir / 'checkpoints' / '3'})" in capfd.readouterr().out
  _train(tmp_path / "b", extra=["train.steps=3", f"checkpoint.init_from={run_dir}", "train.tensorboard=false"])
  assert f"initialised from {run_dir}" in capfd.readouterr().out
  assert not (tmp_path / "b" / "tensorboard").exists()


def test_plot_run_draws_several_runs(cpt_run, tmp_path):
  out = tmp_path / "runs.png"
  subprocess.run([sys.executable, str(ROOT / "scripts" / "plot_run.py"), str(cpt_run), str(cpt_run), "--out",
                  str(out)], check=True, capture_output=True)
  assert out.stat().st_size > 10_000


# ----------------------------------------------------------------------------- the CLI
def test_help_lists_commands_recipes_attention_values_and_keys(capsys):
  with pytest.raises(SystemExit):
    cli.main(["--help"])
  text = capsys.readouterr().out
  for needle in ("generate", "show-config", "export", "recipes/cpt_tiny.yaml", "clis_mgpu", "dot_product",
                 "optim.lr=0.0003", "train.tensorboard=True"):
    assert needle in text, needle


def test_show_config_prints_yaml_that_loads_back(capsys):
  assert cli.main(["show-config", str(ROOT / "recipes" / "sft_tiny.yaml"), "optim.lr=1e-3", "steps=7"]) == 0
  printed = yaml.safe_load(capsys.readouterr().out)
  assert printed == to_dict(load_config(str(ROOT / "recipes" / "sft_tiny.yaml"), ["optim.lr=1e-3", "steps=7"]))
  assert printed["train"]["steps"] == 7 and printed["data"]["kind"] == "sft"
  assert cli.main(["show-config", str(ROOT / "recipes" / "sft_tiny.yaml"), "optim.lrr=1"]) == 2
  assert "did you mean" in capsys.readouterr().err


def test_load_params_names_missing_steps(cpt_run):
  run = load_run(str(cpt_run))
  with pytest.raises(checkpoint.CheckpointError, match=r"no step 5; saved steps: \[3, 6\]"):
    load_run(str(cpt_run), step=5)
  assert run.step == 6
