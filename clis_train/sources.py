"""Training data as sources mixed by weight, each host reading its own share.

A source is a raw path (read and tokenised when the run starts, clis_train/data.py: small corpora), a prepared
folder (clis_train/corpus.py: documents read by random access as the iterator asks for them, chunked on the way,
so memory and time to the first step do not grow with the corpus) or, with no path, the embedded corpus.
`data.sources` lists several, `data.train_path` names one. Each source's items are split across hosts
(item i to host i mod jax.process_count()) and into training and held-out parts (raw: every k-th chunk, as
data.build_examples; prepared: every k-th document), then shuffled, repeated, mixed by weight with grain's
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
from clis_train.config import SourceConfig
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
  train, held = _every_kth(_host_share(grain.MapDataset.source(docs), host), data_cfg.eval_fraction)
  if data_cfg.eval_path and len(data_cfg.sources or ()) <= 1:
    held = None  # the configured eval_path replaces the held-out share (build_sources adds it)
  return Stream(train, chunker), (Stream(held, chunker) if held is not None else None)


def _raw(spec: SourceConfig | None, data_cfg, kind: str, tokenizer, host) -> tuple[Stream, Stream | None]:
  cfg = data_cfg if spec is None else dataclasses.replace(
      data_cfg, train_path=spec.path, kind=kind, format=spec.format or data_cfg.format,
      text_field=spec.text_field or data_cfg.text_field, eval_path=None, sources=None)
  examples = data.build_examples(cfg, tokenizer)
  share = lambda xs: _host_share(grain.MapDataset.source(xs), host)
  return Stream(share(examples.train)), (Stream(share(examples.eval)) if examples.eval else None)


def build_sources(data_cfg, tokenizer, *, host: tuple[int, int] | None = None) -> list[Source]:
  """The configured sources, this host's share of each (host: (index, count); default jax's process index and
  count). A single source keeps data.eval_path's held-out set when one is given."""
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
  if data_cfg.eval_path and data_cfg.sources is None and corpus.is_prepared(data_cfg.train_path or ""):
    docs = corpus.PreparedCorpus(data_cfg.eval_path, tokenizer=data_cfg.tokenizer, kind=data_cfg.kind)
    eval_stream = Stream(_host_share(grain.MapDataset.source(docs), host), out[0].train.chunker)
    out[0] = dataclasses.replace(out[0], eval=eval_stream)
  return out


def _examples(stream: Stream, *, seed: int, shuffle: bool) -> grain.IterDataset:
  ds = stream.items.shuffle(seed=seed) if shuffle else stream.items
  ds = ds.repeat(None).to_iter_dataset()
  return ds if stream.chunker is None else grain.experimental.FlatMapIterDataset(ds, stream.chunker)


def batches(sources: list[Source], *, split: str = "train", seq_len: int, batch_size: int, seed: int,
            packing_bins: int, shuffle: bool = True, workers: int = 0) -> grain.DatasetIterator:
  """An endless, checkpointable iterator of packed batches from the sources' `split` ("train" or "eval"),
  mixed by weight: inputs, targets, positions, segment_ids int32 [batch, seq_len], weights f32, and with several
  sources "source" int32 (the source of each token; padding 0 with segment id 0). One raw source gives exactly
  data.packed_batches's batches."""
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
