"""The training library on the CPU: config, data, loss, resume, attention flag, packing, mesh."""

from __future__ import annotations

import dataclasses
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from clis_train import checkpoint, data
from clis_train.config import ConfigError, load_config
from clis_train.train import Trainer

RECIPES = pathlib.Path(__file__).parent.parent / "recipes"
SMALL = ["data.seq_len=128", "data.per_device_batch=4", "mesh.data=1", "train.progress_bar=false",
         "train.eval_every=1000"]


def config(tmp_path, *extra, recipe="cpt_tiny.yaml"):
  return load_config(str(RECIPES / recipe), [f"run_dir={tmp_path}", *SMALL, *extra])


def losses(records):
  return [r["loss"] for r in records if "loss" in r]


# ----------------------------------------------------------------------------- config
def test_recipes_load_and_overrides_apply(tmp_path):
  for recipe in ("cpt_tiny.yaml", "sft_tiny.yaml", "cpt.yaml", "sft.yaml"):
    cfg = load_config(str(RECIPES / recipe), ["attention=online", "model.dim=256"])
    assert cfg.attention == "online" and cfg.model.dim == 256
  assert load_config(str(RECIPES / "cpt.yaml")).data.seq_len == 8192


@pytest.mark.parametrize("override,message", [
    ("atention=clis", "unknown key 'atention'; did you mean 'attention'"),
    ("model.layers=2", "unknown key 'model.layers'; did you mean 'model.n_layers'"),
    ("steps=many", "steps='many' must be int"),
    ("attention=flash", "attention='flash' must be one of"),
    ("data.seq_len", "must look like key=value"),
])
def test_bad_config_names_the_key(override, message):
  with pytest.raises(ConfigError, match=message):
    load_config(str(RECIPES / "cpt_tiny.yaml"), [override])


def test_bad_yaml_key_names_the_file(tmp_path):
  bad = tmp_path / "bad.yaml"
  bad.write_text(f"base: {RECIPES / 'base.yaml'}\nmodel:\n  dimm: 3\n")
  with pytest.raises(ConfigError, match=r"bad.yaml: unknown key 'model.dimm'; did you mean 'model.dim'"):
    load_config(str(bad))


# ----------------------------------------------------------------------------- data
def test_sft_puts_zero_weight_on_prompt_tokens():
  tok = data.ByteTokenizer()
  [example] = data.sft_examples([("What is 2+2?", "four")], tok, 128, "truncate")
  targets, weights = example["targets"], example["weights"]
  answer = tok.encode("four") + [tok.eos_id]
  np.testing.assert_array_equal(targets[weights > 0], answer)  # exactly the response and EOS carry loss
  prompt_len = len(tok.encode(data.SFT_TEMPLATE.format(prompt="What is 2+2?"))) + 1
  assert weights[: prompt_len - 1].sum() == 0


def test_sft_reads_chat_messages_and_packs_with_weights(tmp_path):
  path = tmp_path / "chat.jsonl"
  rows = [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"answer {i}"}]}
          for i in range(20)]
  path.write_text("\n".join(json.dumps(r) for r in rows))
  pairs = data.read_sft_pairs(str(path), skip_bad_lines=False)
  assert pairs[3] == ("user: q3", "answer 3")
  examples = data.sft_examples(pairs, data.ByteTokenizer(), 160, "truncate")
  batch = next(data.packed_batches(examples, seq_len=160, batch_size=2, seed=0, packing_bins=2))
  assert batch["segment_ids"].max() > 1  # several conversations share a row
  assert 0 < batch["weights"].sum() < (batch["segment_ids"] > 0).sum()


def test_long_documents_split_or_truncate():
  tok = data.ByteTokenizer()
  doc = "x" * 300
  split = data.cpt_examples([doc], tok, 128, "split")
  cut = data.cpt_examples([doc], tok, 128, "truncate")
  assert len(cut) == 1 and len(cut[0]["inputs"]) == 128
  assert len(split) == 3 and sum(len(e["inputs"]) for e in split) == len(doc) + 1  # BOS..EOS, overlap of one


