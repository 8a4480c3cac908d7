"""scripts/activation_stats.py: its per-head statistics against a float64 numpy recomputation, and the
script end to end on a tiny trained run (CPU)."""

from __future__ import annotations

import importlib.util
import json
import math
import pathlib

import jax.numpy as jnp
import numpy as np

ROOT = pathlib.Path(__file__).parent.parent
_spec = importlib.util.spec_from_file_location("activation_stats", ROOT / "scripts" / "activation_stats.py")
stats_script = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(stats_script)


def _numpy_stats(q, k, seg, pos):
  q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
  b, s, hq, d = q.shape
  kq = np.repeat(k, hq // k.shape[2], axis=2)
  logits = np.einsum("bqhd,bkhd->bhqk", q, kq) / math.sqrt(d)
  vis = (np.arange(s)[None, :] <= np.arange(s)[:, None])[None] & (seg[:, :, None] == seg[:, None]) & (seg[:, :, None] != 0)
  logits = np.where(vis[:, None], logits, -np.inf)
  with np.errstate(invalid="ignore"):
    lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) + logits.max(-1, keepdims=True)
  with np.errstate(invalid="ignore"):
    rel = np.where(vis[:, None], logits - lse, -np.inf)
  t = stats_script.TILE
  tile_max = rel.reshape(b, hq, s // t, t, s // t, t).max((3, 5))
  tile_vis = np.broadcast_to(vis[:, None], rel.shape).reshape(b, hq, s // t, t, s // t, t).any((3, 5))
  late = (pos >= 16) & (seg != 0)
  start = np.arange(s)[None] - pos
  first = np.exp(np.take_along_axis(rel, np.broadcast_to(start[:, None, :, None], (b, hq, s, 1)), -1)[..., 0])
  spread = logits.max(-1) - np.where(vis[:, None], logits, np.inf).min(-1)
  knorm = np.linalg.norm(k, axis=-1)
  median = np.array([[np.median(knorm[i][seg[i] != 0, h]) for h in range(k.shape[2])] for i in range(b)])
  starts = (pos == 0) & (seg != 0)
  sink = np.array([np.mean(np.concatenate([knorm[i][starts[i], h] / median[i, h] for i in range(b)]))
                   for h in range(k.shape[2])])
  out = {"sink_ratio": sink,
         "first_attention": np.array([first[:, h][late].mean() for h in range(hq)]),
         "spread_p50": np.array([np.median(spread[:, h][late]) for h in range(hq)])}
  for bits in stats_script.SKIP_BITS:
    out[f"bwd_skip_{bits}"] = ((tile_max < -bits * math.log(2)) & tile_vis).sum((0, 2, 3)) / tile_vis.sum((0, 2, 3))
  return out


def test_attention_stats_match_float64():
  rng = np.random.default_rng(0)
  b, s, hq, hkv, d = 2, 512, 4, 2, 32
  q = rng.normal(size=(b, s, hq, d)) * np.array([0.5, 2.0, 1.0, 1.0])[None, None, :, None]
  k = rng.normal(size=(b, s, hkv, d))
  # kv head 1 is local: keys of tile t point along e_t and so do the queries of q heads 2, 3 in tile t,
  # so those rows put almost all their mass on their own tile and the earlier tiles can be skipped.
  tile_dir = np.eye(d)[np.arange(s) // stats_script.TILE]  # [S, D]
  k[:, :, 1] = tile_dir + 0.01 * k[:, :, 1]
  q[:, :, 2:] = 40.0 * math.sqrt(d) * tile_dir[None, :, None] + q[:, :, 2:]
  seg = np.ones((b, s), np.int32)
  seg[1, 200:] = 2
  seg[1, 480:] = 0  # padding
  pos = np.arange(s)[None].repeat(b, 0)
  pos[1, 200:] -= 200
  k[:, 0] *= 4.0  # a sink at each document start
  k[1, 200] *= 4.0
  got = stats_script.attention_stats(jnp.asarray(q, jnp.float32), jnp.asarray(k, jnp.float32), jnp.asarray(seg),
                                     jnp.asarray(pos))
  want = _numpy_stats(q, k, seg, pos)
  for name, value in want.items():
    np.testing.assert_allclose(np.asarray(got[name]), value, rtol=2e-4, atol=1e-6, err_msg=name)
  assert want["bwd_skip_16"][3] > 0.4 and want["bwd_skip_16"][0] == 0  # the check tells heads apart
  assert want["sink_ratio"].min() > 3


def test_rows_from_text_layouts():
  from clis_train.data import ByteTokenizer
  docs = ["a" * 50, "b" * 300, "c" * 20]
  tokens, positions, seg = stats_script.rows_from_text(docs, ByteTokenizer(), 128, 2, "packed")
  assert tokens.shape == (2, 128) and int(tokens[0, 0]) == ByteTokenizer.bos_id
  assert list(np.asarray(seg[0, :53])) == [1] * 52 + [2] and int(positions[0, 52]) == 0
  tokens, positions, seg = stats_script.rows_from_text(docs, ByteTokenizer(), 128, 2, "long")
  assert chr(int(tokens[0, 1])) == "b" and (np.asarray(seg) == 1).all()


def test_script_on_a_tiny_run(tmp_path):
  from clis_train.config import load_config
  from clis_train.train import train
  run = tmp_path / "run"
  train(load_config(str(ROOT / "recipes" / "cpt_tiny.yaml"),
                    [f"run_dir={run}", "train.steps=4", "checkpoint.every=2", "data.seq_len=128",
                     "data.per_device_batch=2", "train.progress_bar=false"]))
  out, sample = tmp_path / "stats.json", tmp_path / "sample.safetensors"
  stats_script.main([str(run), "--text", str(ROOT / "README.md"), "--seq-lens", "256", "--steps", "latest",
                     "--batch", "1", "--out", str(out), "--sample-out", str(sample), "--sample-len", "128"])
  records = json.loads(out.read_text())["records"]
  assert [(r["step"], r["layout"]) for r in records] == [(0, "packed"), (0, "long"), (4, "packed"), (4, "long")]
  assert len(records[-1]["layers"]) == 2 and len(records[-1]["layers"][0]["certified_blocks"]) == 4
  from safetensors.numpy import load_file
  tensors = load_file(str(sample))
  assert tensors["layer_1.q"].shape == (1, 128, 4, 32) and tensors["layer_0.k"].shape == (1, 128, 2, 32)
