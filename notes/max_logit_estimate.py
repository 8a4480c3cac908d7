"""What a constant max-logit estimate (MaxText's `use_max_logit_estimate`) does, against CLiS.

MaxText's splash kernel, given use_max_logit_estimate = c > 0, skips the running max and uses
exp(s − c) for every row of every head, with no check and no fallback. We reproduce that
arithmetic with our reference kernel: a Certificate whose stabilizer is the constant c for
every row and that claims every tile certified. CLiS instead bounds each row, certifies per
tile, and falls back to the online softmax where the bound is too loose. Inputs: S=1024,
D=128, 2 heads, causal; ordinary logits, then q and k scaled by 4 (logit growth, what QK-clip
exists for). Relative L2 error of the output against float64. Our reference returns 0 for a
row whose weights all underflow (l = 0); splash divides, so there it would be 0/0.

  .venv/bin/python notes/max_logit_estimate.py > notes/max_logit_estimate.txt
"""

import math

import jax
import jax.numpy as jnp
import numpy as np

jax.config.update("jax_enable_x64", True)

from clis_kernels import attention, reference, stabilizer  # noqa: E402
from clis_kernels.plan import Mode  # noqa: E402
from clis_kernels.stabilizer import LOG2E, Certificate  # noqa: E402

S, H, D = 1024, 2, 128
bs = reference.BlockSizes(block_q=128, block_k=128)
scale = 1.0 / math.sqrt(D)
kw = dict(causal=True, scale=scale, kv_len=None, block_sizes=bs)
for amp in (1.0, 4.0):  # ordinary logits, and logits grown large (what QK-clip exists for)
  ks = jax.random.split(jax.random.PRNGKey(0), 4)
  q = jax.random.normal(ks[0], (1, S, H, D)) * amp
  k = (jax.random.normal(ks[1], (1, S, H, D)) + jax.random.normal(ks[3], (1, 1, H, D))) * amp
  v = jax.random.normal(ks[2], (1, S, H, D))
  logits = np.einsum("bqhd,bkhd->bhqk", np.float64(q), np.float64(k)) * scale
  logits = np.where(np.tril(np.ones((S, S), bool)), logits, -np.inf)
  row_max = logits.max(-1)
  p = np.exp(logits - row_max[..., None])
  want = np.einsum("bhqk,bkhd->bqhd", p / p.sum(-1, keepdims=True), np.float64(v))
  rel = lambda x: float(np.linalg.norm(np.float64(x) - want) / np.linalg.norm(want))
  print(f"\n== q, k scaled by {amp}: row max of the logits min {row_max.min():.1f}, median {np.median(row_max):.1f}, "
        f"max {row_max.max():.1f} nats")
  for dtype in (jnp.float32, jnp.bfloat16):
    qd, kd, vd = (x.astype(dtype) for x in (q, k, v))
    print(f"{jnp.dtype(dtype).name}: constant estimate c (nats) -> relative error, non-finite outputs, empty rows")
    shape = (1, H, S)
    for c in (-40.0, 0.0, 20.0, 60.0, 100.0, 150.0, 250.0):
      const = Certificate(m=jnp.full(shape, c * LOG2E, jnp.float32), certified=jnp.ones((1, H, S // 128), bool),
                          upper=jnp.zeros(shape), lower=jnp.zeros(shape), threshold=jnp.zeros((1, H)))
      out, lse = reference.forward(qd, kd, vd, None, const, mode=Mode.CERTIFICATE, **kw)[:2]
      out = np.asarray(out, np.float64)
      bad = int((~np.isfinite(out)).sum())
      empty = int((np.asarray(lse) >= stabilizer.EMPTY_LSE).sum())  # every weight underflowed: l = 0
      err = rel(np.where(np.isfinite(out), out, 0.0))
      print(f"  c = {c:6.1f}: error {err:.3e}, non-finite {bad} of {out.size}, rows with l = 0: {empty} of {H * S}")
    clis, stats = attention(qd, kd, vd, causal=True, implementation="reference", block_sizes=bs, return_stats=True)
    online = attention(qd, kd, vd, causal=True, implementation="reference", block_sizes=bs, stabilizer="online")
    print(f"  CLiS (per-row bound, certificate, fallback): error {rel(clis):.3e}, certified tiles "
          f"{float(stats.certified_fraction):.2f}; online softmax: error {rel(online):.3e}")