def test_bad_data_inputs_name_the_file_and_line(tmp_path):
  with pytest.raises(data.DataError, match="does not exist"):
    data.read_cpt_documents(str(tmp_path / "missing"), fmt="auto", text_field="text", skip_bad_lines=False)
  empty = tmp_path / "empty.txt"
  empty.write_text("")
  with pytest.raises(data.DataError, match="empty.txt: empty"):
    data.read_cpt_documents(str(empty), fmt="auto", text_field="text", skip_bad_lines=False)
  package = tmp_path / "package"  # a source tree: empty __init__.py files are skipped with a warning
  (package / "sub").mkdir(parents=True)
  (package / "__init__.py").write_text("")
  (package / "sub" / "__init__.py").write_text("  \n")
  (package / "sub" / "code.py").write_text("x = 1\n")
  with pytest.warns(UserWarning, match="skipped 2 empty files"):
    docs = data.read_cpt_documents(str(package), fmt="auto", text_field="text", skip_bad_lines=False)
  assert docs == ["x = 1\n"]
  bad = tmp_path / "bad.jsonl"
  bad.write_text('{"text": "fine"}\n{"text": broken\n{"text": "also fine"}\n')
  with pytest.raises(data.DataError, match=r"bad.jsonl:2: malformed JSONL line"):
    data.read_cpt_documents(str(bad), fmt="auto", text_field="text", skip_bad_lines=False)
  with pytest.warns(UserWarning, match="skipped 1 malformed"):
    docs = data.read_cpt_documents(str(bad), fmt="auto", text_field="text", skip_bad_lines=True)
  assert docs == ["fine", "also fine"]


def test_parquet_and_hf_tokenizer(tmp_path):
  import pyarrow as pa
  import pyarrow.parquet as pq
  from tokenizers import Tokenizer, models, pre_tokenizers, trainers
  pq.write_table(pa.table({"text": ["alpha beta", "gamma delta epsilon"]}), tmp_path / "d.parquet")
  assert data.read_cpt_documents(str(tmp_path / "d.parquet"), fmt="auto", text_field="text",
                                 skip_bad_lines=False) == ["alpha beta", "gamma delta epsilon"]
  tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  tok.train_from_iterator(["alpha beta gamma delta epsilon"], trainers.WordLevelTrainer(
      special_tokens=["<unk>", "<s>", "</s>"]))
  tok.save(str(tmp_path / "tokenizer.json"))
  hf = data.make_tokenizer(str(tmp_path / "tokenizer.json"))
  assert hf.bos_id == tok.token_to_id("<s>") and hf.eos_id == tok.token_to_id("</s>")
  assert hf.decode(hf.encode("gamma delta")) == "gamma delta"


# ----------------------------------------------------------------------------- model and loss
def test_packed_documents_do_not_see_each_other(tmp_path):
  trainer = Trainer(config(tmp_path))
  params = trainer.init_state(jax.random.PRNGKey(0))["params"]
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, 256, (1, 128)).astype(np.int32)
  seg = np.array([[1] * 50 + [2] * 60 + [0] * 18], np.int32)
  pos = np.concatenate([np.arange(50), np.arange(60), np.zeros(18, int)])[None].astype(np.int32)
  changed = tokens.copy()
  changed[0, 60:110] = rng.integers(0, 256, 50)  # rewrite most of document 2
  a = trainer.logits(params, tokens, pos, seg)
  b = trainer.logits(params, changed, pos, seg)
  np.testing.assert_array_equal(np.asarray(a[0, :50]), np.asarray(b[0, :50]))  # document 1: bit-identical
  assert not np.allclose(np.asarray(a[0, 60:110]), np.asarray(b[0, 60:110]))


def test_cpt_tiny_loss_falls_over_50_steps(tmp_path):
  records = Trainer(config(tmp_path, "train.steps=50", "train.log_every=5")).run()
  curve = losses(records)
  assert len(curve) == 10
  assert curve[-1] < 0.7 * curve[0], curve
  assert all(r["certified_fraction"] == 1.0 for r in records if "loss" in r)
  logged = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert {"loss", "tokens_per_s", "step_time_s", "mfu", "lr", "certified_fraction"} <= set(logged[0])


