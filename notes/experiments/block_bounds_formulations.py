"""The block bound's pass over K (stabilizer.block_bounds) on a GPU: where its time goes and whether another
XLA formulation is faster. Variants at 16 and 64 keys per centre, causal layout, GQA 32/8 (8 kv heads), D 128,
bf16, B x S = 32k tokens, outlier_channels keys; interleaved medians (ms).
  current: stabilizer.block_bounds
  sums:    one masked block sum, the exceptional keys subtracted from their blocks' sums (a scatter of E rows)
           instead of a second weighted sum over every key
  topk:    jax.lax.top_k of the [B, Hkv, S] scores alone;  one_pass: centres + deviations alone

  python3 notes/experiments/block_bounds_formulations.py --out $OUT/block_bounds_formulations.json
"""

import argparse
import json

import jax
import jax.numpy as jnp

from clis_train import benchmarking
from clis_kernels import masks, stabilizer, testing


def one_pass(k, block):
  batch, sk, hkv, d = k.shape
  kb = k.astype(jnp.float32).reshape(batch, sk // block, block, hkv, d)
  centres = kb.mean(2)
  return jnp.linalg.norm(kb - centres[:, :, None], axis=-1)


def sums(k, segment_ids, *, block, seq_len, budget=32):
  kf = k.astype(jnp.float32)
  batch, sk, hkv, d = kf.shape
  nb = sk // block
  valid = jnp.broadcast_to(masks.key_is_real(masks.segment_ids_of(segment_ids), sk, seq_len), (batch, sk))
  kb = kf.reshape(batch, nb, block, hkv, d)
  vb = valid.reshape(batch, nb, block)[..., None]  # [B, nb, block, 1]
  total = jnp.where(vb[..., None], kb, 0.0).sum(2)  # [B, nb, Hkv, D]
  count = jnp.broadcast_to(vb.sum(2).astype(jnp.float32), (batch, nb, hkv))  # [B, nb, Hkv]
  dev = jnp.linalg.norm(kb - (total / jnp.maximum(count, 1.0)[..., None])[:, :, None], axis=-1)  # [B, nb, blk, Hkv]
  score = jnp.where(vb, dev, -1.0).reshape(batch, sk, hkv).transpose(0, 2, 1)
  top, where = jax.lax.top_k(score, budget)
  is_exceptional = top >= 0.0
  w = is_exceptional.astype(jnp.float32)  # [B, Hkv, E]
  k_e = jnp.take_along_axis(kf, where.transpose(0, 2, 1)[..., None], axis=1)  # [B, E, Hkv, D]
  b, h = jnp.arange(batch)[:, None, None], jnp.arange(hkv)[None, :, None]
  total = total.at[b, where // block, h].add(-w[..., None] * k_e.transpose(0, 2, 1, 3))
  count = count.at[b, where // block, h].add(-w)
  centres = total / jnp.maximum(count, 1.0)[..., None]
  drop = jnp.zeros((batch, hkv, sk), bool).at[b, h, where].max(is_exceptional).transpose(0, 2, 1)
  keep = (vb[..., 0].reshape(batch, sk, 1) & ~drop).reshape(batch, nb, block, hkv)
  dev = jnp.linalg.norm(kb - centres[:, :, None], axis=-1)
  radii = jnp.where(keep, dev, 0.0).max(2).transpose(0, 2, 1)
  return stabilizer.BlockBounds(centres=centres, radii=radii, exceptional=where.astype(jnp.int32),
                                is_exceptional=is_exceptional)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--seq-len", type=int, default=32768)
  parser.add_argument("--out", required=True)
  args = parser.parse_args()
  s = args.seq_len
  _, k, _, _, _ = testing.inputs("outlier_channels", max(1, 32768 // s), s, 32, 8, 128)
  fns, records = {}, []
  for block in (16, 64):
    current = jax.jit(lambda k, block=block: stabilizer.block_bounds(k, None, block=block, seq_len=s))
    alt = jax.jit(lambda k, block=block: sums(k, None, block=block, seq_len=s))
    a, b = current(k), alt(k)
    agree = dict(exceptional=bool((jnp.sort(a.exceptional, -1) == jnp.sort(b.exceptional, -1)).all()),
                 centres=float(jnp.abs(a.centres - b.centres).max()), radii=float(jnp.abs(a.radii - b.radii).max()))
    print(block, agree, flush=True)
    fns[f"current{block}"] = lambda f=current: f(k)
    fns[f"sums{block}"] = lambda f=alt: f(k)
    fns[f"one_pass{block}"] = lambda f=jax.jit(lambda k, block=block: one_pass(k, block)): f(k)
  scores = jnp.abs(jax.random.normal(jax.random.PRNGKey(0), (k.shape[0], 8, s)))
  fns["topk"] = lambda f=jax.jit(lambda x: jax.lax.top_k(x, 32)): f(scores)
  for name, (med, lo, hi) in benchmarking.interleaved_medians(fns, repeats=9, inner=10).items():
    records.append(dict(S=s, variant=name, ms=med, ms_min=lo, ms_max=hi))
    print(records[-1], flush=True)
  json.dump(dict(records=records, **benchmarking.device_meta()), open(args.out, "w"), indent=1)


if __name__ == "__main__":
  main()
