"""Training data as sources mixed by weight, each host reading its own share.

A source is a prepared folder (clis_train/corpus.py: documents read from disk by random access as the iterator
asks for them, so memory and time to the first step do not grow with the corpus), a raw path (small corpora: its
text read into memory when the run starts, tokenised as the iterator reaches each document) or, with no path, the
embedded corpus. Both kinds go through one pipeline: documents → tokens ({"ids", "weights"}) → chunks of
seq_len + 1 (`Chunker`) → packing.
`data.sources` lists several, `data.train_path` names one. Each source's items are split across hosts
(document i to host i mod jax.process_count()) and into training and held-out parts (every k-th document), then
shuffled, repeated, mixed by weight with grain's
`IterDataset.mix` (deterministic by seed), packed and batched. With several sources every token carries its
source's index ("source" [B, S]) so the trainer can log the realised mixture.
"""

from __future__ import annotations

import dataclasses
import pathlib

import grain
import jax
import numpy as np

from clis_train import corpus, data
from clis_train.config import SourceConfig, parse_suffixes
from clis_train.errors import DataError


class Chunker(grain.experimental.FlatMapTransform):
  """A document {"ids", "weights"} → examples of at most seq_len + 1 tokens, by data._chunks's rule (split or
  truncate); chunks with no token to train on (an SFT prompt's) are dropped, as data.sft_examples drops them."""

  def __init__(self, seq_len: int, long_sequences: str, max_document_tokens: int):
    self.seq_len, self.long_sequences = seq_len, long_sequences
    self.max_fan_out = max(1, -(-max_document_tokens // seq_len))

  def flat_map(self, doc):
    ids, weights, n = doc["ids"], doc["weights"], self.seq_len
    starts = [0] if len(ids) <= n + 1 or self.long_sequences == "truncate" else range(0, len(ids) - 1, n)
    out = []
    for start in starts:
      chunk, w = ids[start:start + n + 1], weights[start:start + n + 1]
      if len(chunk) > 1 and w[1:].sum() > 0:
        out.append({"inputs": chunk[:-1], "targets": chunk[1:], "weights": w[1:]})
    return out


@dataclasses.dataclass(frozen=True)
class Stream:
  """One split of one source: `items` are examples (raw) or documents that `chunker` turns into examples."""
  items: grain.MapDataset
  chunker: Chunker | None = None

  def __len__(self) -> int:
    return len(self.items)


@dataclasses.dataclass(frozen=True)
class Source:
  name: str
  weight: float
  train: Stream
  eval: Stream | None


def _host_share(ds: grain.MapDataset, host: tuple[int, int]) -> grain.MapDataset:
  index, count = host
  return ds if count == 1 else ds.slice(slice(index, None, count))


def _every_kth(ds: grain.MapDataset, fraction: float) -> tuple[grain.MapDataset, grain.MapDataset | None]:
  """(training, held out): every k-th item held out (k = 1/fraction, at least 2), lazily (index arithmetic, no
  list of indices); the first item always trains."""
  if fraction <= 0:
    return ds, None
  k = max(2, round(1 / fraction))
  n_eval = len(ds) // k
  train = grain.MapDataset.range(len(ds) - n_eval).map(lambda j: ds[j + j // (k - 1)])
  held = grain.MapDataset.range(n_eval).map(lambda j: ds[j * k + k - 1]) if n_eval else None
  return train, held


def _prepared(spec: SourceConfig, data_cfg, kind: str, host) -> tuple[Stream, Stream | None]:
  docs = corpus.PreparedCorpus(spec.path, tokenizer=data_cfg.tokenizer, kind=kind)
  chunker = Chunker(data_cfg.seq_len, data_cfg.long_sequences, docs.meta["max_document_tokens"])
  train, held = _every_kth(_host_share(grain.MapDataset.source(docs), host), _held_out_fraction(data_cfg))
  return Stream(train, chunker), (Stream(held, chunker) if held is not None else None)


def _held_out_fraction(data_cfg) -> float:
  """data.eval_fraction, or 0 when data.eval_path names the held-out data (then every document trains)."""
  return 0.0 if data_cfg.eval_path else data_cfg.eval_fraction


def _eval_path_stream(data_cfg, tokenizer, host) -> Stream:
  """data.eval_path's documents: a prepared folder, or raw text tokenised on the fly."""
  path, kind = data_cfg.eval_path, data_cfg.kind
  if corpus.is_prepared(path):
    docs = corpus.PreparedCorpus(path, tokenizer=data_cfg.tokenizer, kind=kind)
    chunker = Chunker(data_cfg.seq_len, data_cfg.long_sequences, docs.meta["max_document_tokens"])
    return Stream(_host_share(grain.MapDataset.source(docs), host), chunker)
  docs = _host_share(grain.MapDataset.source(_read_raw(path, data_cfg, kind)), host)
  return Stream(docs.map(Tokenize(tokenizer, kind)), Chunker(data_cfg.seq_len, data_cfg.long_sequences, data_cfg.seq_len))


class Tokenize:
  """A raw document (text, or an SFT (prompt, response) pair) → {"ids", "weights"}, as prepare-data would store it
  (corpus.encode: BOS/EOS, the SFT template, weight 0 on the prompt). Runs in grain's map, so in its worker
  processes when data.workers > 0."""

  def __init__(self, tokenizer, kind: str):
    self.tokenizer, self.kind = tokenizer, kind

  def __call__(self, doc) -> dict:
    ids, mask = corpus.encode(self.tokenizer, [doc], self.kind)[0]
    return {"ids": ids.astype(np.int32),
            "weights": np.ones(len(ids), np.float32) if mask is None else mask.astype(np.float32)}


def _read_raw(path: str | None, cfg, kind: str) -> list:
  """A raw path's documents (strings, or (prompt, response) pairs for SFT) in memory, untokenised; None: the
  embedded corpus."""
  if kind == "sft":
    return data.read_sft_pairs(path, skip_bad_lines=cfg.skip_bad_lines) if path else data.embedded_sft_pairs()
  if not path:
    return data.embedded_cpt_documents()
  return data.read_cpt_documents(path, fmt=cfg.format, text_field=cfg.text_field, skip_bad_lines=cfg.skip_bad_lines,
                                 suffixes=parse_suffixes(cfg.file_suffixes))


def _raw(spec: SourceConfig | None, data_cfg, kind: str, tokenizer, host) -> tuple[Stream, Stream | None]:
  """A raw path (or the embedded corpus) read into memory as text and tokenised on the fly, with the prepared
  folders' semantics: every k-th document held out, documents chunked as the iterator reaches them."""
  cfg = data_cfg if spec is None else dataclasses.replace(
      data_cfg, format=spec.format or data_cfg.format, text_field=spec.text_field or data_cfg.text_field)
  path = data_cfg.train_path if spec is None else spec.path
  tokenize = Tokenize(tokenizer, kind)
  docs = _host_share(grain.MapDataset.source(_read_raw(path, cfg, kind)), host)
  train, held = _every_kth(docs, _held_out_fraction(cfg))
  chunker = Chunker(cfg.seq_len, cfg.long_sequences, max_document_tokens=cfg.seq_len)
  sample = [ex for i in range(min(len(train), 256)) for ex in chunker.flat_map(tokenize(train[i]))]
  if not sample:
    raise DataError(f"data path {path!r}: no training examples in its first {min(len(train), 256)} documents after "
                    f"tokenization (documents shorter than 2 tokens, or every SFT response cut by "
                    f"data.seq_len={cfg.seq_len})")
  return Stream(train.map(tokenize), chunker), (Stream(held.map(tokenize), chunker) if held is not None else None)


def build_sources(data_cfg, tokenizer, *, host: tuple[int, int] | None = None) -> list[Source]:
  """The configured sources, this host's share of each (host: (index, count); default jax's process index and
  count). data.eval_path, when set, is the held-out set of the whole mixture, and every document trains."""
  host = (jax.process_index(), jax.process_count()) if host is None else host
  specs = data_cfg.sources or (None,)
  out = []
  for i, spec in enumerate(specs):
    path = data_cfg.train_path if spec is None else spec.path
    kind = data_cfg.kind if spec is None or spec.kind is None else spec.kind
    if path is not None and corpus.is_prepared(path):
      train, held = _prepared(spec or SourceConfig(path=path), data_cfg, kind, host)
    else:
      if path is not None and not pathlib.Path(path).exists():
        raise DataError(f"data path {path!r} does not exist" + (f" (data.sources[{i}])" if spec else ""))
      train, held = _raw(spec, data_cfg, kind, tokenizer, host)
    if len(train) == 0:
      raise DataError(f"data source {path!r}: no training items on host {host[0]} of {host[1]}")
    name = (spec.name if spec is not None and spec.name else None) or (pathlib.Path(path).name if path else "embedded")
    out.append(Source(name, 1.0 if spec is None else spec.weight, train, held))
  if data_cfg.eval_path:  # one held-out set for the whole mixture instead of each source's share
    held = _eval_path_stream(data_cfg, tokenizer, host)
    out = [dataclasses.replace(s, eval=held if i == 0 else None) for i, s in enumerate(out)]
  return out


def _examples(stream: Stream, *, seed: int, shuffle: bool) -> grain.IterDataset:
  ds = stream.items.shuffle(seed=seed) if shuffle else stream.items
  ds = ds.repeat(None).to_iter_dataset()
  return ds if stream.chunker is None else grain.experimental.FlatMapIterDataset(ds, stream.chunker)


def batches(sources: list[Source], *, split: str = "train", seq_len: int, batch_size: int, seed: int,
            packing_bins: int, shuffle: bool = True, workers: int = 0) -> grain.DatasetIterator:
  """An endless, checkpointable iterator of packed batches from the sources' `split` ("train" or "eval"),
  mixed by weight: inputs, targets, positions, segment_ids int32 [batch, seq_len], weights f32, and with several
  sources "source" int32 (the source of each token; padding 0 with segment id 0)."""
  streams = [(i, s, getattr(s, split)) for i, s in enumerate(sources) if getattr(s, split) is not None]
  if not streams:
    raise DataError(f"no source has a {split} split")
  mixed = len(streams) > 1
  parts = []
  for i, source, stream in streams:
    ds = _examples(stream, seed=seed + 1009 * i, shuffle=shuffle)
    if mixed:
      ds = ds.map(lambda x, i=i: dict(x, source=np.full(len(x["inputs"]), i, np.int32)))
    parts.append(ds)
  ds = grain.IterDataset.mix(parts, [s.weight for _, s, _ in streams]) if mixed else parts[0]
  lengths = {"inputs": seq_len, "targets": seq_len, "weights": seq_len, **({"source": seq_len} if mixed else {})}
  ds = grain.experimental.FirstFitPackIterDataset(ds, length_struct=lengths, num_packing_bins=packing_bins,
                                                  seed=seed, shuffle_bins=shuffle)
  ds = ds.batch(batch_size, drop_remainder=True)
  keep = ("inputs", "targets", "weights") + (("source",) if mixed else ())
  ds = ds.map(lambda b: {**{k: b[k] for k in keep}, "positions": b["inputs_positions"],
                         "segment_ids": b["inputs_segment_ids"]})
  if workers:
    from absl import flags
    if not flags.FLAGS.is_parsed():  # grain's workers read absl flags, which a plain Python program never parses
      flags.FLAGS.mark_as_parsed()
    ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers))
  return iter(ds)


def realised_shares(counts: np.ndarray) -> list[float]:
  """Token counts per source → fractions (all zero when nothing was counted)."""
  total = counts.sum()
  return [float(c / total) if total else 0.0 for c in counts]