def test_clis_and_dot_product_agree_within_bf16_noise(tmp_path):
  common = ["train.steps=50", "train.log_every=5"]
  clis = losses(Trainer(config(tmp_path / "clis", "attention=clis", *common)).run())
  dense = losses(Trainer(config(tmp_path / "dense", "attention=dot_product", *common)).run())
  diff = np.abs(np.array(clis) - np.array(dense))
  assert diff.max() < 0.05 * np.array(dense).max(), (clis, dense)


def test_resume_after_a_crash_reproduces_the_uninterrupted_run(tmp_path):
  common = ["train.steps=20", "train.log_every=1", "checkpoint.every=5"]
  full = losses(Trainer(config(tmp_path / "full", *common)).run())

  class Crash(Exception):
    pass

  def crash(step, _):
    if step == 12:
      raise Crash

  with pytest.raises(Crash):
    Trainer(config(tmp_path / "crash", *common)).run(on_step=crash)
  assert checkpoint.manager(str(tmp_path / "crash"), every=5, keep=3).latest_step() == 10
  resumed = Trainer(config(tmp_path / "crash", *common)).run()
  assert [r["step"] for r in resumed if "loss" in r] == list(range(11, 21))
  assert losses(resumed) == full[10:]  # exactly the same losses, not approximately


def test_failed_runs_never_overwrite_checkpoints(tmp_path):
  common = ["train.steps=5", "checkpoint.every=5"]
  Trainer(config(tmp_path / "run", *common)).run()
  saved = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
  with pytest.raises(checkpoint.CheckpointError, match="already holds checkpoints"):
    Trainer(config(tmp_path / "run", *common, "checkpoint.resume=false")).run()
  with pytest.raises(checkpoint.CheckpointError, match="different model shape"):
    Trainer(config(tmp_path / "run", *common, "model.dim=64")).run()
  with pytest.raises(checkpoint.CheckpointError, match="different model shape"):
    Trainer(config(tmp_path / "other", *common, "model.dim=64",
                   f"checkpoint.init_from={tmp_path / 'run'}")).run()
  assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == saved


def test_init_from_an_orbax_run_starts_from_its_weights(tmp_path):
  common = ["train.steps=5", "checkpoint.every=5"]
  first = Trainer(config(tmp_path / "a", *common))
  first.run()
  second = Trainer(config(tmp_path / "b", *common, f"checkpoint.init_from={tmp_path / 'a'}"))
  loaded = checkpoint.load_params(str(tmp_path / "a"), second.abstract_state["params"])
  for x, y in zip(jax.tree.leaves(loaded), jax.tree.leaves(first.state["params"])):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_eight_devices_on_a_2x2x2_mesh_match_one_device(tmp_path):
  assert jax.device_count() >= 8, "conftest.py sets 8 simulated CPU devices"
  common = ["train.steps=4", "train.log_every=1", "attention=clis"]
  one = losses(Trainer(config(tmp_path / "one", *common, "data.per_device_batch=8")).run())
  mesh = ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "data.per_device_batch=1"]
  eight = Trainer(config(tmp_path / "eight", *common, *mesh))
  assert eight.mesh.shape == {"data": 2, "fsdp": 2, "context": 1, "tensor": 2} and eight.global_batch == 8
  np.testing.assert_allclose(losses(eight.run()), one, rtol=2e-3)


