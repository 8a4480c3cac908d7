"""The Mosaic GPU kernel's in-kernel certificate flags (KEYS mode) against the XLA certificate on the same
inputs, over lengths that do and do not fill whole 128-row blocks, head dims, group sizes and tau; with the
output error of clis and online against float64. A sink key (norm 1e3) sits at 1.25 tiles.

  python3 notes/experiments/mgpu_flags_diag.py
"""

import jax
import jax.numpy as jnp
import numpy as np

from clis_kernels import attention, stabilizer
from clis_kernels import reference_f64 as ref
from clis_kernels.testing import random_inputs

for seq, d, hq, hkv in [(192, 64, 2, 1), (256, 64, 2, 1), (192, 128, 2, 1), (192, 64, 4, 1), (320, 64, 2, 1),
                        (1024, 64, 2, 1), (1024, 128, 4, 1)]:
  for tau in (64.0, 128.0):
    q, k, v, do = random_inputs(1, 1, seq, hq, hkv, d, jnp.bfloat16)
    sink = 80
    norm = jnp.linalg.norm(k[:, sink].astype(jnp.float32), axis=-1, keepdims=True)
    k = k.at[:, sink].set((1e3 * k[:, sink] / norm).astype(k.dtype))
    out, stats = attention(q, k, v, causal=True, implementation="pallas_mgpu", tau=tau, return_stats=True)
    padded = -(-seq // 64) * 64
    pad = lambda x: jnp.pad(x, ((0, 0), (0, padded - seq), (0, 0), (0, 0)))
    cert = stabilizer.certify(pad(q), pad(k), pad(v), None, causal=True, scale=d ** -0.5, tau=tau, granularity="tile",
                              block_q=64, seq_len=seq)
    online = attention(q, k, v, causal=True, implementation="pallas_mgpu", stabilizer="online")
    want = ref.attention(q, k, v, do, causal=True)[0]
    kernel, xla = np.asarray(stats.certified_tiles)[0], np.asarray(cert.certified)[0]
    print(f"S={seq} D={d} Hq={hq} tau={tau}: kernel {kernel.astype(int).tolist()} xla {xla.astype(int).tolist()} "
          f"err clis {ref.rel_err(out, want):.2e} online {ref.rel_err(online, want):.2e}", flush=True)
