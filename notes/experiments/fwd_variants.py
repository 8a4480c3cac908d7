"""H200 experiment: which parts of the CLiS forward cost time (notes/kernels.md, issue 4).

A trimmed copy of kernels/clis_kernels/pallas_gpu.py's forward (no segments, no block padding) with knobs:
  lsum:   how a certified row sums its weights: "roundtrip" (Σ f32(bf16(p)), committed),
          "f32" (Σ p, run 1), "mma" (Σ bf16(p) by the tensor core: p·ones[bk, 16]).
  cond:   True = certified/online lax.cond in one kernel (committed); False = fixed loop only.
  bk_fixed: block_k of the fixed loop (the online loop keeps block_k).
  bounds: "xla" (m and certificate from the XLA pre-pass) or "kernel" (U, L, M and the tile's
          certificate computed in the kernel prologue from K-only stats: centre, radius, headroom).
Times the kernel alone (pre-pass outside the timed call), the XLA pre-pass, and the K-only
stats, interleaved, and checks each variant's output against the committed kernel.

  python notes/experiments/fwd_variants.py --out $OUT/variants.json
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from clis_kernels import attention, masks, pallas_gpu, stabilizer
from clis_kernels.plan import Mode
from clis_kernels.stabilizer import LOG2E, NEG
from clis_train import benchmarking


def key_stats(k, v, *, causal, seq_len, tau=64.0):
  """K/V-only part of the pre-pass: centre [B, Hkv, D], radius [B, Hkv, S], (h, threshold) [B, Hkv, 2]."""
  kf = k.astype(jnp.float32)
  first = kf.mean(1, keepdims=True)
  dist = jnp.linalg.norm(kf - first, axis=-1, keepdims=True)
  inlier = dist <= 4.0 * dist.mean(1, keepdims=True)
  centre = jnp.where(inlier, kf, 0).sum(1, keepdims=True) / jnp.maximum(inlier.sum(1, keepdims=True), 1)
  dev = jnp.linalg.norm(kf - centre, axis=-1)  # [B, S, Hkv]
  radius = lax.cummax(dev, axis=1) if causal else jnp.broadcast_to(dev.max(1, keepdims=True), dev.shape)
  headroom, floor = stabilizer.headroom_and_floor(v, segment_ids=None, seq_len=seq_len)
  thr = jnp.minimum(tau * LOG2E, headroom + floor)
  return centre[:, 0], radius.transpose(0, 2, 1), jnp.stack([headroom, thr], -1)


def _kernel(q_ref, k_ref, v_ref, *refs, lsum, cond, bounds, causal, sigma2, bq, bk, bkf, nq):
  if bounds == "xla":
    m_ref, cert_ref, o_ref, lse_ref = refs
  else:
    c_ref, r_ref, h_ref, o_ref, lse_ref = refs
  pid = pl.program_id(0)
  q_block = nq - 1 - pid if causal else pid
  n_keys = k_ref.shape[0]
  q = q_ref[...]
  q_pos = q_block * bq + jnp.arange(bq)

  def scores(start, block, masked):
    k = k_ref[pl.ds(start * block, block), :]
    s = plgpu.dot(q, k, trans_b=True) * sigma2
    if masked and causal:
      mask = masks.visible(q_pos, start * block + jnp.arange(block), None, None, causal=causal, kv_len=None)
      s = jnp.where(mask, s, NEG)
    return s

  def pv(p, start, block):
    v = v_ref[pl.ds(start * block, block), :]
    return plgpu.dot(p.astype(v.dtype), v)

  def fixed_body(start, carry, masked):
    acc, m, l = carry
    p = jnp.exp2(scores(start, bkf, masked) - m[:, None])
    if lsum == "roundtrip":
      p = p.astype(v_ref.dtype).astype(jnp.float32)
      l = l + p.sum(axis=1)
    elif lsum == "f32":
      l = l + p.sum(axis=1)
    elif lsum == "bits":  # round p to bf16 in the f32 domain (RNE on the bits): PV and l see the same weights
      bits = lax.bitcast_convert_type(p, jnp.uint32)
      bits = (bits + (jnp.uint32(0x7FFF) + ((bits >> 16) & jnp.uint32(1)))) & jnp.uint32(0xFFFF0000)
      p = lax.bitcast_convert_type(bits, jnp.float32)
      l = l + p.sum(axis=1)
    else:  # mma: l is [bq, 16], every column Σ bf16(p)
      l = l + plgpu.dot(p.astype(v_ref.dtype), jnp.ones((bkf, 16), v_ref.dtype))
    return acc + pv(p, start, bkf), m, l

  def online_body(start, carry, masked):
    acc, m, l = carry
    s = scores(start, bk, masked)
    m_new = jnp.maximum(m, s.max(axis=1))
    alpha = jnp.exp2(m - m_new)
    p = jnp.exp2(s - m_new[:, None])
    return acc * alpha[:, None] + pv(p, start, bk), m_new, l * alpha + p.sum(axis=1)

  def run(body, m0, block, l0):
    nkv = n_keys // block
    if causal:
      full, total = masks.causal_kv_blocks(q_block, block_q=bq, block_k=block, num_kv_blocks=nkv, div=lax.div)
    else:
      full, total = nkv, nkv
    carry = (jnp.zeros(o_ref.shape, jnp.float32), m0, l0)
    carry = lax.fori_loop(0, full, functools.partial(body, masked=False), carry)
    return lax.fori_loop(full, total, functools.partial(body, masked=True), carry) if causal else carry

  l0 = jnp.zeros((bq, 16) if lsum == "mma" else (bq,), jnp.float32)

  def fixed(m0):
    acc, m, l = run(fixed_body, m0, bkf, l0)
    return acc, m, (l.sum(axis=1) * (1.0 / 16) if lsum == "mma" else l)

  online = lambda: run(online_body, jnp.full((bq,), NEG, jnp.float32), bk, jnp.zeros((bq,), jnp.float32))
  if bounds == "xla":
    m0, certified = m_ref[...], jnp.sum(cert_ref[...]) > 0
  else:
    qf = q.astype(jnp.float32)
    qc = jnp.sum(qf * c_ref[...][None, :], axis=1)
    upper = sigma2 * (qc + jnp.sqrt(jnp.sum(qf * qf, axis=1)) * r_ref[...])
    if causal:
      kd = k_ref[pl.ds(q_block * bq, bq), :].astype(jnp.float32)
      lower = sigma2 * jnp.sum(qf * kd, axis=1)
    else:
      lower = sigma2 * qc
    hv = h_ref[...]
    headroom, thr = jnp.sum(jnp.where(jnp.arange(2) == 0, hv, 0.0)), jnp.sum(jnp.where(jnp.arange(2) == 1, hv, 0.0))
    m0 = jnp.maximum(lower, upper - headroom)
    certified = jnp.sum((upper - lower > thr).astype(jnp.int32)) == 0
  if cond:
    acc, m, l = lax.cond(certified, lambda: fixed(m0), online)
  else:
    acc, m, l = fixed(m0)
  o_ref[...] = (acc / l[:, None]).astype(o_ref.dtype)
  lse_ref[...] = m + jnp.log2(l)


def forward(q, k, v, extra, *, causal, lsum, cond, bounds, bq, bk, bkf, warps, stages, interpret=False):
  b, s, hq, d = q.shape
  group = hq // k.shape[2]
  nq = s // bq
  qmap = (lambda i, b_, h: (b_, nq - 1 - i, h, 0)) if causal else (lambda i, b_, h: (b_, i, h, 0))
  rowmap = (lambda i, b_, h: (b_, h, nq - 1 - i)) if causal else (lambda i, b_, h: (b_, h, i))
  kvmap = lambda i, b_, h: (b_, 0, h // group, 0)
  specs = [pl.BlockSpec((None, bq, None, d), qmap), pl.BlockSpec((None, s, None, d), kvmap),
           pl.BlockSpec((None, s, None, d), kvmap)]
  if bounds == "xla":
    cert = extra
    specs += [pl.BlockSpec((None, None, bq), rowmap), pl.BlockSpec((None, None, 1), rowmap)]
    args = [cert.m, cert.certified.astype(jnp.int32)]
  else:
    centre, radius, hthr = extra
    krow = (lambda i, b_, h: (b_, h // group, nq - 1 - i)) if causal else (lambda i, b_, h: (b_, h // group, i))
    specs += [pl.BlockSpec((None, None, d), lambda i, b_, h: (b_, h // group, 0)),
              pl.BlockSpec((None, None, bq), krow), pl.BlockSpec((None, None, 2), lambda i, b_, h: (b_, h // group, 0))]
    args = [centre, radius, hthr]
  kernel = functools.partial(_kernel, lsum=lsum, cond=cond, bounds=bounds, causal=causal, sigma2=d ** -0.5 * LOG2E,
                             bq=bq, bk=bk, bkf=bkf, nq=nq)
  return pl.pallas_call(
      kernel, grid=(nq, b, hq), in_specs=specs,
      out_specs=[pl.BlockSpec((None, bq, None, d), qmap), pl.BlockSpec((None, None, bq), rowmap)],
      out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b, hq, s), jnp.float32)],
      compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=stages), name="variant", interpret=interpret,
  )(q, k, v, *args)[0]


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--out", required=True)
  p.add_argument("--repeats", type=int, default=15)
  p.add_argument("--inner", type=int, default=10)
  args = p.parse_args()
  meta = benchmarking.device_meta()
  records = []
  cases = [dict(case="causal_S8192", s=8192, hq=32, hkv=8, causal=True),
           dict(case="bidir_H12_S32768", s=32768, hq=12, hkv=12, causal=False)]
  for c in cases:
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    q = jax.random.normal(keys[0], (1, c["s"], c["hq"], 128), jnp.bfloat16)
    k = (jax.random.normal(keys[1], (1, c["s"], c["hkv"], 128)) + jax.random.normal(keys[3], (1, 1, c["hkv"], 128))
         ).astype(jnp.bfloat16)
    v = jax.random.normal(keys[2], (1, c["s"], c["hkv"], 128), jnp.bfloat16)
    causal = c["causal"]
    cert = jax.jit(functools.partial(stabilizer.certify, causal=causal, scale=128 ** -0.5, tau=64.0, granularity="tile",
                                     block_q=128, seq_len=c["s"]))(q, k, v, None)
    stats = jax.jit(functools.partial(key_stats, causal=causal, seq_len=c["s"]))(k, v)
    key_bounds = jax.jit(lambda k, v: stabilizer.key_bounds(k, v, None, causal=causal, tau=64.0, block_q=128,
                                                            seq_len=c["s"]))
    committed_keys = key_bounds(k, v)
    print(c["case"], "certified fraction", float(cert.certified.mean()), flush=True)
    ref = jax.jit(functools.partial(attention, causal=causal, stabilizer="online"))(q, k, v).astype(jnp.float32)
    fns = {
        "api_clis": functools.partial(jax.jit(functools.partial(attention, causal=causal)), q, k, v),
        "api_online": functools.partial(jax.jit(functools.partial(attention, causal=causal, stabilizer="online")), q, k, v),
        "prepass_key_bounds": functools.partial(key_bounds, k, v),
        "kernel_committed": functools.partial(jax.jit(lambda q, k, v, keys: pallas_gpu.forward(
            q, k, v, None, keys, mode=Mode.KEYS, causal=causal, scale=128 ** -0.5, kv_len=None,
            block_sizes=pallas_gpu.default_block_sizes(128, c["s"], q.dtype))[0]), q, k, v, committed_keys),
    }
    grid = []
    for lsum, bkf in itertools.product(["bits", "f32", "mma"], [64, 128]):
      grid.append(dict(lsum=lsum, cond=True, bounds="kernel", bk=128, bkf=bkf, warps=8, stages=3))
    for bk, (warps, stages) in itertools.product([64, 128], [(8, 3)]):
      # the online baseline tuned the same way: a certificate of all-False makes the kernel online only
      grid.append(dict(lsum="f32", cond=True, bounds="xla_none", bk=bk, bkf=64, warps=warps, stages=stages))
    none = dataclasses_replace_cert(cert)
    for g in grid:
      name = "|".join(f"{k_}={v_}" for k_, v_ in g.items())
      extra = {"xla": cert, "kernel": stats, "xla_none": none}[g["bounds"]]
      bounds = "xla" if g["bounds"] == "xla_none" else g["bounds"]
      fn = jax.jit(functools.partial(forward, causal=causal, bq=128, **{**g, "bounds": bounds}))
      try:
        out = fn(q, k, v, extra)
        err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref)))
      except Exception as e:  # a tile that does not fit shared memory, say
        print("FAILED", name, type(e).__name__, str(e)[:200], flush=True)
        continue
      fns[name] = functools.partial(fn, q, k, v, extra)
      records.append(dict(case=c["case"], impl=name, max_abs_diff_vs_online_api=err))
    timings = benchmarking.interleaved_medians(fns, repeats=args.repeats, inner=args.inner)
    by_name = {r["impl"]: r for r in records if r["case"] == c["case"]}
    for name, (med, lo, hi) in sorted(timings.items(), key=lambda t: t[1][0]):
      rec = by_name.get(name) or dict(case=c["case"], impl=name)
      rec.update(ms=med, ms_min=lo, ms_max=hi, **meta)
      if name not in by_name:
        records.append(rec)
      print(f"{c['case']:18s} {med:8.3f} [{lo:.3f}, {hi:.3f}] {name} err={rec.get('max_abs_diff_vs_online_api')}",
            flush=True)
  with open(args.out, "w") as f:
    json.dump(records, f, indent=1)


def dataclasses_replace_cert(cert):
  import dataclasses
  return dataclasses.replace(cert, certified=jnp.zeros_like(cert.certified))


if __name__ == "__main__":
  main()
