"""Certified fraction and clis/online forward time with a logits soft cap or a local window (issue 14).

On inputs shaped like a pretrained model's (RoPE θ = 1e4, a few key channels with large offsets
before RoPE, a sink key at position 0 with 4x the median key norm, query norms giving row logit
spreads of ~20 nats) and on Gaussian ones; causal, GQA 32/8, D 128, bf16, B 2 x 8192 (16k tokens).
The Triton kernels (pallas_gpu): the Mosaic GPU ones take neither option. Variants interleaved.

  python3 notes/experiments/softcap_window.py --out $OUT/softcap_window.json
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp

from clis_kernels import attention
from clis_train import benchmarking


def rope(x, theta):
  d = x.shape[-1]
  freq = theta ** (-jnp.arange(0, d, 2) / d)
  angle = jnp.arange(x.shape[1])[:, None] * freq[None, :]  # [S, D/2]
  cos, sin = jnp.cos(angle)[None, :, None, :], jnp.sin(angle)[None, :, None, :]
  x1, x2 = x[..., ::2], x[..., 1::2]
  return jnp.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).reshape(x.shape)


def inputs(kind, b, s, hq, hkv, d, seed=0):
  kq, kk, kv, ko, ks = jax.random.split(jax.random.PRNGKey(seed), 5)
  q = jax.random.normal(kq, (b, s, hq, d))
  k = jax.random.normal(kk, (b, s, hkv, d))
  v = jax.random.normal(kv, (b, s, hkv, d))
  if kind == "pretrained_like":
    offsets = jnp.zeros((d,)).at[jax.random.choice(ko, d, (4,), replace=False)].set(8.0)
    k = rope(k + offsets, 1e4)
    q = rope(q * 2.5, 1e4)  # row logit spreads of ~20 nats
    median = jnp.median(jnp.linalg.norm(k, axis=-1))
    k = k.at[:, 0].set(4.0 * median * k[:, 0] / jnp.linalg.norm(k[:, 0], axis=-1, keepdims=True))
  return [x.astype(jnp.bfloat16) for x in (q, k, v)]


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--seq", type=int, default=8192)
  parser.add_argument("--batch", type=int, default=2)
  parser.add_argument("--repeats", type=int, default=15)
  parser.add_argument("--out", default="softcap_window.json")
  args = parser.parse_args()
  b, s, hq, hkv, d = args.batch, args.seq, 32, 8, 128
  options = {"plain": {}, "cap30": dict(logits_soft_cap=30.0), "cap50": dict(logits_soft_cap=50.0),
             "window4096": dict(local_window_size=4096)}
  records = []
  for kind in ("gaussian", "pretrained_like"):
    q, k, v = inputs(kind, b, s, hq, hkv, d)
    fns, fractions = {}, {}
    for name, kw in options.items():
      for stabilizer in ("clis", "online"):
        f = jax.jit(lambda q, k, v, kw=kw, st=stabilizer: attention(q, k, v, causal=True, stabilizer=st,
                                                                    implementation="pallas_gpu", **kw))
        fns[f"{name}/{stabilizer}"] = lambda f=f: f(q, k, v)
      stats = jax.jit(lambda q, k, v, kw=kw: attention(q, k, v, causal=True, implementation="pallas_gpu",
                                                       return_stats=True, **kw)[1].certified_fraction)
      fractions[name] = float(stats(q, k, v))
    times = benchmarking.interleaved_medians(fns, repeats=args.repeats, inner=5)
    for name in options:
      clis, online = times[f"{name}/clis"], times[f"{name}/online"]
      records.append(dict(inputs=kind, option=name, certified_fraction=fractions[name], clis_ms=clis,
                          online_ms=online, clis_over_online=online[0] / clis[0]))
      print(json.dumps(records[-1]))
  with open(args.out, "w") as f:
    json.dump(dict(meta=benchmarking.device_meta(), command="python3 notes/experiments/softcap_window.py",
                   shape=dict(batch=b, seq=s, hq=hq, hkv=hkv, d=d, causal=True, dtype="bfloat16"),
                   records=records), f, indent=1)


if __name__ == "__main__":
  main()
