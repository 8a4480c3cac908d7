"""bf16 error ratios clis/online (out, dq, dk, dv) vs float64 on the reference, 3 seeds per bf16 test case.

Run from the repository root: .venv/bin/python notes/accuracy_ratios.py (output: notes/accuracy_ratios.txt)."""
import jax, jax.numpy as jnp, numpy as np
from clis_kernels import reference_f64 as ref
from clis_kernels.testing import random_inputs, packed_segments, CASES
from clis_kernels import attention, reference
bs = reference.BlockSizes(32,16)
for case in CASES:
  name, batch, seq, hq, hkv, d, dtype, causal, packed = case
  if dtype != jnp.bfloat16: continue
  for seed in range(3):
    q, k, v, do = random_inputs(len(name)+seed, batch, seq, hq, hkv, d, dtype)
    seg = packed_segments(len(name)+seed, batch, seq) if packed else None
    want = ref.attention(q, k, v, do, seg, causal=causal)
    e={}
    for st in ('clis','online'):
      out, vjp = jax.vjp(lambda q,k,v: attention(q,k,v,seg,causal=causal,stabilizer=st,implementation='reference',block_sizes=bs), q,k,v)
      got=(out,*vjp(do)); e[st]=[ref.rel_err(g,w) for g,w in zip(got,want)]
    print(name, seed, ' '.join(f"{a/b:.3f}" for a,b in zip(e['clis'],e['online'])))
