"""Input pipelines (grain): documents → tokens → packed rows with segment ids and positions.

CPT reads text files (one document per file), JSONL (a `text` field per line) or Parquet (a
`text` column); SFT reads JSONL with `prompt`/`response` or chat `messages`. Without a path,
an embedded corpus built from text that ships with every Python is used (the interpreter's
documentation topics and standard-library docstrings). Documents longer than seq_len are
split into seq_len chunks (`long_sequences: split`) or cut (`truncate`). Rows are packed
with grain's first-fit packing: segment ids start at 1, 0 is padding, documents never see
each other. The iterator is grain's checkpointable one; its state is saved with the model.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import json
import pathlib
import warnings

import grain
import numpy as np

from clis_train.config import parse_suffixes
from clis_train.errors import DataError

SFT_TEMPLATE = "<|user|>\n{prompt}\n<|assistant|>\n"  # the response follows, then EOS


# ----------------------------------------------------------------------------- tokenizers
class ByteTokenizer:
  """UTF-8 bytes as ids 0..255, plus BOS=256 and EOS=257. Needs no download."""

  vocab_size = 258
  bos_id, eos_id = 256, 257

  def encode(self, text: str) -> list[int]:
    return list(text.encode("utf-8"))

  def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
    return [np.frombuffer(t.encode("utf-8"), np.uint8).astype(np.int32) for t in texts]

  def decode(self, ids) -> str:
    return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
  """A Hugging Face `tokenizer.json` through the `tokenizers` library."""

  def __init__(self, path: str):
    from tokenizers import Tokenizer
    if not pathlib.Path(path).is_file():
      raise DataError(f"data.tokenizer={path!r} is neither 'byte' nor an existing tokenizer.json file")
    self._tok = Tokenizer.from_file(path)
    self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
    find = lambda names: next((self._tok.token_to_id(n) for n in names if self._tok.token_to_id(n) is not None), None)
    self.bos_id = find(["<|begin_of_text|>", "<s>", "<bos>"])
    self.eos_id = find(["<|end_of_text|>", "<|eot_id|>", "</s>", "<eos>"])

  def encode(self, text: str) -> list[int]:
    return self._tok.encode(text, add_special_tokens=False).ids

  def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
    return [np.asarray(e.ids, np.int32) for e in self._tok.encode_batch(texts, add_special_tokens=False)]

  def decode(self, ids) -> str:
    return self._tok.decode(list(ids))


def make_tokenizer(name: str):
  return ByteTokenizer() if name == "byte" else HFTokenizer(name)


# ----------------------------------------------------------------------------- documents
def _jsonl_records(path: pathlib.Path, skip_bad_lines: bool):
  """(path, line number, record) of each JSON-object line; a line that is not UTF-8 or not a JSON
  object is an error naming path:line, or is skipped and counted with data.skip_bad_lines=true."""
  bad = 0
  with path.open("rb") as f:
    for line_no, raw in enumerate(f, 1):
      try:
        line = raw.decode("utf-8")
        if not line.strip():
          continue
        record = json.loads(line)
        if not isinstance(record, dict):
          raise ValueError("a JSON object was expected")
      except UnicodeDecodeError as e:
        if not skip_bad_lines:
          raise DataError(f"{path}:{line_no}: not UTF-8 (byte {e.start} of the line); fix the file or set "
                          "data.skip_bad_lines=true") from None
        bad += 1
        continue
      except ValueError as e:
        if not skip_bad_lines:
          raise DataError(f"{path}:{line_no}: malformed JSONL line ({e}); fix it or set data.skip_bad_lines=true")
        bad += 1
        continue
      yield path, line_no, record
  if bad:
    warnings.warn(f"{path}: skipped {bad} malformed or non-UTF-8 lines (data.skip_bad_lines=true)")


TEXT_SUFFIXES = (".txt", ".text", ".md", ".rst", ".py", ".pyi", ".c", ".h", ".cc", ".cpp", ".rs", ".go", ".java",
                 ".js", ".ts", ".html", ".tex", ".yaml", ".yml", ".toml", ".cfg", ".ini", ".csv", ".tsv", "")
DATA_SUFFIXES = {".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet"}


def text_or_none(file: pathlib.Path) -> str | None:
  """The file's text, or None when it is not UTF-8 text (NUL bytes, invalid UTF-8)."""
  raw = file.read_bytes()
  if b"\x00" in raw[:8192]:
    return None
  try:
    return raw.decode("utf-8")
  except UnicodeDecodeError:
    return None


