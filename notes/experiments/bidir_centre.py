"""The radius bound's bidirectional centre: the exact key mean (now) against the sampled median of block
means (before 2026-12-01's fix), on Gaussian keys, the pretrained-like families and testing.hull_escaping.

Both certificates are stabilizer.certify_rows over stabilizer.key_bounds; the old one is rebuilt exactly
by asking key_bounds for a window that covers every key (its median branch, radius over all blocks) and
certifying without the window (L = q·c). Per case: certified fraction, median gap U − L (nats), and the
rows whose L exceeds their true max (computed in float64 where S ≤ --check-up-to).

  python3 notes/experiments/bidir_centre.py --out bidir_centre.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np

from clis_kernels import stabilizer, testing
from clis_kernels.stabilizer import LOG2E

SHAPES = [("bidirectional_4k", 1, 4096, 12, 12), ("bidirectional_32k", 1, 32768, 12, 12)]


def _inputs(family, b, s, hq, hkv):
  if family == "gaussian":
    return testing.random_inputs(0, b, s, hq, hkv, 128, jnp.bfloat16)[:3]
  if family == "hull_escaping":
    return testing.hull_escaping(b, s, hq, hkv, 128, magnitude=60.0)[:3]
  return testing.inputs(family, b, s, hq, hkv, 128)[:3]


def _row_max(q, k, scale):
  """[B, Hq, S] max base-2 logit, float64, in chunks of rows."""
  q64, k64 = np.asarray(q, np.float64), np.asarray(k, np.float64)
  k64 = np.repeat(k64, q.shape[2] // k.shape[2], axis=2)
  out = np.empty((q.shape[0], q.shape[2], q.shape[1]))
  for i in range(0, q.shape[1], 512):
    out[:, :, i:i + 512] = np.einsum("bqhd,bkhd->bhqk", q64[:, i:i + 512], k64).max(-1) * scale * LOG2E
  return out


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default="bidir_centre.json")
  parser.add_argument("--families", nargs="*", default=["gaussian", *testing.FAMILIES[:-1], "hull_escaping"])
  parser.add_argument("--check-up-to", type=int, default=4096)
  args = parser.parse_args()
  records = []
  for name, b, s, hq, hkv in SHAPES:
    for family in args.families:
      q, k, v = _inputs(family, b, s, hq, hkv)
      scale, t0 = 128 ** -0.5, time.time()
      kw = dict(causal=False, tau=stabilizer.default_tau(q.dtype), block_q=64, seq_len=s)
      rows = dict(causal=False, scale=scale, granularity="tile", block_q=64, seq_len=s)
      mean = jax.jit(lambda q, k, v: stabilizer.certify_rows(q, k, None, stabilizer.key_bounds(k, v, None, **kw),
                                                              **rows))(q, k, v)
      median = jax.jit(lambda q, k, v: stabilizer.certify_rows(
          q, k, None, stabilizer.key_bounds(k, v, None, **kw, window=(s, s)), **rows))(q, k, v)
      record = dict(shape=name, family=family)
      row_max = _row_max(q, k, scale) if s <= args.check_up_to else None
      for label, cert in (("mean", mean), ("median", median)):
        gap = np.asarray(cert.upper - cert.lower, np.float64) / LOG2E
        record[f"{label}_certified"] = float(cert.certified.mean())
        record[f"{label}_gap_nats_p50"] = float(np.median(gap))
        if row_max is not None:
          above = np.asarray(cert.lower, np.float64) > row_max + 1e-4 * (1 + np.abs(row_max))
          record[f"{label}_rows_with_lower_above_max"] = int(above.sum())
      record["seconds"] = time.time() - t0
      records.append(record)
      print(json.dumps(record), flush=True)
  with open(args.out, "w") as f:
    json.dump(dict(command="python3 notes/experiments/bidir_centre.py", date=str(datetime.date.today()),
                   device=f"CPU ({platform.processor() or platform.machine()}), {jax.device_count()} JAX devices",
                   jax=jax.__version__, records=records), f, indent=1)


if __name__ == "__main__":
  main()
