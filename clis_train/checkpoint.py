"""Checkpoints with orbax (train state) and grain (data iterator), and `init_from`.

orbax writes each step to a temporary folder and renames it when complete, never
overwrites an existing step, and keeps the newest `keep`; a run that fails therefore
never damages the checkpoints already there. Restoring into a model of another shape is
refused with the shapes named.
"""

from __future__ import annotations

import pathlib

import grain
import jax
import numpy as np
import orbax.checkpoint as ocp


class CheckpointError(ValueError):
  """A checkpoint that cannot be used for this run; the message says why."""


def _handlers():
  return {"state": ocp.StandardCheckpointHandler(), "data": grain.checkpoint.CheckpointHandler()}


def manager(run_dir: str, *, every: int, keep: int) -> ocp.CheckpointManager:
  del every  # the loop decides when to save
  options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True, enable_async_checkpointing=False)
  return ocp.CheckpointManager(pathlib.Path(run_dir).absolute() / "checkpoints", options=options,
                               item_handlers=_handlers())


def save(mngr: ocp.CheckpointManager, step: int, state, data_iter, *, force: bool = False) -> bool:
  return mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                 data=grain.checkpoint.CheckpointSave(data_iter)), force=force)


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


def restore_latest(mngr: ocp.CheckpointManager, abstract_state, data_iter):
  """Restores the newest step into (state, data_iter); returns (step, state) or (None, None)."""
  step = mngr.latest_step()
  if step is None:
    return None, None
  where = f"checkpoint step {step} in {mngr.directory}"
  _check_shapes(mngr.item_metadata(step)["state"]["params"], abstract_state["params"], where)
  restored = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state),
                                                        data=grain.checkpoint.CheckpointRestore(data_iter)))
  return step, restored["state"]


def load_params(path: str, abstract_params):
  """Parameters from an orbax run folder/checkpoint, or a Hugging Face Llama safetensors folder."""
  root = pathlib.Path(path)
  if not root.exists():
    raise CheckpointError(f"checkpoint.init_from={path!r} does not exist")
  if list(root.glob("*.safetensors")):
    from clis_train import hf
    params = hf.load_llama_safetensors(root, abstract_params)
  else:
    ckpt_root = root / "checkpoints" if (root / "checkpoints").is_dir() else root
    mngr = ocp.CheckpointManager(ckpt_root.absolute(), item_handlers=_handlers())
    step = mngr.latest_step()
    if step is None:
      raise CheckpointError(f"checkpoint.init_from={path!r} holds no orbax checkpoint steps")
    meta = mngr.item_metadata(step)["state"]["params"]
    _check_shapes(meta, abstract_params, f"checkpoint.init_from={path!r} (step {step})")
    restored = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore()))
    params = restored["state"]["params"]
  _check_shapes(jax.tree.map(lambda x: np.empty(np.shape(x), np.int8), params), abstract_params,
                f"checkpoint.init_from={path!r}")
  return params