def input_files(path: str, fmt: str = "auto", suffixes: tuple[str, ...] | None = None) -> list[pathlib.Path]:
  """The files to read: path itself, or the files under a folder whose suffix is in `suffixes`
  (default: one that names a format, TEXT_SUFFIXES or DATA_SUFFIXES; any with data.format set),
  others skipped with one warning."""
  root = pathlib.Path(path)
  if not root.exists():
    raise DataError(f"data path {path!r} does not exist")
  if not root.is_dir():
    return [root]
  found = sorted(p for p in root.rglob("*") if p.is_file() and not p.name.startswith("."))
  if suffixes is not None:
    files = [p for p in found if p.suffix.lower() in suffixes]
  else:
    files = [p for p in found if fmt != "auto" or p.suffix.lower() in TEXT_SUFFIXES + tuple(DATA_SUFFIXES)]
  skipped = [str(p.relative_to(root)) for p in sorted(root.rglob("*")) if p.is_file() and p not in files]
  if skipped:
    hint = "not in data.file_suffixes" if suffixes is not None else "not text or a data format (set data.format "\
        "or data.file_suffixes to read them)"
    warnings.warn(f"{path}: skipped {len(skipped)} files, {hint}: {', '.join(skipped[:10])}"
                  f"{' ...' if len(skipped) > 10 else ''}")
  if not files:
    raise DataError(f"data path {path!r} holds no " + (f"files ending in {', '.join(suffixes)}" if suffixes
                                                       else "text, JSONL or Parquet files"))
  return files


def file_format(file: pathlib.Path, fmt: str) -> str:
  if fmt != "auto":
    return fmt
  return DATA_SUFFIXES.get(file.suffix.lower(), "text")


def read_cpt_documents(path: str, *, fmt: str, text_field: str, skip_bad_lines: bool,
                       suffixes: tuple[str, ...] | None = None) -> list[str]:
  docs, binary, empty = [], [], []
  files = input_files(path, fmt, suffixes)
  for file in files:
    kind = file_format(file, fmt)
    before = len(docs)
    if kind == "text":
      text = text_or_none(file)
      if text is None:
        if len(files) == 1:
          raise DataError(f"{file}: not UTF-8 text (binary or another encoding); convert it, or point "
                          "data.train_path at text, JSONL or Parquet files")
        binary.append(str(file))
        continue
      docs.append(text)
    elif kind == "jsonl":
      for p, line_no, record in _jsonl_records(file, skip_bad_lines):
        if not isinstance(record.get(text_field), str):
          if skip_bad_lines:
            continue
          raise DataError(f"{p}:{line_no}: no string field {text_field!r} (set data.text_field)")
        docs.append(record[text_field])
    else:
      import pyarrow.parquet as pq
      table = pq.read_table(file)
      if text_field not in table.column_names:
        raise DataError(f"{file}: no column {text_field!r}; columns are {table.column_names}")
      docs += [t for t in table.column(text_field).to_pylist() if isinstance(t, str)]
    if len(docs) == before or not any(d.strip() for d in docs[before:]):
      if len(files) == 1:
        raise DataError(f"{file}: empty (no documents)")
      del docs[before:]
      empty.append(str(file))  # in a folder (empty __init__.py, say): skipped, counted in one warning
  if binary:
    warnings.warn(f"{path}: skipped {len(binary)} files that are not UTF-8 text: {', '.join(binary[:10])}")
  if empty:
    warnings.warn(f"{path}: skipped {len(empty)} empty files: {', '.join(empty[:5])}{' ...' if len(empty) > 5 else ''}")
  if not docs:
    raise DataError(f"data path {path!r}: no file held UTF-8 text")
  return docs


