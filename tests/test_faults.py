"""What the trainer does when things go wrong (CPU): non-finite loss, a second trainer, damaged
checkpoints, bad config values, interrupts, error output, kills during checkpoint writes."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from clis_train import checkpoint
from clis_train.config import ConfigError, load_config
from clis_train.errors import Interrupted, TrainingError
from clis_train.runlock import RunLock
from clis_train.train import Trainer

RECIPE = str(pathlib.Path(__file__).parent.parent / "recipes" / "cpt_tiny.yaml")
SMALL = ["data.seq_len=64", "data.per_device_batch=2", "mesh.data=1", "train.progress_bar=false",
         "train.eval_every=1000", "train.log_every=1"]


def config(run_dir, *extra):
  return load_config(RECIPE, [f"run_dir={run_dir}", *SMALL, *extra])


def metric_lines(run_dir):
  """Every metrics.jsonl line, parsed as strict JSON (NaN/Infinity are not JSON)."""
  def refuse(name):
    raise ValueError(f"{name} in metrics.jsonl")
  return [json.loads(line, parse_constant=refuse) for line in (pathlib.Path(run_dir) / "metrics.jsonl").open()]


class Poisoned(Trainer):
  """A trainer whose loss is NaN at the given (0-based) steps: its weights become NaN there."""

  def __init__(self, cfg, bad_steps):
    self.bad_steps = jnp.asarray(bad_steps, jnp.int32)
    super().__init__(cfg)

  def _train_step(self, state, batch):
    poison = jnp.where(jnp.isin(state["step"], self.bad_steps), jnp.nan, 1.0)
    return super()._train_step(state, dict(batch, weights=batch["weights"] * poison))


def finite_params(run_dir, trainer):
  mngr = checkpoint.manager(str(run_dir), every=1, keep=9)
  step = mngr.latest_step()
  restored = mngr.restore(step, args=checkpoint.ocp.args.Composite(
      state=checkpoint.ocp.args.StandardRestore(trainer.abstract_state)))
  mngr.close()
  return step, all(bool(jnp.isfinite(x).all()) for x in jax.tree.leaves(restored["state"]["params"]))


# ----------------------------------------------------------------------------- 1. non-finite loss
def test_nonfinite_loss_stops_the_run_and_never_saves_or_evicts(tmp_path):
  run = tmp_path / "run"
  Trainer(config(run, "train.steps=5", "checkpoint.every=5")).run()
  trainer = Trainer(config(run, "train.steps=15", "checkpoint.every=2", "checkpoint.keep=1"))
  with pytest.raises(TrainingError, match=r"step 6: loss=nan, grad_norm=nan is not finite; training stopped "
                                          r"\(train.on_nonfinite=stop\). checkpoints up to step 5 are intact"):
    Poisoned(trainer.cfg, [5]).run()
  assert finite_params(run, trainer) == (5, True)  # keep=1 evicted nothing: nothing non-finite was saved
  lines = metric_lines(run)  # strict JSON throughout
  assert lines[-1] == {**lines[-1], "step": 6, "event": "nonfinite", "loss": None, "update_skipped": False}


def test_skip_policy_skips_isolated_nonfinite_updates_and_stops_on_a_streak(tmp_path):
  trainer = Poisoned(config(tmp_path / "a", "train.steps=10", "checkpoint.every=5", "train.on_nonfinite=skip"), [6])
  trainer.run()
  assert all(bool(jnp.isfinite(x).all()) for x in jax.tree.leaves(trainer.state["params"]))
  skipped = [r for r in metric_lines(tmp_path / "a") if r.get("event") == "nonfinite"]
  assert [(r["step"], r["update_skipped"]) for r in skipped] == [(7, True)]
  assert finite_params(tmp_path / "a", trainer) == (10, True)
  streak = Poisoned(config(tmp_path / "b", "train.steps=10", "train.on_nonfinite=skip", "train.max_skipped_steps=2"),
                    [3, 4, 5])
  with pytest.raises(TrainingError, match=r"step 6: .* not finite; training stopped \(train.on_nonfinite=skip, "
                                          r"3 in a row\)"):
    streak.run()


# ----------------------------------------------------------------------------- 2. one trainer per run_dir
def test_a_second_trainer_on_the_run_dir_is_refused_and_a_dead_ones_lock_is_taken(tmp_path):
  run = tmp_path / "run"
  with RunLock(run):
    with pytest.raises(TrainingError, match=r"is in use by another trainer \(pid \d+ on .* since"):
      Trainer(config(run, "train.steps=2")).run()
  assert not (run / "metrics.jsonl").exists() and not (run / "checkpoints").exists()
  code = f"import os; from clis_train.runlock import RunLock; RunLock({str(run)!r}).__enter__(); os.kill(os.getpid(), 9)"
  assert subprocess.run([sys.executable, "-c", code]).returncode == -signal.SIGKILL
  assert "pid" in (run / ".lock").read_text()  # the dead process's record is still there
  Trainer(config(run, "train.steps=2")).run()  # and its lock is not


# ----------------------------------------------------------------------------- 3. checkpoint integrity
def _largest_file(step_dir):
  return max((p for p in step_dir.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


@pytest.mark.parametrize("damage", ["overwrite", "truncate"])
def test_a_damaged_checkpoint_is_named_and_the_previous_one_can_be_restored(tmp_path, damage):
  run = tmp_path / "run"
  Trainer(config(run, "train.steps=10", "checkpoint.every=5")).run()
  target = _largest_file(run / "checkpoints" / "10")
  size = target.stat().st_size
  with open(target, "r+b") as f:
    if damage == "overwrite":
      f.seek(size // 2)
      f.write(os.urandom(min(4096, size - size // 2)))
    else:
      f.truncate(size // 2)
  want = "does not match the CRC-32 recorded when it was written" if damage == "overwrite" else f"is {size // 2} bytes; {size} were written"
  with pytest.raises(checkpoint.CheckpointError, match=rf"checkpoint step 10 in .* is damaged: .*{target.name} {want}; "
                                                       r"set checkpoint.on_corrupt=previous .* restore step 5"):
    Trainer(config(run, "train.steps=12", "checkpoint.every=5")).run()
  records = Trainer(config(run, "train.steps=12", "checkpoint.every=5", "checkpoint.on_corrupt=previous")).run()
  assert [r["step"] for r in records if "loss" in r][0] == 6  # restored step 5
  assert (run / "corrupt" / "10").is_dir()  # the damaged step is kept aside, not deleted


# ----------------------------------------------------------------------------- 7. config values
@pytest.mark.parametrize("override,message", [
    ("train.log_every=0", "train.log_every=0 must be >= 1"),
    ("train.eval_every=0", "train.eval_every=0 must be >= 1"),
    ("data.packing_bins=0", "data.packing_bins=0 must be >= 1"),
    ("data.eval_fraction=1.5", r"data.eval_fraction=1.5 must be in \[0, 1\)"),
    ("optim.lr=-1", "optim.lr=-1.0 must be a positive finite number"),
    ("optim.lr=.nan", "optim.lr=nan must be a positive finite number"),
    ("optim.warmup_steps=-1", "optim.warmup_steps=-1 must be >= 0"),
    ("optim.learning_rate=1e-3", "unknown key 'optim.learning_rate'; did you mean 'optim.lr'"),
    ("train.on_nonfinite=ignore", "train.on_nonfinite='ignore' must be stop or skip"),
])
def test_bad_values_are_one_config_error(override, message):
  with pytest.raises(ConfigError, match=message):
    load_config(RECIPE, [override])


def test_a_head_dim_rope_cannot_rotate_is_a_config_error_before_compiling(tmp_path):
  with pytest.raises(ConfigError, match=r"head dim 25 \(model.qk_head_dim, or model.dim / n_heads = 100 / 4\) must be even"):
    Trainer(config(tmp_path, "model.dim=100"))


# ----------------------------------------------------------------------------- 8. the CLI on faults
def _cli(*args, **kw):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  return subprocess.Popen([sys.executable, "-m", "clis_train.cli", RECIPE, *SMALL, *args], env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def test_errors_print_one_line_and_ctrl_c_stops_cleanly(tmp_path):
  bad = _cli(f"run_dir={tmp_path / 'bad'}", f"data.train_path={tmp_path / 'missing'}")
  out, err = bad.communicate(timeout=300)
  assert bad.returncode == 1 and err.strip().count("\n") == 0, err
  assert err.startswith("clis-train: data path") and "does not exist" in err
  run = tmp_path / "run"
  proc = _cli(f"run_dir={run}", "train.steps=100000", "checkpoint.every=100000", "train.save_on_interrupt=true")
  deadline = time.time() + 240
  while not (run / "metrics.jsonl").exists() or not (run / "metrics.jsonl").read_text().count("\n") >= 2:
    assert proc.poll() is None and time.time() < deadline, proc.communicate()
    time.sleep(0.5)
  proc.send_signal(signal.SIGINT)
  out, err = proc.communicate(timeout=120)
  assert proc.returncode == 130, err
  assert "Traceback" not in err and "Aborted" not in err and "terminate called" not in err, err
  assert "clis-train: interrupted at step" in err and "run the same command to resume" in err
  step = int(err.split("interrupted at step ")[1].split(";")[0])
  assert checkpoint.manager(str(run), every=1, keep=3).latest_step() == step  # train.save_on_interrupt


def test_a_signal_in_the_step_loop_stops_at_the_step_boundary(tmp_path):
  """The first SIGINT/SIGTERM inside the loop only asks it to stop after the step (the step's input
  state is donated, so stopping inside it could leave nothing whole to save); outside the loop, or a
  second signal, interrupts at once."""
  from clis_train.errors import GracefulStop
  stop = GracefulStop()
  with pytest.raises(KeyboardInterrupt):
    stop.handler(signal.SIGINT, None)  # not in the loop: at once
  asked = []

  def signal_at_step_3(step, metrics):
    if step == 3:
      stop.handler(signal.SIGTERM, None)
      asked.append(stop.requested)

  with pytest.raises(Interrupted, match="interrupted at step 3; checkpoints up to step 3 are intact"):
    Trainer(config(tmp_path / "run", "train.steps=8", "checkpoint.every=100", "train.save_on_interrupt=true")).run(
        on_step=signal_at_step_3, stop=stop)
  assert asked == [True] and not stop.in_loop
  assert checkpoint.manager(str(tmp_path / "run"), every=1, keep=3).latest_step() == 3
  stop.in_loop, stop.requested = True, True
  with pytest.raises(KeyboardInterrupt):
    stop.handler(signal.SIGINT, None)  # a second signal: at once


def test_resume_writes_a_restart_record_and_a_finished_run_changes_nothing(tmp_path, capsys):
  run = tmp_path / "run"
  Trainer(config(run, "train.steps=4", "checkpoint.every=2")).run()
  Trainer(config(run, "train.steps=6", "checkpoint.every=2")).run()
  restart = [r for r in metric_lines(run) if r.get("event") == "restart"]
  assert restart == [{**restart[0], "step": 4, "changed": {"train.steps": [4, 6]}}]
  before = (run / "config.json").read_text()
  assert Trainer(config(run, "train.steps=6", "checkpoint.every=2", "optim.lr=1e-2")).run() == []
  assert "already finished (checkpoint step 6, train.steps=6); nothing to train" in capsys.readouterr().err
  assert (run / "config.json").read_text() == before


# ----------------------------------------------------------------------------- kills during checkpoint writes
def test_kills_during_checkpoint_writes_resume_bit_identically(tmp_path):
  """SIGKILL at a random moment inside 5 checkpoint writes; every resume continues from the last
  complete step, and every loss ever logged equals the uninterrupted run's at that step."""
  common = ["train.steps=24", "checkpoint.every=2", "checkpoint.keep=2"]  # 12 saves: more than 5 attempts use
  reference = {r["step"]: r["loss"] for r in Trainer(config(tmp_path / "ref", *common)).run() if "loss" in r}
  run = tmp_path / "run"
  child = pathlib.Path(__file__).parent / "fault_child.py"
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(child.parent))
  rng = np.random.default_rng(0)
  for attempt in range(5):
    kill_at = int(rng.integers(1, 3))  # the first or second save of this attempt
    before = checkpoint.manager(str(run), every=1, keep=9).latest_step() if run.exists() else None
    proc = subprocess.run([sys.executable, str(child), str(kill_at), str(attempt), RECIPE, f"run_dir={run}", *SMALL,
                           *common], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]  # killed inside a write, every time
    after = checkpoint.manager(str(run), every=1, keep=9).latest_step()
    assert (after or 0) >= (before or 0)  # a kill never loses a complete step
  Trainer(config(run, *common)).run()
  logged = [r for r in metric_lines(run) if "loss" in r and "event" not in r]
  assert {r["step"] for r in logged} == set(reference)
  for r in logged:
    assert r["loss"] == reference[r["step"]], r  # bit-identical, on every re-run of a step
  restarts = [r for r in metric_lines(run) if r.get("event") == "restart"]
  assert len(restarts) >= 5


