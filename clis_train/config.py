"""Configuration: a base YAML, a recipe YAML on top (`base: base.yaml`), then `key=value` overrides.

MaxText's convention. The result is a frozen dataclass tree; an unknown key or a value of the
wrong type is an error that names the key (and where it came from) and suggests the closest
valid key. A key may be written in full (`model.dim=512`) or, when unique, bare (`dim=512`).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import pathlib
import types
import typing
from typing import Any

import yaml

from clis_train.errors import ConfigError

# The `attention:` vocabulary, defined once (the config check, the CLI help, the trainer and the
# MaxText adapter read it): value -> what runs.
ATTENTIONS = {
    "clis": "CLiS kernels, the platform's best backend (Mosaic GPU on Hopper, Triton on other NVIDIA GPUs, "
            "Mosaic TPU, the XLA reference on CPU); on Hopper the plan runs the online loop (the certified "
            "loop measured slower there; clis_mgpu certifies)",
    "online": "the same kernels with flash attention's online softmax (the baseline CLiS replaces)",
    "clis_mgpu": "CLiS, the Mosaic GPU kernels by name (Hopper only; certifies at every length)",
    "online_mgpu": "online softmax, the Mosaic GPU kernels by name (Hopper only)",
    "cudnn": "jax.nn.dot_product_attention(implementation='cudnn') (NVIDIA only)",
    "dot_product": "dense XLA attention (any platform; memory grows with seq_len^2)",
    "tokamax": "tokamax's flash attention (its Mosaic GPU kernel on NVIDIA GPUs, its XLA op elsewhere); packed "
               "documents as a per-row first key (tokamax takes no segment ids); needs `pip install tokamax`",
}
CERTIFYING = ("clis", "clis_mgpu")  # the values that log a certified fraction
# Inside MaxText (clis_train/integrations/maxtext.py) its own `attention=` flag takes these two
# values to our kernels (MaxText's other values stay its own): value -> our stabilizer.
MAXTEXT_ATTENTIONS = {"clis": "clis", "clis_online": "online"}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  preset: str = "tiny"
  vocab_size: int | None = None  # None: the preset's, or the tokenizer's size rounded up
  dim: int | None = None
  n_layers: int | None = None
  n_heads: int | None = None
  n_kv_heads: int | None = None
  ffn_dim: int | None = None
  rope_theta: float | None = None
  norm_eps: float | None = None
  tie_embeddings: bool | None = None
  qk_head_dim: int | None = None  # the other families' attention options (clis_train/model.py ModelDims)
  v_head_dim: int | None = None
  attn_soft_cap: float | None = None
  final_soft_cap: float | None = None
  sliding_window: int | None = None
  global_every: int | None = None
  sinks: bool | None = None
  rope_scaling: tuple[float, ...] | None = None  # Llama 3.1+: [factor, low_freq_factor, high_freq_factor, original]
  block: str | None = None  # llama | gemma2 | gemma3 (Gemma's sandwich norms, GeGLU, scaled embeddings)
  query_pre_attn_scalar: float | None = None  # Gemma 2: q·k scaled by its −1/2 power
  qkv_bias: bool | None = None  # Qwen 2: biases on the q, k and v projections
  qk_norm: bool | None = None  # Qwen 3, Gemma 3: an RMSNorm over each q and k head
  local_rope_theta: float | None = None  # Gemma 3: the windowed layers' RoPE base
  rope_linear_factor: float | None = None  # Gemma 3 4B+: linear RoPE scaling of the layers that see every key
  dtype: str = "bfloat16"  # compute dtype; parameters stay float32 (the master weights)
  remat: str = "none"  # none | full | dots


@dataclasses.dataclass(frozen=True)
class SourceConfig:
  """One entry of data.sources: a raw path or a prepared folder (`clis-train prepare-data`), drawn with `weight`."""
  path: str
  weight: float = 1.0
  kind: str | None = None  # cpt | sft; None: data.kind
  format: str | None = None  # raw paths: auto | text | jsonl | parquet; None: data.format
  text_field: str | None = None  # None: data.text_field
  name: str | None = None  # in logs; None: the path's last part


@dataclasses.dataclass(frozen=True)
class DataConfig:
  kind: str = "cpt"  # cpt (plain text) | sft (prompt/response or chat messages)
  train_path: str | None = None  # file or folder; None: the embedded corpus
  eval_path: str | None = None  # None: hold out eval_fraction of the training documents
  format: str = "auto"  # auto | text | jsonl | parquet
  text_field: str = "text"
  file_suffixes: str | None = None  # a folder's files to read, e.g. ".py,.md,.rst"; None: every text/data suffix
  tokenizer: str = "byte"  # byte | path to a Hugging Face tokenizer.json
  seq_len: int = 256
  per_device_batch: int = 8  # global batch = per_device_batch x number of devices
  long_sequences: str = "split"  # split (into seq_len chunks) | truncate
  skip_bad_lines: bool = False
  packing_bins: int = 16
  eval_fraction: float = 0.05
  # A mixture instead of train_path: a list of {path, weight, kind?, format?, text_field?, name?}, e.g.
  #   sources: [{path: data/domain, weight: 0.7}, {path: data/replay, weight: 0.3}]
  sources: tuple[SourceConfig, ...] | None = None
  workers: int = 0  # grain worker processes reading and packing batches (0: in the training process)


@dataclasses.dataclass(frozen=True)
class OptimConfig:
  lr: float = 3e-4
  warmup_steps: int = 20
  min_lr_ratio: float = 0.1
  weight_decay: float = 0.1
  b1: float = 0.9
  b2: float = 0.95
  eps: float = 1e-8
  grad_clip: float = 1.0


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  steps: int = 100
  log_every: int = 10
  eval_every: int = 50
  eval_batches: int = 2
  peak_tflops_per_device: float | None = None  # None: looked up from the device kind (MFU)
  progress_bar: bool = True
  on_nonfinite: str = "stop"  # stop | skip: a step whose loss or grad norm is NaN/inf stops the run, or its
  max_skipped_steps: int = 3  #   update is skipped (optax.apply_if_finite), stopping after this many in a row
  save_on_interrupt: bool = False  # Ctrl-C / SIGTERM saves the current step before exiting (130)
  tensorboard: bool = True  # event files in run_dir/tensorboard (tensorboardX)


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
  every: int = 50
  keep: int = 3
  resume: bool = True  # continue from the newest checkpoint in run_dir/checkpoints
  on_corrupt: str = "error"  # error | previous: a checkpoint whose files fail their checksums stops the run,
                             #   or the newest step that passes is restored instead
  init_from: str | None = None  # orbax checkpoint folder or Hugging Face Llama safetensors folder


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  data: int = -1  # -1: all devices not used by the other axes
  fsdp: int = 1
  tensor: int = 1
  context: int = 1  # context parallelism: each sequence split over this many devices (attention clis or online)
  context_strategy: str = "ring"  # ring (ppermute, one key shard in flight) | all_gather (every key at once)


@dataclasses.dataclass(frozen=True)
class Config:
  run_dir: str = "runs/default"
  seed: int = 0
  attention: str = "clis"  # one of ATTENTIONS
  attention_granularity: str = "tile"
  model: ModelConfig = ModelConfig()
  data: DataConfig = DataConfig()
  optim: OptimConfig = OptimConfig()
  train: TrainConfig = TrainConfig()
  checkpoint: CheckpointConfig = CheckpointConfig()
  mesh: MeshConfig = MeshConfig()




def _hints(cls) -> dict[str, Any]:
  return typing.get_type_hints(cls)


def _all_keys() -> list[str]:
  keys = []
  for name, tp in _hints(Config).items():
    if dataclasses.is_dataclass(tp):
      keys += [f"{name}.{sub}" for sub in _hints(tp)]
    else:
      keys.append(name)
  return keys


def default_keys() -> list[tuple[str, Any]]:
  """Every key with its default, in the order of the dataclasses (for the CLI's help)."""
  out = []
  for field in dataclasses.fields(Config):
    if dataclasses.is_dataclass(field.default):
      out += [(f"{field.name}.{sub.name}", getattr(field.default, sub.name)) for sub in dataclasses.fields(field.default)]
    else:
      out.append((field.name, field.default))
  return out


# Names users bring from MaxText, Hugging Face or PyTorch trainers.
ALIASES = {"learning_rate": "optim.lr", "lr_warmup_steps": "optim.warmup_steps", "warmup": "optim.warmup_steps",
           "max_steps": "train.steps", "num_steps": "train.steps", "steps_per_eval": "train.eval_every",
           "batch_size": "data.per_device_batch", "per_device_batch_size": "data.per_device_batch",
           "max_target_length": "data.seq_len", "max_seq_len": "data.seq_len", "seq_length": "data.seq_len",
           "dataset_path": "data.train_path", "base_output_directory": "run_dir", "output_dir": "run_dir",
           "weight_decay_rate": "optim.weight_decay", "gradient_clipping_threshold": "optim.grad_clip"}


def _suggest(key: str) -> str:
  keys = _all_keys()
  bare = key.split(".")[-1]
  if bare in ALIASES:
    return f"; did you mean {ALIASES[bare]!r}?"
  close = difflib.get_close_matches(key, keys + [k.split(".")[-1] for k in keys], n=1)
  return f"; did you mean {close[0]!r}?" if close else f"; valid keys: {', '.join(keys)}"


def _check_type(key: str, value: Any, tp, origin: str) -> Any:
  allowed = typing.get_args(tp) if isinstance(tp, types.UnionType) else (tp,)
  if value is None and type(None) in allowed:
    return None
  for option in allowed:
    if option is bool and isinstance(value, bool):
      return value
    if option is int and isinstance(value, int) and not isinstance(value, bool):
      return value
    if option is float and isinstance(value, (int, float)) and not isinstance(value, bool):
      return float(value)
    if option is float and isinstance(value, str):  # YAML 1.1 reads 1e-5 (no dot) as a string
      try:
        return float(value)
      except ValueError:
        pass
    if option is str and isinstance(value, str):
      return value
    if typing.get_origin(option) is tuple and isinstance(value, (list, tuple)):
      item_type = typing.get_args(option)[0]
      if item_type is SourceConfig:
        return tuple(_source(f"{key}[{i}]", item, origin) for i, item in enumerate(value))
      return tuple(_check_type(f"{key}[{i}]", item, item_type, origin) for i, item in enumerate(value))
  names = " or ".join("null" if a is type(None) else a.__name__ for a in allowed)
  raise ConfigError(f"{origin}: {key}={value!r} must be {names}")


def _source(key: str, item: Any, origin: str) -> SourceConfig:
  """One data.sources entry from its mapping, every value type-checked."""
  if isinstance(item, SourceConfig):
    return item
  hints = _hints(SourceConfig)
  if not isinstance(item, dict) or "path" not in item:
    raise ConfigError(f"{origin}: {key}={item!r} must be a mapping with a 'path' (and a 'weight')")
  unknown = sorted(set(item) - set(hints))
  if unknown:
    raise ConfigError(f"{origin}: {key} has unknown keys {unknown}; a source takes {sorted(hints)}")
  return SourceConfig(**{k: _check_type(f"{key}.{k}", v, hints[k], origin) for k, v in item.items()})


def _merge(tree: dict, key: str, value: Any, origin: str) -> None:
  """Sets a (possibly dotted or bare) key in the nested dict, resolving bare keys."""
  hints = _hints(Config)
  parts = key.split(".")
  if len(parts) == 1 and parts[0] not in hints:
    owners = [s for s, tp in hints.items() if dataclasses.is_dataclass(tp) and parts[0] in _hints(tp)]
    if len(owners) > 1:
      raise ConfigError(f"{origin}: {key!r} is ambiguous; write one of {[f'{o}.{key}' for o in owners]}")
    if owners:
      parts = [owners[0], parts[0]]
  if len(parts) > 2 or parts[0] not in hints:
    raise ConfigError(f"{origin}: unknown key {key!r}{_suggest(key)}")
  tp = hints[parts[0]]
  if dataclasses.is_dataclass(tp):
    if len(parts) == 1:
      if not isinstance(value, dict):
        raise ConfigError(f"{origin}: {key!r} is a section; give it a mapping of keys")
      for sub, sub_value in value.items():
        _merge(tree, f"{key}.{sub}", sub_value, origin)
      return
    if parts[1] not in _hints(tp):
      raise ConfigError(f"{origin}: unknown key {key!r}{_suggest(key)}")
    tree.setdefault(parts[0], {})[parts[1]] = _check_type(key, value, _hints(tp)[parts[1]], origin)
  else:
    if len(parts) != 1:
      raise ConfigError(f"{origin}: unknown key {key!r}{_suggest(key)}")
    tree[parts[0]] = _check_type(key, value, tp, origin)


def _read_yaml(path: pathlib.Path, tree: dict, seen: tuple = ()) -> None:
  if not path.is_file():
    raise ConfigError(f"config file {str(path)!r} does not exist")
  if path.resolve() in seen:
    raise ConfigError(f"{path}: 'base' includes form a cycle")
  try:
    data = yaml.safe_load(path.read_text()) or {}
  except yaml.YAMLError as e:
    raise ConfigError(f"{path}: not valid YAML ({e})") from None
  if not isinstance(data, dict):
    raise ConfigError(f"{path}: the top level must be a mapping of keys")
  base = data.pop("base", None)
  if base is not None:
    _read_yaml(path.parent / base, tree, seen + (path.resolve(),))
  for key, value in data.items():
    _merge(tree, str(key), value, str(path))


def parse_suffixes(text: str | None) -> tuple[str, ...] | None:
  """data.file_suffixes ('.py,.md,.rst') as a tuple; None stays None (every known suffix)."""
  if text is None:
    return None
  suffixes = tuple(s.strip().lower() for s in text.split(",") if s.strip())
  bad = [s for s in suffixes if not s.startswith(".")]
  if not suffixes or bad:
    raise ConfigError(f"data.file_suffixes={text!r} must be comma-separated suffixes with dots, e.g. '.py,.md,.rst'")
  return suffixes


def _validate(cfg: Config) -> None:
  def need(ok, message):
    if not ok:
      raise ConfigError(message)

  need(cfg.attention in ATTENTIONS, f"attention={cfg.attention!r} must be one of {', '.join(ATTENTIONS)}")
  need(cfg.attention_granularity in ("tile", "head"), "attention_granularity must be 'tile' or 'head'")
  need(cfg.model.dtype in ("bfloat16", "float32"), f"model.dtype={cfg.model.dtype!r} must be bfloat16 or float32")
  need(cfg.model.remat in ("none", "full", "dots"), f"model.remat={cfg.model.remat!r} must be none, full or dots")
  need(cfg.data.kind in ("cpt", "sft"), f"data.kind={cfg.data.kind!r} must be cpt or sft")
  need(cfg.data.format in ("auto", "text", "jsonl", "parquet"), f"data.format={cfg.data.format!r} is unknown")
  need(cfg.data.long_sequences in ("split", "truncate"), "data.long_sequences must be split or truncate")
  need(cfg.data.seq_len >= 8, f"data.seq_len={cfg.data.seq_len} must be >= 8")
  need(cfg.mesh.context >= 1, f"mesh.context={cfg.mesh.context} must be >= 1 (1: no context parallelism)")
  need(cfg.mesh.context_strategy in ("ring", "all_gather"),
       f"mesh.context_strategy={cfg.mesh.context_strategy!r} must be ring or all_gather")
  need(cfg.mesh.context == 1 or cfg.attention in ("clis", "online"),
       f"mesh.context={cfg.mesh.context} needs attention clis or online (the kernels that combine shards); "
       f"attention={cfg.attention!r} sees whole sequences: set mesh.context=1")
  need(cfg.data.seq_len % (2 * cfg.mesh.context) == 0,
       f"data.seq_len={cfg.data.seq_len} must be a multiple of 2 * mesh.context={2 * cfg.mesh.context} (two chunks "
       "per device)")
  need(cfg.data.per_device_batch >= 1, f"data.per_device_batch={cfg.data.per_device_batch} must be >= 1")
  need(cfg.train.steps >= 1, f"train.steps={cfg.train.steps} must be >= 1")
  need(cfg.train.log_every >= 1, f"train.log_every={cfg.train.log_every} must be >= 1")
  need(cfg.train.eval_every >= 1, f"train.eval_every={cfg.train.eval_every} must be >= 1")
  need(cfg.train.eval_batches >= 1, f"train.eval_batches={cfg.train.eval_batches} must be >= 1")
  need(cfg.train.on_nonfinite in ("stop", "skip"), f"train.on_nonfinite={cfg.train.on_nonfinite!r} must be stop or skip")
  need(cfg.train.max_skipped_steps >= 1, f"train.max_skipped_steps={cfg.train.max_skipped_steps} must be >= 1")
  need(cfg.checkpoint.every >= 1 and cfg.checkpoint.keep >= 1, "checkpoint.every and checkpoint.keep must be >= 1")
  need(cfg.checkpoint.on_corrupt in ("error", "previous"),
       f"checkpoint.on_corrupt={cfg.checkpoint.on_corrupt!r} must be error or previous")
  need(cfg.data.packing_bins >= 1, f"data.packing_bins={cfg.data.packing_bins} must be >= 1")
  parse_suffixes(cfg.data.file_suffixes)
  need(cfg.data.workers >= 0, f"data.workers={cfg.data.workers} must be >= 0")
  if cfg.data.sources is not None:
    need(len(cfg.data.sources) >= 1, "data.sources must list at least one source (or be null: data.train_path)")
    need(cfg.data.train_path is None, "set data.sources or data.train_path, not both (a single source can be the "
         "only entry of data.sources)")
    for i, src in enumerate(cfg.data.sources):
      need(math.isfinite(src.weight) and src.weight > 0, f"data.sources[{i}].weight={src.weight} must be positive")
      need(src.kind in (None, "cpt", "sft"), f"data.sources[{i}].kind={src.kind!r} must be cpt or sft")
      need(src.format in (None, "auto", "text", "jsonl", "parquet"), f"data.sources[{i}].format={src.format!r} is "
           "unknown")
  need(0.0 <= cfg.data.eval_fraction < 1.0, f"data.eval_fraction={cfg.data.eval_fraction} must be in [0, 1)")
  o = cfg.optim
  need(math.isfinite(o.lr) and o.lr > 0, f"optim.lr={o.lr} must be a positive finite number")
  need(o.warmup_steps >= 0, f"optim.warmup_steps={o.warmup_steps} must be >= 0")
  need(math.isfinite(o.min_lr_ratio) and 0 <= o.min_lr_ratio <= 1, f"optim.min_lr_ratio={o.min_lr_ratio} must be in [0, 1]")
  need(math.isfinite(o.weight_decay) and o.weight_decay >= 0, f"optim.weight_decay={o.weight_decay} must be >= 0")
  need(all(math.isfinite(b) and 0 <= b < 1 for b in (o.b1, o.b2)), f"optim.b1={o.b1}, optim.b2={o.b2} must be in [0, 1)")
  need(math.isfinite(o.eps) and o.eps > 0, f"optim.eps={o.eps} must be positive")
  need(math.isfinite(o.grad_clip) and o.grad_clip > 0, f"optim.grad_clip={o.grad_clip} must be positive")
  for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size"):
    value = getattr(cfg.model, name)
    need(value is None or value >= 1, f"model.{name}={value} must be >= 1")


def load_config(path: str | None, overrides: list[str] = ()) -> Config:
  """Reads YAML (with `base:` includes) and applies `key=value` overrides (values parsed as YAML)."""
  tree: dict = {}
  if path is not None:
    _read_yaml(pathlib.Path(path), tree)
  return _build(tree, overrides)


def load_run_config(run_dir: str, overrides: list[str] = ()) -> Config:
  """The config a run trained with (run_dir/config.json, written at every start), with overrides."""
  path = pathlib.Path(run_dir) / "config.json"
  if not path.is_file():
    raise ConfigError(f"{str(run_dir)!r} is not a run folder: it has no config.json (a training run writes one "
                      "when it starts); pass the run_dir a training run used")
  try:
    saved = json.loads(path.read_text())
  except json.JSONDecodeError as e:
    raise ConfigError(f"{path}: not valid JSON ({e})") from None
  tree: dict = {}
  for key, value in saved.items():
    _merge(tree, key, value, str(path))
  return _build(tree, overrides)


def _build(tree: dict, overrides) -> Config:
  for item in overrides:
    if "=" not in item:
      raise ConfigError(f"override {item!r} must look like key=value")
    key, raw = item.split("=", 1)
    _merge(tree, key.strip(), yaml.safe_load(raw) if raw.strip() else None, "command line")
  hints = _hints(Config)
  kwargs = {k: (hints[k](**v) if dataclasses.is_dataclass(hints[k]) else v) for k, v in tree.items()}
  cfg = Config(**kwargs)
  _validate(cfg)
  return cfg


def to_dict(cfg: Config) -> dict:
  return dataclasses.asdict(cfg)
