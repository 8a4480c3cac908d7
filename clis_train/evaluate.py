"""Loss and perplexity of a checkpoint on a file, a folder or the run's held-out split.

Every example (a document chunk of at most data.seq_len tokens) is scored once, unpacked, in
batches padded to seq_len; the loss is the mean over target tokens of SFT-weighted cross-entropy
(nats), as in training. With the byte tokenizer, bits per byte counts only targets that are bytes
(not BOS/EOS).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax

from clis_train import corpus, data, sources
from clis_train.errors import DataError
from clis_train.runs import LoadedRun


def examples_for(run: LoadedRun, path: str | None, limit: int = 4096) -> list[dict]:
  """Examples of `path` (read as the run's data settings read files; a prepared folder: its first `limit`), or the
  first `limit` examples of the run's held-out split (every source's, in order), the documents training held out."""
  cfg = run.cfg
  if path is None or corpus.is_prepared(path):
    return _source_examples(run, path, limit)
  seq, long = cfg.data.seq_len, cfg.data.long_sequences
  if cfg.data.kind == "sft":
    return data.sft_examples(data.read_sft_pairs(path, skip_bad_lines=cfg.data.skip_bad_lines), run.tokenizer,
                             seq, long)
  docs = data.read_cpt_documents(path, fmt=cfg.data.format, text_field=cfg.data.text_field,
                                 skip_bad_lines=cfg.data.skip_bad_lines,
                                 suffixes=data.parse_suffixes(cfg.data.file_suffixes))
  return data.cpt_examples(docs, run.tokenizer, seq, long)


def _source_examples(run: LoadedRun, path: str | None, limit: int) -> list[dict]:
  cfg = run.cfg
  data_cfg = cfg.data if path is None else dataclasses.replace(cfg.data, train_path=path, sources=None,
                                                               eval_path=None, eval_fraction=0.0)
  built = sources.build_sources(data_cfg, run.tokenizer)
  streams = [s.eval for s in built] if path is None else [s.train for s in built]
  out = []
  for stream in (s for s in streams if s is not None):
    for i in range(len(stream)):
      out += stream.chunker.flat_map(stream.items[i]) if stream.chunker else [stream.items[i]]
      if len(out) >= limit:
        return out[:limit]
  if not out:
    raise DataError(f"the run holds out no evaluation data (data.eval_fraction={cfg.data.eval_fraction}, "
                    "data.eval_path unset); pass --data FILE_OR_FOLDER")
  return out


def _batches(examples, seq_len: int, batch_size: int):
  for start in range(0, len(examples), batch_size):
    chunk = examples[start:start + batch_size]
    batch = {k: np.zeros((batch_size, seq_len), np.float32 if k == "weights" else np.int32)
             for k in ("inputs", "targets", "weights", "segment_ids")}
    for row, ex in enumerate(chunk):
      n = len(ex["inputs"])
      batch["inputs"][row, :n], batch["targets"][row, :n] = ex["inputs"], ex["targets"]
      batch["weights"][row, :n], batch["segment_ids"][row, :n] = ex["weights"], 1
    yield batch


def evaluate(run: LoadedRun, examples: list[dict], *, batch_size: int = 8) -> dict:
  """{loss, perplexity, bits_per_token, bits_per_byte (byte tokenizer, else None), tokens, examples}."""
  if not examples:
    raise DataError("nothing to evaluate: the data gave no examples")
  seq_len = run.cfg.data.seq_len
  positions = jnp.broadcast_to(jnp.arange(seq_len), (batch_size, seq_len))
  byte_level = isinstance(run.tokenizer, data.ByteTokenizer)

  @jax.jit
  def sums(params, batch):
    logits = run.module.apply({"params": params}, batch["inputs"], positions, batch["segment_ids"],
                              mutable=["intermediates"])[0]
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    w = batch["weights"] * (batch["segment_ids"] != 0)
    is_byte = w * (batch["targets"] < 256)
    return jnp.stack([(ce * w).sum(), w.sum(), (ce * is_byte).sum(), is_byte.sum()])

  total = np.zeros(4, np.float64)
  for batch in _batches(examples, seq_len, batch_size):
    total += np.asarray(sums(run.params, batch), np.float64)
  nats, tokens, byte_nats, n_bytes = total
  loss = nats / max(tokens, 1.0)
  return {"loss": loss, "perplexity": math.exp(min(loss, 700.0)), "bits_per_token": loss / math.log(2),
          "bits_per_byte": byte_nats / max(n_bytes, 1.0) / math.log(2) if byte_level else None,
          "tokens": int(tokens), "examples": len(examples)}