@pytest.mark.parametrize("strategy", ["ring", "all_gather"])
def test_context_parallel_training_matches_one_device(tmp_path, strategy):
  """mesh.context=4: every sequence split over four devices (zig-zag), packed documents; the losses and the
  certified fraction follow the single-device run's."""
  common = ["train.steps=3", "train.log_every=1", "attention=clis", "data.seq_len=256"]
  one = Trainer(config(tmp_path / "one", *common, "data.per_device_batch=2")).run()
  mesh = ["mesh.data=2", "mesh.context=4", "data.per_device_batch=1", f"mesh.context_strategy={strategy}"]
  split = Trainer(config(tmp_path / "split", *common, *mesh))
  assert split.mesh.shape["context"] == 4 and split.global_batch == 2
  records = split.run()
  np.testing.assert_allclose(losses(records), losses(one), rtol=2e-4)
  certified = [r["certified_fraction"] for r in records if "loss" in r]
  assert min(certified) > 0.5, certified


def test_context_parallel_training_of_an_mla_model_matches_one_device(tmp_path):
  """A DeepSeek-shaped model (model.preset=deepseek_tiny: v's head dim other than q·k's) with mesh.context=2."""
  common = ["train.steps=2", "train.log_every=1", "attention=clis", "data.seq_len=128", "model.preset=deepseek_tiny"]
  one = Trainer(config(tmp_path / "one", *common, "data.per_device_batch=1")).run()
  split = Trainer(config(tmp_path / "split", *common, "mesh.data=1", "mesh.context=2", "data.per_device_batch=1"))
  assert split.mesh.shape["context"] == 2 and split.dims.value_dim != split.dims.head_dim
  np.testing.assert_allclose(losses(split.run()), losses(one), rtol=2e-4)


def test_context_parallelism_needs_a_combining_attention(tmp_path):
  with pytest.raises(ConfigError, match="mesh.context=2 needs attention clis or online"):
    config(tmp_path, "mesh.context=2", "attention=dot_product")
  with pytest.raises(ConfigError, match="must be a multiple of 2 \\* mesh.context"):
    config(tmp_path, "mesh.context=3", "data.seq_len=128")


def test_sft_tiny_trains_on_responses(tmp_path):
  records = Trainer(config(tmp_path, "train.steps=12", "train.log_every=4", recipe="sft_tiny.yaml")).run()
  curve = losses(records)
  assert len(curve) == 3 and all(np.isfinite(curve)) and curve[-1] < curve[0]


def test_cudnn_attention_needs_a_gpu(tmp_path):
  with pytest.raises(ValueError, match="attention='cudnn' needs an NVIDIA GPU"):
    Trainer(config(tmp_path, "attention=cudnn"))


def test_distributed_initialize_reads_the_usual_environment(monkeypatch):
  """The trainer starts JAX's distributed runtime only when a multi-process environment is set."""
  from clis_train import train as train_mod
  calls = []
  monkeypatch.setattr(train_mod.jax.distributed, "initialize", lambda **kw: calls.append(kw))
  for var in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "SLURM_NTASKS", "TPU_WORKER_HOSTNAMES"):
    monkeypatch.delenv(var, raising=False)
  train_mod.maybe_initialize_distributed()
  assert calls == []  # single process: nothing to do
  monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "10.0.0.1:1234")
  monkeypatch.setenv("JAX_NUM_PROCESSES", "4")
  monkeypatch.setenv("JAX_PROCESS_ID", "2")
  train_mod.maybe_initialize_distributed()
  assert calls == [dict(num_processes=4, process_id=2)]
  monkeypatch.delenv("JAX_COORDINATOR_ADDRESS")
  monkeypatch.setenv("SLURM_NTASKS", "8")
  train_mod.maybe_initialize_distributed()
  assert calls[-1] == {}