def test_the_embedded_corpus_does_not_depend_on_what_the_process_imported():
  """pytest replaces threading.excepthook; the corpus (and so every loss) must not change with it."""
  from clis_train import data
  here = json.dumps(data.embedded_cpt_documents())
  code = "import json, clis_train.data as d; print(json.dumps(d.embedded_cpt_documents()))"
  fresh = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
  assert fresh == here


# ----------------------------------------------------------------------------- 6. data
def test_bad_bytes_and_stray_files_are_named_skipped_or_counted(tmp_path):
  from clis_train import data
  jsonl = tmp_path / "docs.jsonl"
  jsonl.write_bytes(b'{"text": "first document here"}\n{"text": "caf\xe9 in latin-1"}\n{"text": "third one"}\n')
  with pytest.raises(data.DataError, match=r"docs.jsonl:2: not UTF-8 \(byte \d+ of the line\)"):
    data.read_cpt_documents(str(jsonl), fmt="auto", text_field="text", skip_bad_lines=False)
  with pytest.warns(UserWarning, match="skipped 1 malformed or non-UTF-8 lines"):
    docs = data.read_cpt_documents(str(jsonl), fmt="auto", text_field="text", skip_bad_lines=True)
  assert docs == ["first document here", "third one"]
  folder = tmp_path / "corpus"
  folder.mkdir()
  (folder / "a.md").write_text("# A real document\n" * 20)
  (folder / "model.bin").write_bytes(bytes(range(256)) * 8)
  (folder / "notes.gz").write_bytes(b"\x1f\x8b\x08\x00" + bytes(100))
  (folder / ".DS_Store").write_bytes(b"\x00\x00\x00\x01Bud1" + bytes(50))
  (folder / "latin1.txt").write_bytes("na\xefve".encode("latin-1") * 10)
  with pytest.warns(UserWarning) as caught:
    docs = data.read_cpt_documents(str(folder), fmt="auto", text_field="text", skip_bad_lines=False)
  assert docs == ["# A real document\n" * 20]
  said = " ".join(str(w.message) for w in caught)
  assert "model.bin" in said and "notes.gz" in said and ".DS_Store" in said and "latin1.txt" in said
  assert "\ufffd" not in "".join(docs)
  with pytest.raises(data.DataError, match="model.bin: not UTF-8 text"):
    data.read_cpt_documents(str(folder / "model.bin"), fmt="auto", text_field="text", skip_bad_lines=False)


