"""Attention statistics of a trained run, per layer and head, at each saved step (issues 16 and 17).

For rows of held-out text (packed documents as the trainer packs them, and single long documents)
it captures every layer's post-RoPE q, k (the model sows them) and reports, per layer and head:
  sink_ratio        key norm at each document's first token over the median key norm;
  first_attention   mean probability a query row gives its document's first token (rows >= 16 in);
  spread_p50/p99    each row's max minus min visible logit (nats), median and 99th percentile;
  certified_radius  certified tile fraction of the kernels' one-radius bound (stabilizer.certify);
  certified_blocks  the same for the block bound (stabilizer.certify_blocks);
  bwd_skip_{k}      fraction of visible (128 x 128) tiles whose every probability is below 2^-k
                    (max over the tile of s_ij - lse_i < -k ln 2): what certified backward tile
                    skipping could drop (issue 17).
It can also save a small sample of q, k, v as safetensors for CPU tests (--sample-out).

  python3 scripts/activation_stats.py RUN_DIR --text FOLDER --seq-lens 8192 32768 --out stats.json
"""

from __future__ import annotations

import argparse
import datetime
import functools
import itertools
import json
import math
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from clis_kernels import stabilizer
from clis_train import checkpoint, data
from clis_train.config import parse_suffixes
from clis_train.runs import load_run

TILE = 128  # backward tiles (the kernels' 128-row KV blocks)
CERT_TILE = 64  # the Mosaic GPU forward's query tile
SKIP_BITS = (16, 20, 24)


def rows_from_text(docs: list[str], tokenizer, seq_len: int, batch: int, layout: str):
  """tokens, positions, segment_ids int32 [batch, seq_len]. layout 'packed': documents (BOS ... EOS)
  one after another with their own segment ids and positions, as the trainer packs them; 'long':
  one document per row (the longest ones, cut to seq_len; a row is filled with the following
  documents as one stream when none is that long)."""
  encoded = [[tokenizer.bos_id] + tokenizer.encode(d) + [tokenizer.eos_id] for d in docs]
  rows = []
  if layout == "long":
    order = sorted(range(len(encoded)), key=lambda i: -len(encoded[i]))
    for i in order[:batch]:
      ids = list(encoded[i])
      j = 0
      while len(ids) < seq_len:  # too short: continue with the next documents, one segment
        ids += encoded[order[(batch + j) % len(order)]]
        j += 1
      ids = ids[:seq_len]
      rows.append((ids, list(range(seq_len)), [1] * seq_len))
  else:
    stream = itertools.cycle(encoded)
    for _ in range(batch):
      ids, pos, seg = [], [], []
      while len(ids) < seq_len:
        doc = next(stream)[: seq_len - len(ids)]
        ids += doc
        pos += list(range(len(doc)))
        seg += [len(set(seg)) + 1] * len(doc)
      rows.append((ids, pos, seg))
  return tuple(jnp.asarray(np.array([r[i] for r in rows], np.int32)) for i in range(3))


