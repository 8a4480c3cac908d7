"""The Mosaic GPU certified loop's normaliser: l summed from the unrounded weights (exact_sum=False), from the
weights as rounded for P·V on the vector units after the softmax hands the tensor cores over (the default), or
as a second wgmma P·ones (sum_on_tensor_cores=True).
Accuracy against float64 on the real-activation sample (tests/data) and on pretrained-like families, and
forward time against the online loop (interleaved medians, ms), GQA 32/8, D 128, B x S = 32k tokens.
With --softcap C the calls carry logits_soft_cap=C, the certified loop takes the cap's own bound (bound="cap"),
and tokamax's Mosaic GPU forward joins both parts (it runs a capped call with no running max and divides by the
unrounded sum: the unrounded normaliser's algorithm), where it is installed.

  python3 notes/experiments/mgpu_exact_sum.py --out $OUT/mgpu_exact_sum.json
  python3 notes/experiments/mgpu_exact_sum.py --softcap 50 --families sinks_many --out $OUT/cap_normaliser.json
"""

import argparse
import json
import pathlib

import jax
import jax.numpy as jnp

from clis_train import benchmarking
from clis_kernels import attention, pallas_mgpu, testing
from clis_kernels import reference_f64 as ref

REAL_SAMPLE = pathlib.Path(__file__).parents[2] / "tests" / "data" / "real_small_qkv.safetensors"  # data, not code
SUMS = {"unrounded": pallas_mgpu.BlockSizes(exact_sum=False), "exact": pallas_mgpu.BlockSizes(exact_sum=True),
        "tensor_cores": pallas_mgpu.BlockSizes(sum_on_tensor_cores=True)}


def tokamax_forward(softcap):
  """tokamax's Mosaic GPU forward (q, k, v, seg, causal) -> o, or None where tokamax is not installed."""
  try:
    import tokamax  # optional
  except ImportError:
    return None
  return lambda q, k, v, seg, causal: tokamax.dot_product_attention(
      q, k, v, is_causal=causal, implementation="mosaic", logits_soft_cap=softcap)


def errors(q, k, v, do, seg, causal, softcap=None, f=None, **kw):
  """Relative errors of (o, dq, dk, dv) against float64; f: another forward (q, k, v, seg, causal) -> o."""
  if f is None:
    f = lambda q, k, v, seg, causal: attention(q, k, v, seg, causal=causal, implementation="pallas_mgpu",
                                               **({} if softcap is None else dict(logits_soft_cap=softcap)), **kw)
  out, vjp = jax.vjp(lambda q, k, v: f(q, k, v, seg, causal), q, k, v)
  want = ref.attention(q, k, v, do, seg, causal=causal, softcap=softcap)
  return [ref.rel_err(g, w) for g, w in zip((out, *vjp(do)), want)]


def accuracy(seq: int, families: list[str], softcap=None):
  """Real activations (256 tokens of three trained layers) and pretrained-like families at `seq` (the float64
  reference is the slow part: 2048 with three families ran past a 400 s call)."""
  from safetensors.numpy import load_file
  tensors = load_file(str(REAL_SAMPLE))

  def real_activations(layer, seq=256, kv_heads=2):  # the first `seq` tokens, GQA 3 as trained, a random cotangent
    cut = lambda name, heads: jnp.asarray(tensors[f"layer_{layer}.{name}"][:, :seq, :heads], jnp.bfloat16)
    q, k, v = cut("q", 3 * kv_heads), cut("k", kv_heads), cut("v", kv_heads)
    return q, k, v, jax.random.normal(jax.random.PRNGKey(layer), q.shape, jnp.bfloat16)

  records = []
  cases = [(f"real_layer{layer}", real_activations(layer) + (None,), True) for layer in (1, 6, 11)]
  for family in families:
    for causal in (True, False):
      if family == "packed_sinks" and not causal:
        continue
      cases.append((f"{family}_{'causal' if causal else 'bidir'}", testing.inputs(family, 1, seq, 8, 2, 128), causal))
  tokamax = tokamax_forward(softcap)
  for name, (q, k, v, do, seg), causal in cases:
    row = dict(case=name, online=errors(q, k, v, do, seg, causal, softcap, stabilizer="online"))
    for bound in ("radius", "blocks") if softcap is None else ("cap",):
      for label, bs in SUMS.items():
        row[f"{bound}_{label}"] = errors(q, k, v, do, seg, causal, softcap, bound=bound, block_sizes=bs)
    if tokamax is not None and softcap is not None and seg is None:
      row["tokamax"] = errors(q, k, v, do, seg, causal, softcap, f=tokamax)
    row["worst_ratio"] = {key: max(e / o for e, o in zip(row[key], row["online"])) for key in row
                          if key not in ("case", "online")}
    print(row["case"], {k: round(v, 3) for k, v in row["worst_ratio"].items()}, flush=True)
    records.append(row)
  return records


def speed(softcap=None):
  records = []
  cases = [(8192, True, "gaussian", "radius"), (32768, True, "gaussian", "radius"),
           (32768, False, "gaussian", "radius"), (32768, True, "outlier_channels", "blocks"),
           (32768, False, "outlier_channels", "blocks")]
  if softcap is not None:
    cases = [(8192, True, "sinks_many", "cap"), (32768, True, "sinks_many", "cap")]
  cap = {} if softcap is None else dict(logits_soft_cap=softcap)
  tokamax = tokamax_forward(softcap)
  for s, causal, family, bound in cases:
    batch = 32768 // s
    if family == "gaussian":
      q, k, v, _ = testing.random_inputs(s, batch, s, 32, 8, 128, jnp.bfloat16)
    else:
      q, k, v, _, _ = testing.inputs(family, batch, s, 32, 8, 128)
    call = lambda **kw: jax.jit(lambda q, k, v: attention(q, k, v, causal=causal, implementation="pallas_mgpu",
                                                          bound=bound, **cap, **kw))
    fns = {"online": call(stabilizer="online")}
    fns.update({label: call(block_sizes=bs) for label, bs in SUMS.items()})
    if tokamax is not None and softcap is not None:
      fns["tokamax"] = jax.jit(lambda q, k, v: tokamax(q, k, v, None, causal))
    times = benchmarking.interleaved_medians({n: (lambda f=f: f(q, k, v)) for n, f in fns.items()}, repeats=9, inner=5)
    for name, (med, lo, hi) in times.items():
      records.append(dict(S=s, causal=causal, family=family, bound=bound, variant=name, ms=med, ms_min=lo, ms_max=hi,
                          vs_online=times["online"][0] / med))
      print(records[-1], flush=True)
  return records


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--parts", nargs="+", default=["accuracy", "speed"], choices=["accuracy", "speed"])
  parser.add_argument("--accuracy-seq", type=int, default=1024)
  parser.add_argument("--families", nargs="*", default=["outlier_channels", "packed_sinks"])
  parser.add_argument("--softcap", type=float, default=None, help="logits_soft_cap for every call (bound='cap')")
  parser.add_argument("--out", required=True)
  args = parser.parse_args()
  parts = {"accuracy": lambda: accuracy(args.accuracy_seq, args.families, args.softcap),
           "speed": lambda: speed(args.softcap)}
  result = dict(**{name: parts[name]() for name in args.parts}, **benchmarking.device_meta())
  json.dump(result, open(args.out, "w"), indent=1)


if __name__ == "__main__":
  main()
