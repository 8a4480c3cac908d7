"""Checkpoints with orbax (train state) and grain (data iterator), and `init_from`.

orbax writes each step to a temporary folder and renames it when complete, never
overwrites an existing step, and keeps the newest `keep`; a run that fails therefore
never damages the checkpoints already there. Restoring into a model of another shape is
refused with the shapes named. After each save the size and CRC-32 of every file of the step are
recorded in run_dir/checksums/STEP.json (orbax records none); a restore checks them first, so a
damaged or truncated file is named instead of silently restored, and `on_corrupt="previous"`
moves the damaged step to run_dir/corrupt/ and restores the newest step that passes.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import sys
import zlib

import grain
import jax
import numpy as np
import orbax.checkpoint as ocp

from clis_train.errors import CheckpointError



def _handlers():
  return {"state": ocp.StandardCheckpointHandler(), "data": grain.checkpoint.CheckpointHandler()}


def manager(run_dir: str, *, every: int, keep: int) -> ocp.CheckpointManager:
  del every  # the loop decides when to save
  options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True, enable_async_checkpointing=False)
  return ocp.CheckpointManager(pathlib.Path(run_dir).absolute() / "checkpoints", options=options,
                               item_handlers=_handlers())


def _step_dir(mngr: ocp.CheckpointManager, step: int) -> pathlib.Path:
  return pathlib.Path(mngr.directory) / str(step)


def _checksum_file(mngr: ocp.CheckpointManager, step: int) -> pathlib.Path:
  return pathlib.Path(mngr.directory).parent / "checksums" / f"{step}.json"


def _crc32(path: pathlib.Path) -> int:
  crc = 0
  with open(path, "rb") as f:
    while chunk := f.read(1 << 22):
      crc = zlib.crc32(chunk, crc)
  return crc


def _file_sums(root: pathlib.Path) -> dict[str, list[int]]:
  return {str(p.relative_to(root)): [p.stat().st_size, _crc32(p)] for p in sorted(root.rglob("*")) if p.is_file()}


def save(mngr: ocp.CheckpointManager, step: int, state, data_iter, *, force: bool = False) -> bool:
  """Saves (state, data iterator) as `step`, then records its files' sizes and CRC-32s."""
  saved = mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                  data=grain.checkpoint.CheckpointSave(data_iter)), force=force)
  if saved and jax.process_index() == 0:
    mngr.wait_until_finished()
    record = _checksum_file(mngr, step)
    record.parent.mkdir(parents=True, exist_ok=True)
    tmp = record.with_suffix(".tmp")
    tmp.write_text(json.dumps(_file_sums(_step_dir(mngr, step))))
    os.replace(tmp, record)
    kept = {str(s) for s in mngr.all_steps()}
    for old in record.parent.glob("*.json"):  # steps orbax has evicted
      if old.stem not in kept:
        old.unlink()
  return saved


def verify(mngr: ocp.CheckpointManager, step: int) -> str | None:
  """None if every file recorded for `step` has its size and CRC-32 (or nothing was recorded: a
  save killed between orbax's rename and the record), else what is wrong, naming the file."""
  record = _checksum_file(mngr, step)
  if not record.is_file():
    return None
  root = _step_dir(mngr, step)
  for name, (size, crc) in json.loads(record.read_text()).items():
    path = root / name
    if not path.is_file():
      return f"{path} is missing"
    if path.stat().st_size != size:
      return f"{path} is {path.stat().st_size} bytes; {size} were written"
    if _crc32(path) != crc:
      return f"{path} does not match the CRC-32 recorded when it was written"
  return None


def _check_shapes(saved_tree, abstract_state, where: str):
  saved = jax.tree_util.tree_flatten_with_path(saved_tree)[0]
  wanted = dict(jax.tree_util.tree_flatten_with_path(abstract_state)[0])
  saved = dict(saved)
  if set(saved) != set(wanted):
    missing = sorted(jax.tree_util.keystr(k) for k in set(wanted) - set(saved))[:3]
    extra = sorted(jax.tree_util.keystr(k) for k in set(saved) - set(wanted))[:3]
    raise CheckpointError(f"{where} was saved from a different model: missing {missing}, unexpected {extra}")
  for key, meta in saved.items():
    if tuple(meta.shape) != tuple(wanted[key].shape):
      raise CheckpointError(f"{where} was saved from a different model shape: {jax.tree_util.keystr(key)} is "
                            f"{tuple(meta.shape)} there and {tuple(wanted[key].shape)} in this config")