def read_sft_pairs(path: str, *, skip_bad_lines: bool) -> list[tuple[str, str]]:
  """(prompt, response) pairs from `prompt`/`response` records or chat `messages`."""
  pairs = []
  for file in input_files(path, "jsonl"):
    before = len(pairs)
    for p, line_no, record in _jsonl_records(file, skip_bad_lines):
      pair = sft_pair(record)
      if pair is None:
        if skip_bad_lines:
          continue
        raise DataError(f"{p}:{line_no}: an SFT record needs 'prompt' and 'response' strings, or 'messages' "
                        "ending with an assistant turn")
      pairs.append(pair)
    if len(pairs) == before:
      raise DataError(f"{file}: empty (no SFT records)")
  return pairs


def sft_pair(record):
  """(prompt, response) of an SFT record: prompt/response strings, or chat messages ending with the assistant."""
  if isinstance(record.get("prompt"), str) and isinstance(record.get("response"), str):
    return record["prompt"], record["response"]
  messages = record.get("messages")
  if isinstance(messages, list) and messages and messages[-1].get("role") == "assistant":
    prompt = "\n".join(f"{m.get('role')}: {m.get('content')}" for m in messages[:-1])
    return prompt, str(messages[-1].get("content"))
  return None


# ----------------------------------------------------------------------------- embedded corpus
STDLIB_MODULES = ("json", "collections", "itertools", "functools", "os", "re", "math", "string", "textwrap",
                  "datetime", "pathlib", "random", "statistics", "heapq", "bisect", "dataclasses", "enum",
                  "argparse", "logging", "csv", "shutil", "subprocess", "threading", "queue", "pickle", "copy",
                  "pprint", "decimal", "fractions", "operator", "contextlib", "abc", "io", "struct", "array",
                  "uuid", "hashlib", "base64", "calendar", "time", "glob", "fnmatch", "tempfile", "difflib",
                  "inspect", "weakref", "zipfile", "gzip", "html", "urllib.parse", "email.message", "sqlite3")


def _docstrings():
  """(qualified name, docstring) for the listed standard-library modules and their public members."""
  out = []
  for name in STDLIB_MODULES:
    module = importlib.import_module(name)
    if module.__doc__:
      out.append((name, inspect.cleandoc(module.__doc__)))
    for attr in sorted(dir(module)):
      obj = getattr(module, attr, None)
      if attr.startswith("_") or not (inspect.isfunction(obj) or inspect.isclass(obj) or inspect.isbuiltin(obj)):
        continue
      if (getattr(obj, "__module__", None) or "").lstrip("_").split(".")[0] != name.split(".")[0]:
        continue  # re-exported from elsewhere, or a hook another package may replace (pytest swaps
        #           threading.excepthook): the corpus must not depend on what the process imported
      doc = inspect.getdoc(obj)
      if doc and len(doc) > 40:
        out.append((f"{name}.{attr}", doc))
  return out


def embedded_cpt_documents() -> list[str]:
  from pydoc_data.topics import topics
  docs = [topics[k] for k in sorted(topics)]
  docs += [f"{name}\n\n{doc}" for name, doc in _docstrings()]
  return docs


def embedded_sft_pairs() -> list[tuple[str, str]]:
  from pydoc_data.topics import topics
  pairs = [(f"Explain the Python documentation topic '{k}'.", topics[k].strip().split("\n\n")[0][:600])
           for k in sorted(topics)]
  pairs += [(f"What does {name} do?", doc.split("\n\n")[0][:600]) for name, doc in _docstrings()]
  return pairs


# ----------------------------------------------------------------------------- examples and packing
@dataclasses.dataclass(frozen=True)
class Examples:
  train: list[dict]
  eval: list[dict]


def _chunks(ids: list[int], seq_len: int, long_sequences: str):
  """Pieces of at most seq_len + 1 tokens (inputs and targets overlap by one)."""
  if len(ids) <= seq_len + 1 or long_sequences == "truncate":
    return [ids[: seq_len + 1]]
  return [ids[i:i + seq_len + 1] for i in range(0, len(ids) - 1, seq_len)]


def _example(ids, weights):
  ids = np.asarray(ids, np.int32)
  return {"inputs": ids[:-1], "targets": ids[1:], "weights": np.asarray(weights[1:], np.float32)}