def test_mgpu_attention_reaches_the_mosaic_kernel_with_packed_segments():
  """attention=clis_mgpu / online_mgpu: the model's call site runs the Mosaic GPU forward (lowered
  for an H200 here; the numerics are tests/test_pallas_mgpu.py's, on the GPU)."""
  from attention_base import lower_for_h200
  from clis_train.attention import make_attention
  from clis_kernels.plan import HOPPER
  q = jax.ShapeDtypeStruct((1, 256, 4, 64), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((1, 256, 2, 64), jnp.bfloat16)
  seg = jax.ShapeDtypeStruct((1, 256), jnp.int32)
  for name in ("clis_mgpu", "online_mgpu"):
    text = lower_for_h200(make_attention(name, None, platform=HOPPER), q, k, k, seg)
    assert "mosaic_gpu" in text, name
  with pytest.raises(ValueError, match="must be one of clis, online, clis_mgpu"):
    make_attention("clis_mosaic", None)


@pytest.mark.maxtext  # tokamax comes with the maxtext extra
def test_tokamax_attention_keeps_packed_documents_apart():
  """attention=tokamax: packed causal documents as tokamax's per-row first key; output and gradients equal
  dot_product's on the CPU (tokamax's XLA op, the same mask its Mosaic GPU kernel takes; tokamax checks the
  GPU generation itself, so it does not lower on a CPU for an H200)."""
  pytest.importorskip("tokamax")
  from clis_kernels.testing import packed_segments, random_inputs
  from clis_train.attention import _document_starts, make_attention
  seg = jnp.asarray([[1, 1, 1, 2, 2, 3, 3, 3, 0, 0]])
  assert _document_starts(seg).tolist() == [[0, 0, 0, 3, 3, 5, 5, 5, 8, 8]]
  q, k, v, do = random_inputs(3, 2, 192, 4, 2, 64, jnp.float32)
  seg = packed_segments(3, 2, 192)
  outs = {}
  for name in ("tokamax", "dot_product"):
    fn = make_attention(name, None)
    out, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, seg)[0], q, k, v)
    outs[name] = (out, *vjp(do))
  for got, want in zip(outs["tokamax"], outs["dot_product"]):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("window", [None, 5])
def test_cudnn_attention_mask_matches_dot_product(window):
  """attention=cudnn's call (packed documents and the sliding window as jax.nn's boolean mask, padding zeroed),
  run through jax.nn's XLA implementation on the CPU: output and gradients equal attention=dot_product's under
  the trainer's window convention (an int: keys before each query)."""
  from clis_kernels.testing import packed_segments, random_inputs
  from clis_train.attention import _cudnn, make_attention
  q, k, v, do = random_inputs(4, 2, 96, 4, 2, 32, jnp.float32)
  seg = packed_segments(4, 2, 96).at[:, -7:].set(0)
  dense = make_attention("dot_product", None)
  outs = {}
  for name, fn in (("cudnn", lambda q, k, v: _cudnn(q, k, v, seg, window, implementation=None)),
                   ("dot_product", lambda q, k, v: dense(q, k, v, seg, window=window)[0])):
    out, vjp = jax.vjp(fn, q, k, v)
    outs[name] = (out, *vjp(do))
  for got, want in zip(outs["cudnn"], outs["dot_product"]):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)


def test_attention_kernels_are_lowered_once_for_all_layers():
  """The step's module holds one copy of each attention kernel however many layers call it (compile time:
  16 layers held 64 Mosaic GPU kernels before make_attention's jit)."""
  import re
  from attention_base import lower_for_h200
  from clis_kernels import plan
  from clis_train import attention as attention_lib
  from clis_train import model as model_lib
  tokens = jax.ShapeDtypeStruct((1, 256), jnp.int32)
  counts = {}
  for layers in (1, 4):
    dims = dataclasses.replace(model_lib.PRESETS["tiny"], n_layers=layers, dim=256, n_heads=2, n_kv_heads=1)
    net = model_lib.Transformer(dims, attention_lib.make_attention("clis_mgpu", None, platform=plan.HOPPER),
                                remat="full")
    params = jax.eval_shape(lambda t: net.init(jax.random.PRNGKey(0), t, t, t), tokens)
    loss = lambda p, t: net.apply(p, t, jnp.broadcast_to(jnp.arange(t.shape[1]), t.shape), jnp.ones_like(t)).mean()
    counts[layers] = len(re.findall(r"custom_call @mosaic_gpu", lower_for_h200(jax.grad(loss), params, tokens)))
  assert counts[1] == counts[4] >= 3, counts  # forward (and its remat copy), dQ, dK/dV: once each
