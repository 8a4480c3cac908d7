"""Prepared corpora and mixtures: prepare-data's shards, lazy reading, host shares, mixing, resume, bad input."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import subprocess
import sys

import grain
import numpy as np
import pytest

from clis_train import checkpoint, corpus, data, sources
from clis_train.config import ConfigError, load_config
from clis_train.errors import DataError
from clis_train.train import Trainer

ROOT = pathlib.Path(__file__).parent.parent
WORDS = "attention kernel softmax certified tile bound query key value row block".split()


def write_jsonl(path, n, tag, seed=0, field="text"):
  rng = np.random.default_rng(seed)
  with open(path, "w") as f:
    for i in range(n):
      words = rng.choice(WORDS, size=int(rng.integers(3, 120)))
      f.write(json.dumps({field: f"{tag}{i} " + " ".join(words)}) + "\n")
  return path


def cfg_for(tmp_path, *extra):
  return load_config(str(ROOT / "recipes" / "cpt_tiny.yaml"),
                     [f"run_dir={tmp_path / 'run'}", "data.seq_len=128", "data.per_device_batch=4", "mesh.data=1",
                      "train.progress_bar=false", "train.eval_every=1000", *extra])


def test_prepared_documents_give_the_same_examples_as_the_raw_path(tmp_path):
  raw = write_jsonl(tmp_path / "a.jsonl", 300, "a")
  summary = corpus.prepare([str(raw)], str(tmp_path / "A"), unit_bytes=4000, workers=2, progress=False)
  assert summary["documents"] == 300 and summary["shards"] > 3
  cfg = cfg_for(tmp_path, "data.eval_fraction=0", "data.seq_len=64")  # seq 64: long documents split
  expected = data.build_examples(dataclasses.replace(cfg.data, train_path=str(raw)), data.ByteTokenizer()).train
  prepared = sources.build_sources(dataclasses.replace(cfg.data, train_path=str(tmp_path / "A")),
                                   data.ByteTokenizer(), host=(0, 1))[0].train
  got = [ex for i in range(len(prepared)) for ex in prepared.chunker.flat_map(prepared.items[i])]
  key = lambda ex: (tuple(ex["inputs"]), tuple(ex["targets"]), tuple(ex["weights"]))
  assert len(got) == len(expected) > 300 and [key(x) for x in got] == [key(x) for x in expected]


def test_sft_shards_keep_the_prompt_unweighted(tmp_path):
  path = tmp_path / "sft.jsonl"
  path.write_text("".join(json.dumps({"prompt": f"q{i}?", "response": f"answer {i}"}) + "\n" for i in range(20)))
  corpus.prepare([str(path)], str(tmp_path / "S"), kind="sft", progress=False, workers=1)
  cfg = cfg_for(tmp_path, "data.kind=sft", "data.eval_fraction=0")
  expected = data.build_examples(dataclasses.replace(cfg.data, train_path=str(path)), data.ByteTokenizer()).train
  stream = sources.build_sources(dataclasses.replace(cfg.data, train_path=str(tmp_path / "S")),
                                 data.ByteTokenizer(), host=(0, 1))[0].train
  got = [ex for i in range(len(stream)) for ex in stream.chunker.flat_map(stream.items[i])]
  for x, y in zip(got, expected, strict=True):
    np.testing.assert_array_equal(x["inputs"], y["inputs"])
    np.testing.assert_array_equal(x["weights"], y["weights"])
  with pytest.raises(DataError, match="prepared as 'sft' data, but data.kind='cpt'"):
    sources.build_sources(dataclasses.replace(cfg.data, kind="cpt", train_path=str(tmp_path / "S")),
                          data.ByteTokenizer())


def test_hosts_read_disjoint_shares_that_cover_every_document(tmp_path):
  corpus.prepare([str(write_jsonl(tmp_path / "a.jsonl", 203, "a"))], str(tmp_path / "A"), unit_bytes=3000,
                 progress=False, workers=1)
  cfg = dataclasses.replace(cfg_for(tmp_path).data, train_path=str(tmp_path / "A"), eval_fraction=0.1)
  seen = []
  for host in range(2):  # two processes, as jax.process_index() / process_count() would say
    (src,) = sources.build_sources(cfg, data.ByteTokenizer(), host=(host, 2))
    docs = [src.train.items[i] for i in range(len(src.train))] + [src.eval.items[i] for i in range(len(src.eval))]
    seen.append({bytes(d["ids"][1:12].astype(np.uint8)).split(b" ")[0] for d in docs})  # the "a<i>" tag
  assert not seen[0] & seen[1]
  assert seen[0] | seen[1] == {f"a{i}".encode() for i in range(203)}


def test_realised_mixture_is_within_two_percent_over_ten_thousand_documents(tmp_path):
  for name, n in (("A", 400), ("B", 300)):
    corpus.prepare([str(write_jsonl(tmp_path / f"{name}.jsonl", n, name))], str(tmp_path / name), progress=False,
                   workers=1)
  cfg = dataclasses.replace(cfg_for(tmp_path).data, eval_fraction=0.0, sources=tuple(
      load_config(None, [f"data.sources=[{{path: {tmp_path / 'A'}, weight: 0.7}}, "
                         f"{{path: {tmp_path / 'B'}, weight: 0.3}}]"]).data.sources))
  srcs = sources.build_sources(cfg, data.ByteTokenizer(), host=(0, 1))
  parts = [sources._examples(s.train, seed=i, shuffle=True).map(lambda x, i=i: i) for i, s in enumerate(srcs)]
  drawn = [x for _, x in zip(range(10_000), grain.IterDataset.mix(parts, [0.7, 0.3]))]
  assert abs(np.mean(np.asarray(drawn) == 0) - 0.7) <= 0.02


def test_mixture_resumes_mid_epoch_bit_exactly(tmp_path):
  for name, n in (("A", 120), ("B", 90)):
    corpus.prepare([str(write_jsonl(tmp_path / f"{name}.jsonl", n, name, seed=len(name)))], str(tmp_path / name),
                   progress=False, workers=1)
  mix = f"data.sources=[{{path: {tmp_path / 'A'}, weight: 0.7}}, {{path: {tmp_path / 'B'}, weight: 0.3}}]"
  common = [mix, "train.steps=12", "train.log_every=1", "checkpoint.every=5", "train.eval_every=6"]
  full = Trainer(cfg_for(tmp_path / "full", *common)).run()

  class Crash(Exception):
    pass

  def crash(step, _):
    if step == 8:
      raise Crash

  with pytest.raises(Crash):
    Trainer(cfg_for(tmp_path / "crash", *common)).run(on_step=crash)
  assert checkpoint.manager(str(tmp_path / "crash" / "run"), every=5, keep=3).latest_step() == 5
  resumed = Trainer(cfg_for(tmp_path / "crash", *common)).run()
  loss = lambda records: [r["loss"] for r in records if "loss" in r]
  assert loss(resumed) == loss(full)[5:]  # the same batches after the restart: equal, not close
  shares = [r["mixture"] for r in full if "mixture" in r]
  assert len(shares) == 2 and all(set(s) == {"A", "B"} for s in shares)


def test_preparation_resumes_and_refuses_other_settings(tmp_path):
  raw = write_jsonl(tmp_path / "a.jsonl", 200, "a")
  out = tmp_path / "A"
  first = corpus.prepare([str(raw)], str(out), unit_bytes=3000, progress=False, workers=1)
  for shard in ("shard-000001", "shard-000003"):  # as if the run had stopped before these two were done
    (out / f"{shard}.idx.npy").unlink()
  (out / "meta.json").unlink()
  with pytest.raises(DataError, match="unfinished preparation"):
    corpus.PreparedCorpus(str(out))
  again = corpus.prepare([str(raw)], str(out), unit_bytes=3000, progress=False, workers=1)
  assert again["resumed_shards"] == first["shards"] - 2
  assert {k: again[k] for k in ("documents", "tokens")} == {k: first[k] for k in ("documents", "tokens")}
  with pytest.raises(DataError, match="other settings or inputs \\(unit_bytes differ\\)"):
    corpus.prepare([str(raw)], str(out), unit_bytes=5000, progress=False, workers=1)


def test_bad_input_names_the_file_and_line_or_is_skipped_and_counted(tmp_path):
  bad = tmp_path / "bad.jsonl"
  lines = [json.dumps({"text": f"doc {i}"}) for i in range(50)]
  lines[37] = '{"text": broken'
  bad.write_text("\n".join(lines) + "\n")
  with pytest.raises(DataError, match=r"bad.jsonl:38: malformed JSONL line"):  # in the second unit of three
    corpus.prepare([str(bad)], str(tmp_path / "X"), unit_bytes=300, progress=False, workers=1)
  summary = corpus.prepare([str(bad)], str(tmp_path / "Y"), unit_bytes=300, skip_bad_lines=True, progress=False,
                           workers=1)
  assert summary["bad_lines"] == 1 and summary["documents"] == 49


def test_a_corpus_prepared_with_another_tokenizer_is_refused(tmp_path):
  from tokenizers import Tokenizer, models, pre_tokenizers, trainers
  tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  tok.train_from_iterator([" ".join(WORDS)], trainers.WordLevelTrainer(special_tokens=["<unk>", "<s>", "</s>"]))
  tok.save(str(tmp_path / "tokenizer.json"))
  raw = write_jsonl(tmp_path / "a.jsonl", 30, "a")
  corpus.prepare([str(raw)], str(tmp_path / "W"), tokenizer=str(tmp_path / "tokenizer.json"), progress=False,
                 workers=1)
  cfg = cfg_for(tmp_path, f"data.train_path={tmp_path / 'W'}")
  with pytest.raises(DataError, match="was prepared with tokenizer .*tokenizer.json.* but training uses "
                                      "data.tokenizer='byte'"):
    sources.build_sources(cfg.data, data.ByteTokenizer())
  (src,) = sources.build_sources(dataclasses.replace(cfg.data, tokenizer=str(tmp_path / "tokenizer.json")),
                                 data.make_tokenizer(str(tmp_path / "tokenizer.json")), host=(0, 1))
  assert src.train.items[0]["ids"][0] == tok.token_to_id("<s>")


def test_sources_config_errors_name_the_key():
  with pytest.raises(ConfigError, match=r"data.sources\[1\] has unknown keys \['wieght'\]"):
    load_config(None, ["data.sources=[{path: a, weight: 1}, {path: b, wieght: 2}]"])
  with pytest.raises(ConfigError, match=r"data.sources\[0\].weight=-1.0 must be positive"):
    load_config(None, ["data.sources=[{path: a, weight: -1}]"])
  with pytest.raises(ConfigError, match="not both"):
    load_config(None, ["data.sources=[{path: a}]", "data.train_path=b"])


def test_prepare_data_command_prints_a_summary(tmp_path):
  raw = write_jsonl(tmp_path / "a.jsonl", 40, "a")
  result = subprocess.run([sys.executable, "-m", "clis_train.cli", "prepare-data", str(raw), "--out",
                           str(tmp_path / "A"), "--no-progress", "--workers", "1"], capture_output=True, text=True,
                          cwd=ROOT, check=True)
  assert json.loads(result.stdout.strip().splitlines()[-1])["documents"] == 40


def test_reading_across_more_shards_than_may_stay_open(tmp_path, monkeypatch):
  corpus.prepare([str(write_jsonl(tmp_path / "a.jsonl", 120, "a"))], str(tmp_path / "A"), unit_bytes=1500,
                 progress=False, workers=1)
  monkeypatch.setattr(corpus, "OPEN_SHARDS", 2)
  docs = corpus.PreparedCorpus(str(tmp_path / "A"))
  assert len(docs.meta["shards"]) > 5
  order = np.random.default_rng(0).permutation(len(docs))
  tags = {int(i): bytes(docs[int(i)]["ids"][1:6].astype(np.uint8)).split(b" ")[0] for i in order}
  assert len(docs._open) <= 2
  assert sorted(tags.values()) == sorted(f"a{i}".encode() for i in range(120))


def test_eval_command_reads_a_prepared_run_and_a_prepared_folder(tmp_path):
  from clis_train.evaluate import evaluate, examples_for
  from clis_train.runs import load_run
  corpus.prepare([str(write_jsonl(tmp_path / "a.jsonl", 200, "a"))], str(tmp_path / "A"), progress=False, workers=1)
  Trainer(cfg_for(tmp_path, f"data.train_path={tmp_path / 'A'}", "train.steps=2", "checkpoint.every=2")).run()
  run = load_run(str(tmp_path / "run"))
  held = examples_for(run, None)  # every 20th document of the folder (data.eval_fraction 0.05)
  assert 10 <= len(held) and evaluate(run, held)["loss"] > 0
  assert len(examples_for(run, str(tmp_path / "A"), limit=50)) == 50


def test_worker_processes_are_deterministic_and_resume_exactly(tmp_path):
  """data.workers=N runs the pipeline (reading, tokenising, packing) in grain worker processes, each on its share of
  the documents: the batches differ from the in-process order, but two runs give the same ones and a saved iterator
  state resumes exactly, for a prepared folder and for a raw path tokenised on the fly."""
  raw = write_jsonl(tmp_path / "a.jsonl", 120, "a")
  corpus.prepare([str(raw)], str(tmp_path / "A"), progress=False, workers=1)
  for path in (tmp_path / "A", raw):
    cfg = dataclasses.replace(cfg_for(tmp_path).data, train_path=str(path))
    srcs = sources.build_sources(cfg, data.ByteTokenizer(), host=(0, 1))
    make = lambda: sources.batches(srcs, seq_len=128, batch_size=4, seed=0, packing_bins=4, workers=2)
    first, second = make(), make()
    for _ in range(2):
      a, b = next(first), next(second)
      assert all(np.array_equal(a[key], b[key]) for key in a)
    state = first.get_state()
    want = [next(first) for _ in range(2)]
    resumed = make()
    resumed.set_state(state)
    for w in want:
      got = next(resumed)
      assert all(np.array_equal(got[key], w[key]) for key in w)


def test_eval_path_is_the_held_out_set_raw_or_prepared(tmp_path):
  corpus.prepare([str(write_jsonl(tmp_path / "a.jsonl", 60, "a"))], str(tmp_path / "A"), progress=False, workers=1)
  held = write_jsonl(tmp_path / "held.jsonl", 7, "h")
  corpus.prepare([str(held)], str(tmp_path / "H"), progress=False, workers=1)
  for train in (tmp_path / "A", tmp_path / "a.jsonl"):
    for eval_path in (held, tmp_path / "H"):
      cfg = dataclasses.replace(cfg_for(tmp_path).data, train_path=str(train), eval_path=str(eval_path))
      (src,) = sources.build_sources(cfg, data.ByteTokenizer(), host=(0, 1))
      assert len(src.train) == 60 and len(src.eval) == 7  # every training document trains
      first = src.eval.items[0]
      assert bytes(first["ids"][1:3].astype(np.uint8)) == b"h0"