def restore_latest(mngr: ocp.CheckpointManager, abstract_state, data_iter, *, on_corrupt: str = "error"):
  """Restores the newest step into (state, data_iter); returns (step, state) or (None, None).

  A step whose files fail their checksums (or that orbax cannot read) raises CheckpointError naming
  the step and file; with on_corrupt="previous" it is moved to run_dir/corrupt/STEP and the next
  older step is tried."""
  moved = []
  while (step := mngr.latest_step()) is not None:
    where = f"checkpoint step {step} in {mngr.directory}"
    problem = verify(mngr, step)
    if problem is None:
      try:
        _check_shapes(mngr.item_metadata(step)["state"]["params"], abstract_state["params"], where)
        restored = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state),
                                                              data=grain.checkpoint.CheckpointRestore(data_iter)))
        return step, restored["state"]
      except CheckpointError:
        raise
      except Exception as e:  # orbax/tensorstore/json errors on damaged files: name the step
        problem = f"it cannot be read ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    older = [s for s in mngr.all_steps() if s < step]
    if on_corrupt != "previous":
      hint = (f"set checkpoint.on_corrupt=previous to move it aside and restore step {max(older)}" if older
              else "no older step exists; delete it and start again, or restore it from a copy")
      raise CheckpointError(f"{where} is damaged: {problem}; {hint}")
    aside = pathlib.Path(mngr.directory).parent / "corrupt" / str(step)
    aside.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(str(_step_dir(mngr, step)), str(aside))
    moved.append(step)
    _checksum_file(mngr, step).unlink(missing_ok=True)
    print(f"clis-train: {where} is damaged ({problem}); moved to {aside}; trying the previous step",
          file=sys.stderr)
    mngr.reload()
  if moved:
    raise CheckpointError(f"no intact checkpoint is left in {mngr.directory}: steps {moved} were damaged (moved to "
                          f"{pathlib.Path(mngr.directory).parent / 'corrupt'}); start a new run_dir, or restore a copy")
  return None, None


def _reader(path: str) -> ocp.CheckpointManager:
  root = pathlib.Path(path)
  ckpt_root = root / "checkpoints" if (root / "checkpoints").is_dir() else root
  return ocp.CheckpointManager(ckpt_root.absolute(), item_handlers=_handlers())


def saved_steps(path: str, what: str = "checkpoint") -> list[int]:
  """The steps saved under a run folder (or its checkpoints/ folder), oldest first."""
  if not pathlib.Path(path).is_dir():
    raise CheckpointError(f"{what}={path!r} is not a folder")
  with _reader(path) as mngr:
    return sorted(mngr.all_steps())


def load_params(path: str, abstract_params, *, step: int | None = None, what: str = "checkpoint.init_from",
                dims=None):
  """Parameters from an orbax run folder/checkpoint (the newest step, or `step`), or a Hugging Face
  Llama safetensors folder (its config.json checked against `dims`, the model's ModelDims, when given). `what`
  names the argument in errors."""
  root = pathlib.Path(path)
  if not root.exists():
    raise CheckpointError(f"{what}={path!r} does not exist")
  if list(root.glob("*.safetensors")):
    from clis_train import hf
    try:
      params = hf.load_llama_safetensors(root, abstract_params, dims)
    except ValueError as e:
      raise CheckpointError(f"{what}: {e}") from e
  else:
    with _reader(path) as mngr:
      steps = sorted(mngr.all_steps())
      if not steps:
        raise CheckpointError(f"{what}={path!r} holds no orbax checkpoint steps (nor *.safetensors)")
      if step is None:
        step = steps[-1]
      elif step not in steps:
        raise CheckpointError(f"{what}={path!r} has no step {step}; saved steps: {steps}")
      problem = verify(mngr, step)
      if problem is not None:
        raise CheckpointError(f"{what}={path!r} step {step} is damaged: {problem}")
      meta = mngr.item_metadata(step)["state"]["params"]
      _check_shapes(meta, abstract_params, f"{what}={path!r} (step {step})")
      restored = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore()))
      params = restored["state"]["params"]
  _check_shapes(jax.tree.map(lambda x: np.empty(np.shape(x), np.int8), params), abstract_params,
                f"{what}={path!r}")
  return params