def cpt_examples(docs, tokenizer, seq_len, long_sequences):
  out = []
  for doc in docs:
    ids = [tokenizer.bos_id] * (tokenizer.bos_id is not None) + tokenizer.encode(doc)
    ids += [tokenizer.eos_id] * (tokenizer.eos_id is not None)
    out += [_example(c, [1.0] * len(c)) for c in _chunks(ids, seq_len, long_sequences) if len(c) > 1]
  return out


def sft_examples(pairs, tokenizer, seq_len, long_sequences):
  """Loss only on response tokens (and EOS): prompt targets get weight 0."""
  out = []
  for prompt, response in pairs:
    head = [tokenizer.bos_id] * (tokenizer.bos_id is not None) + tokenizer.encode(SFT_TEMPLATE.format(prompt=prompt))
    tail = tokenizer.encode(response) + [tokenizer.eos_id] * (tokenizer.eos_id is not None)
    ids, weights = head + tail, [0.0] * len(head) + [1.0] * len(tail)
    for start, chunk in zip(range(0, len(ids), seq_len), _chunks(ids, seq_len, long_sequences)):
      if len(chunk) > 1 and sum(weights[start + 1:start + len(chunk)]) > 0:
        out.append(_example(chunk, weights[start:start + len(chunk)]))
  return out


def _split_eval(examples, fraction):
  """Every k-th example (k = 1/fraction) held out, counted over sequence chunks, not documents, so
  one long document cannot become the whole eval set; the first example always trains."""
  every = max(2, round(1 / fraction)) if fraction > 0 else 0
  held = [x for i, x in enumerate(examples) if every and i % every == every - 1]
  train = [x for i, x in enumerate(examples) if not every or i % every != every - 1]
  return train, held


def build_examples(data_cfg, tokenizer) -> Examples:
  """Reads, tokenizes and splits the configured data into training and held-out examples."""
  seq, long = data_cfg.seq_len, data_cfg.long_sequences
  if data_cfg.kind == "cpt":
    read = lambda p: read_cpt_documents(p, fmt=data_cfg.format, text_field=data_cfg.text_field,
                                        skip_bad_lines=data_cfg.skip_bad_lines,
                                        suffixes=parse_suffixes(data_cfg.file_suffixes))
    items = read(data_cfg.train_path) if data_cfg.train_path else embedded_cpt_documents()
    make = lambda xs: cpt_examples(xs, tokenizer, seq, long)
  else:
    read = lambda p: read_sft_pairs(p, skip_bad_lines=data_cfg.skip_bad_lines)
    items = read(data_cfg.train_path) if data_cfg.train_path else embedded_sft_pairs()
    make = lambda xs: sft_examples(xs, tokenizer, seq, long)
  if data_cfg.eval_path:
    examples = Examples(make(items), make(read(data_cfg.eval_path)))
  else:
    examples = Examples(*_split_eval(make(items), data_cfg.eval_fraction))
  if not examples.train:
    raise DataError(f"data.train_path={data_cfg.train_path!r}: no training examples after tokenization (every "
                    f"document shorter than 2 tokens, or every SFT response cut by data.seq_len={seq})")
  return examples


def packed_batches(examples: list[dict], *, seq_len: int, batch_size: int, seed: int, packing_bins: int,
                   shuffle: bool = True) -> grain.DatasetIterator:
  """An endless, checkpointable iterator of packed batches.

  Each batch: inputs, targets, positions, segment_ids int32 [batch, seq_len]; weights f32.
  """
  ds = grain.MapDataset.source(examples)
  if shuffle:
    ds = ds.shuffle(seed=seed)
  ds = ds.repeat(None).to_iter_dataset()
  lengths = {"inputs": seq_len, "targets": seq_len, "weights": seq_len}
  ds = grain.experimental.FirstFitPackIterDataset(ds, length_struct=lengths, num_packing_bins=packing_bins,
                                                  seed=seed, shuffle_bins=shuffle)
  ds = ds.batch(batch_size, drop_remainder=True)
  ds = ds.map(lambda b: {"inputs": b["inputs"], "targets": b["targets"], "weights": b["weights"],
                         "positions": b["inputs_positions"], "segment_ids": b["inputs_segment_ids"]})
  return iter(ds)