@jax.jit
def attention_stats(q, k, segment_ids, positions):
  """Per-head statistics of one layer: q [B,S,Hq,D], k [B,S,Hkv,D] (post-RoPE), causal."""
  b, s, hq, d = q.shape
  kq = jnp.repeat(k, hq // k.shape[2], axis=2).astype(jnp.float32)
  qf = q.astype(jnp.float32) * d ** -0.5
  chunk = min(512, s)
  cols = jnp.arange(s)

  def one_chunk(c):
    rows = c * chunk + jnp.arange(chunk)
    qc = jax.lax.dynamic_slice_in_dim(qf, c * chunk, chunk, axis=1)
    logits = jnp.einsum("bqhd,bkhd->bhqk", qc, kq, precision="highest")
    seg_r = jax.lax.dynamic_slice_in_dim(segment_ids, c * chunk, chunk, axis=1)
    pos_r = jax.lax.dynamic_slice_in_dim(positions, c * chunk, chunk, axis=1)
    vis = ((cols[None, None] <= rows[None, :, None]) & (seg_r[:, :, None] == segment_ids[:, None])
           & (seg_r[:, :, None] != 0))[:, None]  # [B,1,chunk,S]
    logits = jnp.where(vis, logits, -jnp.inf)
    lse = jax.nn.logsumexp(logits, axis=-1, keepdims=True)
    rel = jnp.where(vis, logits - lse, -jnp.inf)  # padding rows (no visible key) stay -inf
    tiles = lambda x, red: red(x.reshape(b, x.shape[1], chunk // TILE, TILE, s // TILE, TILE), axis=(3, 5))
    tile_max = tiles(rel, jnp.max)
    tile_vis = tiles(jnp.broadcast_to(vis, rel.shape), jnp.any)
    skip = jnp.stack([((tile_max < -bits * math.log(2)) & tile_vis).sum((0, 2, 3)) for bits in SKIP_BITS])
    start = jnp.clip(rows[None] - pos_r, 0, s - 1)  # each row's document start [B, chunk]
    first = jnp.exp(jnp.take_along_axis(rel, start[:, None, :, None], axis=-1)[..., 0])  # [B,H,chunk]
    spread = logits.max(-1) - jnp.where(vis, logits, jnp.inf).min(-1)
    return skip, tile_vis.sum((0, 2, 3)), first, spread, (pos_r >= 16) & (seg_r != 0)

  skip, visible, first, spread, late = jax.lax.map(one_chunk, jnp.arange(s // chunk))
  first = jnp.moveaxis(first, 0, 2).reshape(b, hq, s)
  spread = jnp.moveaxis(spread, 0, 2).reshape(b, hq, s)
  late = jnp.moveaxis(late, 0, 1).reshape(b, 1, s)
  knorm = jnp.linalg.norm(k.astype(jnp.float32), axis=-1)  # [B,S,Hkv]
  real = (segment_ids != 0)[..., None]
  median = jnp.nanmedian(jnp.where(real, knorm, jnp.nan), axis=1)  # [B,Hkv]
  starts = ((positions == 0) & (segment_ids != 0))[..., None]
  sink = jnp.where(starts, knorm / median[:, None], 0).sum((0, 1)) / starts.sum((0, 1))
  spread_rows = jnp.where(late, spread, jnp.nan)
  return dict(
      sink_ratio=sink,  # [Hkv]
      first_attention=jnp.where(late, first, 0).sum((0, 2)) / late.sum((0, 2)),  # [Hq]
      spread_p50=jnp.nanmedian(spread_rows, axis=(0, 2)), spread_p99=jnp.nanpercentile(spread_rows, 99, axis=(0, 2)),
      **{f"bwd_skip_{bits}": skip[:, i].sum(0) / visible.sum(0) for i, bits in enumerate(SKIP_BITS)})


@functools.partial(jax.jit, static_argnames="bound")
def certified(q, k, v, segment_ids, bound):
  """Certified tile fraction per head [Hq] of the radius or the block bound (causal, the kernels' tau)."""
  kw = dict(causal=True, scale=q.shape[-1] ** -0.5, tau=stabilizer.default_tau(q.dtype), granularity="tile", block_q=CERT_TILE,
            seq_len=q.shape[1])
  fn = stabilizer.certify if bound == "radius" else stabilizer.certify_blocks
  return fn(q, k, v, segment_ids, **kw).certified.mean((0, 2))


def make_forward(module):
  """One jitted forward for every step's parameters: (logits, intermediates and activations)."""
  return jax.jit(lambda params, tokens, positions, segment_ids: module.apply(
      {"params": params}, tokens, positions, segment_ids, mutable=["intermediates", "activations"]))


def layer_records(forward, params, n_layers, tokens, positions, segment_ids):
  _, extra = forward(params, tokens, positions, segment_ids)
  out = []
  for layer in range(n_layers):
    (q, k, v), = extra["activations"][f"layer_{layer}"]["attention"]["qkv"]
    stats = {name: np.asarray(x).tolist() for name, x in attention_stats(q, k, segment_ids, positions).items()}
    for bound in ("radius", "blocks"):
      stats[f"certified_{bound}"] = np.asarray(certified(q, k, v, segment_ids, bound)).tolist()
    out.append({"layer": layer, **stats})
  return out, extra


def save_sample(path, extra, tokens, positions, segment_ids, layers, length, about):
  from safetensors.numpy import save_file
  tensors = {"tokens": tokens[:1, :length], "positions": positions[:1, :length], "segment_ids": segment_ids[:1, :length]}
  for layer in layers:
    (q, k, v), = extra["activations"][f"layer_{layer}"]["attention"]["qkv"]
    for name, x in zip("qkv", (q, k, v)):
      tensors[f"layer_{layer}.{name}"] = x[:1, :length]
  tensors = {n: np.asarray(jnp.asarray(x, jnp.float32) if x.dtype == jnp.bfloat16 else x) for n, x in tensors.items()}
  pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
  save_file({n: x.astype(np.float16) if x.dtype == np.float32 else x for n, x in tensors.items()}, str(path),
            metadata={"about": about})


def summary(layers):
  mean = lambda key: float(np.mean([np.mean(r[key]) for r in layers]))
  return {key: mean(key) for key in layers[0] if key != "layer"}


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("run_dir")
  parser.add_argument("--text", required=True, help="file or folder of held-out text (as data.train_path reads)")
  parser.add_argument("--seq-lens", type=int, nargs="+", default=[8192])
  parser.add_argument("--long-seq-lens", type=int, nargs="*", default=None,
                      help="lengths measured on the final step only (default: none)")
  parser.add_argument("--batch", type=int, default=2)
  parser.add_argument("--steps", default="all", help="all | latest | comma-separated steps")
  parser.add_argument("--no-init", action="store_true", help="skip the model at initialisation")
  parser.add_argument("--attention", default=None, help="attention the forward runs with (default: the run's)")
  parser.add_argument("--suffixes", default=".py,.md,.rst,.txt", help="files read from a --text folder")
  parser.add_argument("--max-docs", type=int, default=4000)
  parser.add_argument("--sample-out", default=None, help="safetensors file for a q/k/v sample of the last step")
  parser.add_argument("--sample-layers", type=int, nargs="*", default=None)
  parser.add_argument("--sample-len", type=int, default=1024)
  parser.add_argument("--out", default="activation_stats.json")
  args = parser.parse_args(argv)

  docs = data.read_cpt_documents(args.text, fmt="auto", text_field="text", skip_bad_lines=True,
                                 suffixes=parse_suffixes(args.suffixes))[: args.max_docs]
  saved = checkpoint.saved_steps(args.run_dir, "run_dir")
  steps = saved if args.steps == "all" else saved[-1:] if args.steps == "latest" else [int(x) for x in args.steps.split(",")]
  plan = ([] if args.no_init else [None]) + steps
  records, forward = [], None
  for i, step in enumerate(plan):
    run = load_run(args.run_dir, step=step, attention=args.attention, init=step is None)
    forward = forward or make_forward(run.module)
    lengths = args.seq_lens + (args.long_seq_lens or [] if i == len(plan) - 1 else [])
    for seq_len in lengths:
      for layout in ("packed", "long"):
        t0 = time.time()
        tokens, positions, segment_ids = rows_from_text(docs, run.tokenizer, seq_len, args.batch, layout)
        layers, extra = layer_records(forward, run.params, run.dims.n_layers, tokens, positions, segment_ids)
        record = {"step": 0 if step is None else step, "init": step is None, "seq_len": seq_len, "layout": layout,
                  "documents_per_row": float(np.mean([len(set(r.tolist()) - {0}) for r in np.asarray(segment_ids)])),
                  "summary": summary(layers), "layers": layers, "seconds": time.time() - t0}
        records.append(record)
        print(json.dumps({k: v for k, v in record.items() if k != "layers"}), flush=True)
        if args.sample_out and i == len(plan) - 1 and seq_len == args.seq_lens[0] and layout == "long":
          chosen = args.sample_layers if args.sample_layers is not None else [0, run.dims.n_layers - 1]
          save_sample(args.sample_out, extra, tokens, positions, segment_ids, chosen, args.sample_len,
                      f"scripts/activation_stats.py {args.run_dir} step {step}: post-RoPE q, k, v of layers {chosen}, "
                      f"first row of the 'long' layout over {args.text}, first {args.sample_len} tokens, float16")
  with open(args.out, "w") as f:
    json.dump(dict(command="python3 scripts/activation_stats.py " + " ".join(sys.argv[1:] if argv is None else argv),
                   device=jax.devices()[0].device_kind, jax_version=jax.__version__,
                   date=datetime.date.today().isoformat(), run_dir=args.run_dir, records=records), f)


if __name__ == "__main__":
  main()