def test_hold_out_counts_chunks_so_one_long_document_trains_too(tmp_path):
  from clis_train import data
  one = tmp_path / "one.txt"
  one.write_text("a long document about many things. " * 400)  # ~14k bytes: ~110 chunks of 128
  cfg = config(tmp_path, f"data.train_path={one}", "data.seq_len=128", "data.eval_fraction=0.1")
  examples = data.build_examples(cfg.data, data.ByteTokenizer())
  assert len(examples.train) > 8 * len(examples.eval) > 0
  tiny = tmp_path / "tiny.txt"
  tiny.write_text("just one short document")
  examples = data.build_examples(config(tmp_path, f"data.train_path={tiny}").data, data.ByteTokenizer())
  assert len(examples.train) == 1 and examples.eval == []


def test_a_full_disk_while_saving_is_one_message_and_keeps_earlier_steps(tmp_path, monkeypatch):
  import errno
  run = tmp_path / "run"
  Trainer(config(run, "train.steps=2", "checkpoint.every=2")).run()
  original = checkpoint.save

  def full_disk(mngr, step, *args, **kwargs):
    if step == 4:
      raise OSError(errno.ENOSPC, "No space left on device")
    return original(mngr, step, *args, **kwargs)

  monkeypatch.setattr(checkpoint, "save", full_disk)
  with pytest.raises(TrainingError, match=r"step 4: could not write the checkpoint under .* \(No space left on device\); "
                                          r"free space or point run_dir elsewhere. checkpoints up to step 2 are intact"):
    Trainer(config(run, "train.steps=6", "checkpoint.every=2")).run()
  assert checkpoint.manager(str(run), every=1, keep=3).latest_step() == 2
