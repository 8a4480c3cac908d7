"""Prepared corpora: text tokenised once into shards of token ids on disk, read back by random access.

`prepare` (the `clis-train prepare-data` command) splits its inputs (text files, JSONL, Parquet, or folders of
them) into units of about `unit_bytes` (a big JSONL file is cut at line ends, Parquet by row group), tokenises each
unit in a worker process and writes it as one shard, Megatron-style:
  shard-NNNNNN.bin        the unit's documents' token ids back to back (uint16 when the vocabulary fits, else uint32)
  shard-NNNNNN.mask.bin   SFT only: 1 where a token is trained on (the response and EOS), uint8
  shard-NNNNNN.idx.npy    the documents' offsets into .bin, int64 [documents + 1]; written last: a shard whose index
                          exists is done, so an interrupted run started again with the same arguments resumes
  shard-NNNNNN.json       the shard's counts (documents, tokens, bad lines, skipped files)
prepare.json (written first) records the settings, the tokenizer's fingerprint and the unit plan; meta.json (written
last) the shards and totals. `PreparedCorpus` opens the folder for training: documents by global index, each read
from disk when asked for, so a trainer's memory does not grow with the corpus.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import multiprocessing
import os
import pathlib
import time

import numpy as np

from clis_train.errors import DataError

FORMAT = "clis-train tokens 1"
OPEN_SHARDS = 64  # per reader: each open shard holds two or three file descriptors


def is_prepared(path: str | os.PathLike) -> bool:
  """Whether `path` is a folder `prepare` wrote into (finished or not)."""
  return (pathlib.Path(path) / "prepare.json").is_file()


def tokenizer_fingerprint(name: str) -> str:
  """'byte', or the sha256 of a tokenizer.json's bytes: what training's tokenizer must match."""
  if name == "byte":
    return "byte"
  path = pathlib.Path(name)
  if not path.is_file():
    raise DataError(f"tokenizer {name!r} is neither 'byte' nor an existing tokenizer.json file")
  return "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()


# ----------------------------------------------------------------------------- planning
@dataclasses.dataclass(frozen=True)
class Segment:
  """Part of one input file: text (the whole file, one document), jsonl (bytes [start, end), whole lines) or
  parquet (row group `start`)."""
  file: str
  kind: str
  start: int
  end: int


def _jsonl_cuts(path: pathlib.Path, unit_bytes: int) -> list[tuple[int, int]]:
  """Byte ranges of about unit_bytes covering the file, each ending at a line end."""
  size = path.stat().st_size
  cuts, start = [], 0
  with path.open("rb") as f:
    while start < size:
      f.seek(min(start + unit_bytes, size))
      if f.tell() < size:
        f.readline()  # to the end of the line the cut fell in
      end = f.tell()
      cuts.append((start, end))
      start = end
  return cuts


def plan_units(files: list[pathlib.Path], fmt: str, unit_bytes: int) -> list[list[Segment]]:
  """The files as units of about unit_bytes: small files grouped, big JSONL cut, Parquet by row group."""
  from clis_train.data import file_format
  units, current, size = [], [], 0

  def add(segment, nbytes):
    nonlocal current, size
    current.append(segment)
    size += nbytes
    if size >= unit_bytes:
      units.append(current)
      current, size = [], 0

  for file in files:
    kind = file_format(file, fmt)
    if kind == "jsonl":
      for start, end in _jsonl_cuts(file, unit_bytes):
        add(Segment(str(file), kind, start, end), end - start)
    elif kind == "parquet":
      import pyarrow.parquet as pq
      groups = pq.ParquetFile(file).num_row_groups
      for g in range(groups):
        add(Segment(str(file), kind, g, g + 1), file.stat().st_size // max(groups, 1))
    else:
      add(Segment(str(file), "text", 0, file.stat().st_size), file.stat().st_size)
  if current:
    units.append(current)
  return units


# ----------------------------------------------------------------------------- one unit
def _line_number(file: str, start: int, local: int) -> int:
  """The file's line number of the unit's `local`-th line (counted only when an error names it)."""
  with open(file, "rb") as f:
    return f.read(start).count(b"\n") + local


def _documents(segment: Segment, settings: dict, counts: dict):
  """The segment's documents: text (CPT) or (prompt, response) pairs (SFT); bad lines raise FILE:LINE, or are
  skipped and counted with skip_bad_lines."""
  from clis_train import data
  if segment.kind == "text":
    text = data.text_or_none(pathlib.Path(segment.file))
    if text is None:
      counts["binary_files"] += 1
    elif not text.strip():
      counts["empty_files"] += 1
    elif settings["kind"] == "cpt":
      yield text
    else:
      raise DataError(f"{segment.file}: SFT data must be JSONL records, not a text file")
    return
  if segment.kind == "parquet":
    import pyarrow.parquet as pq
    table = pq.ParquetFile(segment.file).read_row_group(segment.start)
    field = settings["text_field"]
    if field not in table.column_names:
      raise DataError(f"{segment.file}: no column {field!r}; columns are {table.column_names}")
    yield from (t for t in table.column(field).to_pylist() if isinstance(t, str))
    return
  with open(segment.file, "rb") as f:
    f.seek(segment.start)
    raw_lines = f.read(segment.end - segment.start).split(b"\n")
  skip = settings["skip_bad_lines"]
  for local, raw in enumerate(raw_lines, 1):
    if not raw.strip():
      continue
    where = lambda: f"{segment.file}:{_line_number(segment.file, segment.start, local)}"
    try:
      record = json.loads(raw)
      if not isinstance(record, dict):
        raise ValueError("a JSON object was expected")
    except UnicodeDecodeError:
      if not skip:
        raise DataError(f"{where()}: not UTF-8; fix the file or pass --skip-bad-lines") from None
      counts["bad_lines"] += 1
      continue
    except ValueError as e:
      if not skip:
        raise DataError(f"{where()}: malformed JSONL line ({e}); fix it or pass --skip-bad-lines") from None
      counts["bad_lines"] += 1
      continue
    if settings["kind"] == "cpt":
      text = record.get(settings["text_field"])
      if not isinstance(text, str):
        if not skip:
          raise DataError(f"{where()}: no string field {settings['text_field']!r} (pass --text-field)")
        counts["bad_lines"] += 1
        continue
      yield text
    else:
      pair = data.sft_pair(record)
      if pair is None:
        if not skip:
          raise DataError(f"{where()}: an SFT record needs 'prompt' and 'response' strings, or 'messages' ending "
                          "with an assistant turn")
        counts["bad_lines"] += 1
        continue
      yield pair


_TOKENIZERS: dict = {}


def _tokenizer(name: str):
  if name not in _TOKENIZERS:
    from clis_train.data import make_tokenizer
    _TOKENIZERS[name] = make_tokenizer(name)
  return _TOKENIZERS[name]


def encode(tok, docs: list, kind: str):
  """(ids, mask or None) per document, BOS/EOS added as training adds them (data.cpt_examples / sft_examples)."""
  from clis_train.data import SFT_TEMPLATE
  bos = [tok.bos_id] if tok.bos_id is not None else []
  eos = [tok.eos_id] if tok.eos_id is not None else []
  if kind == "cpt":
    return [(np.concatenate([bos, ids, eos]), None) for ids in tok.encode_batch(docs)]
  heads = tok.encode_batch([SFT_TEMPLATE.format(prompt=p) for p, _ in docs])
  tails = tok.encode_batch([r for _, r in docs])
  out = []
  for head, tail in zip(heads, tails):
    head, tail = np.concatenate([bos, head]), np.concatenate([tail, eos])
    out.append((np.concatenate([head, tail]), np.concatenate([np.zeros(len(head), np.uint8),
                                                              np.ones(len(tail), np.uint8)])))
  return out


def _write_unit(job) -> dict:
  """Tokenises one unit and writes its shard (index last); returns its counts."""
  index, segments, settings, out = job
  tok = _tokenizer(settings["tokenizer"])
  dtype = np.dtype(settings["dtype"])
  counts = dict(documents=0, tokens=0, bad_lines=0, binary_files=0, empty_files=0, max_document_tokens=0,
                bytes=sum(s.end - s.start if s.kind != "parquet" else 0 for s in segments))
  stem = pathlib.Path(out) / f"shard-{index:06d}"
  ids_parts, mask_parts, lengths = [], [], []
  for segment in segments:
    docs = list(_documents(segment, settings, counts))
    for ids, mask in encode(tok, docs, settings["kind"]):
      ids_parts.append(ids.astype(dtype))
      lengths.append(len(ids))
      if mask is not None:
        mask_parts.append(mask)
  offsets = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int64)
  counts.update(documents=len(lengths), tokens=int(offsets[-1]), max_document_tokens=max(lengths, default=0))
  empty = np.zeros(0, dtype)
  _atomic_write(stem.with_suffix(".bin"), np.concatenate(ids_parts) if ids_parts else empty)
  if settings["kind"] == "sft":
    _atomic_write(stem.with_suffix(".mask.bin"), np.concatenate(mask_parts) if mask_parts else np.zeros(0, np.uint8))
  (stem.with_suffix(".json")).write_text(json.dumps(counts))
  tmp = stem.with_suffix(".idx.tmp.npy")
  np.save(tmp, offsets)
  os.replace(tmp, stem.with_suffix(".idx.npy"))
  return dict(index=index, **counts)


def _atomic_write(path: pathlib.Path, array: np.ndarray) -> None:
  tmp = path.with_name(path.name + ".tmp")
  array.tofile(tmp)
  os.replace(tmp, path)


# ----------------------------------------------------------------------------- prepare
def prepare(inputs: list[str], out: str, *, tokenizer: str = "byte", kind: str = "cpt", fmt: str = "auto",
            text_field: str = "text", suffixes: tuple[str, ...] | None = None, skip_bad_lines: bool = False,
            workers: int | None = None, unit_bytes: int = 64 << 20, progress: bool = True, stop=None) -> dict:
  """Tokenises `inputs` into shards under `out` (see the module docstring); returns the totals and the time.
  `stop` (errors.GracefulStop): a signal stops between shards, the finished ones kept for the next run."""
  from clis_train import data
  if kind not in ("cpt", "sft"):
    raise DataError(f"--kind {kind!r} must be cpt or sft")
  if unit_bytes < 1:
    raise DataError(f"--unit-mb must be positive; got {unit_bytes} bytes")
  t0 = time.perf_counter()
  out_dir = pathlib.Path(out)
  if out_dir.exists() and not out_dir.is_dir():
    raise DataError(f"--out {out!r} exists and is not a folder")
  if out_dir.is_dir() and any(out_dir.iterdir()) and not is_prepared(out_dir):
    raise DataError(f"--out {out!r} is a folder that holds other files; choose an empty or new folder")
  out_dir.mkdir(parents=True, exist_ok=True)
  tok = data.make_tokenizer(tokenizer)
  files = [f for path in inputs for f in data.input_files(path, fmt, suffixes)]
  settings = dict(format=FORMAT, inputs=[str(pathlib.Path(p).resolve()) for p in inputs], kind=kind, fmt=fmt,
                  text_field=text_field, suffixes=list(suffixes) if suffixes else None, skip_bad_lines=skip_bad_lines,
                  unit_bytes=unit_bytes, tokenizer=tokenizer, fingerprint=tokenizer_fingerprint(tokenizer),
                  vocab_size=tok.vocab_size, bos_id=tok.bos_id, eos_id=tok.eos_id,
                  dtype="uint16" if tok.vocab_size <= 1 << 16 else "uint32",
                  files={str(f): f.stat().st_size for f in files})
  record = out_dir / "prepare.json"
  if record.is_file():
    saved = json.loads(record.read_text())
    plan = [[Segment(**s) for s in unit] for unit in saved.pop("units")]
    if saved != settings:
      changed = sorted(k for k in settings if saved.get(k) != settings[k])
      raise DataError(f"--out {out!r} holds a preparation with other settings or inputs ({', '.join(changed)} "
                      "differ); resume with the same arguments, or choose a new --out")
  else:
    plan = plan_units(files, fmt, unit_bytes)
    tmp = record.with_suffix(".tmp")
    tmp.write_text(json.dumps(dict(settings, units=[[dataclasses.asdict(s) for s in u] for u in plan])))
    os.replace(tmp, record)
  (out_dir / "meta.json").unlink(missing_ok=True)
  todo = [i for i in range(len(plan)) if not (out_dir / f"shard-{i:06d}.idx.npy").is_file()]
  jobs = [(i, plan[i], settings, str(out_dir)) for i in todo]
  workers = max(1, min(workers or os.cpu_count() or 1, len(jobs) or 1))
  bar = None
  if progress:
    from tqdm import tqdm
    total = sum(s.end - s.start for i in todo for s in plan[i] if s.kind != "parquet")
    bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"prepare-data ({len(todo)} of {len(plan)} shards to do)")
  if workers == 1:
    results = map(_write_unit, jobs)
  else:
    ctx = multiprocessing.get_context("spawn")
    pool = ctx.Pool(workers, initializer=_worker_init)
    results = pool.imap_unordered(_write_unit, jobs)
  try:
    for result in results:
      if bar is not None:
        bar.update(result["bytes"])
      if stop is not None and stop.requested:
        raise KeyboardInterrupt
  finally:
    if workers > 1:
      pool.terminate()
    if bar is not None:
      bar.close()
  shards = [dict(name=f"shard-{i:06d}", **json.loads((out_dir / f"shard-{i:06d}.json").read_text()))
            for i in range(len(plan))]
  totals = {key: sum(s[key] for s in shards) for key in ("documents", "tokens", "bad_lines", "binary_files",
                                                          "empty_files", "bytes")}
  if totals["documents"] == 0:
    raise DataError(f"{', '.join(inputs)}: no documents (every file empty, binary or every line skipped)")
  meta = dict(format=FORMAT, kind=kind, tokenizer=tokenizer, fingerprint=settings["fingerprint"],
              vocab_size=tok.vocab_size, dtype=settings["dtype"], shards=shards, **totals,
              max_document_tokens=max(s["max_document_tokens"] for s in shards))
  tmp = out_dir / "meta.json.tmp"
  tmp.write_text(json.dumps(meta, indent=1))
  os.replace(tmp, out_dir / "meta.json")
  seconds = time.perf_counter() - t0
  return dict(totals, shards=len(shards), resumed_shards=len(plan) - len(todo), seconds=seconds,
              mb_per_s=totals["bytes"] / 1e6 / max(seconds, 1e-9), workers=workers)


def _worker_init():
  os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


# ----------------------------------------------------------------------------- reading
class PreparedCorpus:
  """A prepared folder's documents by global index (a grain random-access source): item i is
  {"ids": int32 [n], "weights": float32 [n] (1 where trained on: all of CPT, the responses of SFT)}.
  Each document is read with two positional reads (its two offsets, then its ids), not through memory maps: pages
  of a mapped file count in the process's resident memory, and random reads with the kernel's read-around mapped
  hundreds of MB more for a 5 GB corpus than for a 50 MB one. Files are opened when first read; the object
  pickles without them (grain worker processes)."""

  def __init__(self, path: str, *, tokenizer: str | None = None, kind: str | None = None):
    self.path = pathlib.Path(path)
    meta_path = self.path / "meta.json"
    if not meta_path.is_file():
      raise DataError(f"{str(path)!r} holds an unfinished preparation (no meta.json): run `clis-train prepare-data` "
                      "again with the same arguments to finish it")
    self.meta = json.loads(meta_path.read_text())
    if self.meta.get("format") != FORMAT:
      raise DataError(f"{meta_path}: format {self.meta.get('format')!r}, expected {FORMAT!r}; prepare it again")
    if tokenizer is not None and tokenizer_fingerprint(tokenizer) != self.meta["fingerprint"]:
      raise DataError(f"{str(path)!r} was prepared with tokenizer {self.meta['tokenizer']!r} "
                      f"({self.meta['fingerprint'][:19]}), but training uses data.tokenizer={tokenizer!r} "
                      f"({tokenizer_fingerprint(tokenizer)[:19]}): set data.tokenizer to the preparation's, or run "
                      "prepare-data again with --tokenizer set to training's")
    if kind is not None and kind != self.meta["kind"]:
      raise DataError(f"{str(path)!r} was prepared as {self.meta['kind']!r} data, but data.kind={kind!r}: prepare it "
                      f"again with --kind {kind}, or set the source's kind to {self.meta['kind']!r}")
    self._starts = np.concatenate([[0], np.cumsum([s["documents"] for s in self.meta["shards"]])]).astype(np.int64)
    self._dtype = np.dtype(self.meta["dtype"])
    self._open: dict = {}

  def __len__(self) -> int:
    return int(self._starts[-1])

  def __getstate__(self):
    return dict(self.__dict__, _open={})

  def __del__(self, _close=os.close):
    for s in list(getattr(self, "_open", {})):
      self._close(s, _close)

  def _close(self, s: int, close=os.close):
    idx_fd, ids_fd, _, mask_fd = self._open.pop(s)
    for fd in (idx_fd, ids_fd, mask_fd):
      if fd is not None:
        close(fd)

  def _shard(self, s: int):
    """(index fd, ids fd, offset of the index's data, mask fd or None) of shard s; at most OPEN_SHARDS open."""
    if s in self._open:
      self._open[s] = self._open.pop(s)  # most recently used last
    else:
      while len(self._open) >= OPEN_SHARDS:
        self._close(next(iter(self._open)))
      stem = self.path / self.meta["shards"][s]["name"]
      with open(stem.with_suffix(".idx.npy"), "rb") as f:
        major, _ = np.lib.format.read_magic(f)
        read_header = np.lib.format.read_array_header_1_0 if major == 1 else np.lib.format.read_array_header_2_0
        read_header(f)
        data_offset = f.tell()
      mask = os.open(stem.with_suffix(".mask.bin"), os.O_RDONLY) if self.meta["kind"] == "sft" else None
      self._open[s] = (os.open(stem.with_suffix(".idx.npy"), os.O_RDONLY), os.open(stem.with_suffix(".bin"), os.O_RDONLY),
                       data_offset, mask)
    return self._open[s]

  def __getitem__(self, i: int) -> dict:
    i = int(i)
    if not 0 <= i < len(self):
      raise IndexError(f"document {i} of {len(self)}")
    s = int(np.searchsorted(self._starts, i, side="right") - 1)
    idx_fd, ids_fd, data_offset, mask_fd = self._shard(s)
    lo, hi = (int(x) for x in np.frombuffer(os.pread(idx_fd, 16, data_offset + 8 * (i - int(self._starts[s]))),
                                            np.int64))
    size = self._dtype.itemsize
    ids = np.frombuffer(os.pread(ids_fd, (hi - lo) * size, lo * size), self._dtype).astype(np.int32)
    if mask_fd is None:
      weights = np.ones(hi - lo, np.float32)
    else:
      weights = np.frombuffer(os.pread(mask_fd, hi - lo, lo), np.uint8).astype(np.float32)
    return {"ids": ids, "weights": weights}
