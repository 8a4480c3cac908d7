"""Issue 17, compile time: how long tracing and lowering the 1B preset's gradient step for an H200 takes, per
attention value, measured on a machine without a GPU (the Python half of compilation: tracing, Pallas
lowering to Mosaic GPU / Triton, StableHLO). Also counts the kernels in the lowered module: the layers are a
Python loop, and before make_attention returned a jitted function each layer's attention was its own set of
custom calls (64 for 16 layers; now 4).

  python3 notes/experiments/compile_time_lowering.py --seq-len 8192 --layers 16
"""

import argparse
import json
import re
import time

import jax
import jax.numpy as jnp

from clis_kernels import plan
from clis_kernels.testing import lower_for_h200
from clis_train import attention, model


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--seq-len", type=int, default=8192)
  parser.add_argument("--layers", type=int, default=16)
  parser.add_argument("--attentions", nargs="+", default=["clis", "clis_mgpu", "dot_product", "cudnn"])
  args = parser.parse_args()
  import dataclasses
  dims = dataclasses.replace(model.PRESETS["1b"], n_layers=args.layers)
  tokens = jax.ShapeDtypeStruct((1, args.seq_len), jnp.int32)
  results = {}
  for name in args.attentions:
    attend = (lambda q, k, v, seg, *_, **__: (attention._cudnn(q, k, v, seg), jnp.zeros(()))) if name == "cudnn" else \
        attention.make_attention(name, None, platform=plan.HOPPER)
    net = model.Transformer(dims, attend, remat="full")
    params = jax.eval_shape(lambda t: net.init(jax.random.PRNGKey(0), t, t, t), tokens)

    def loss(params, tok):
      logits = net.apply(params, tok, jnp.broadcast_to(jnp.arange(tok.shape[1]), tok.shape), jnp.ones_like(tok))
      return jax.nn.log_softmax(logits).mean()

    t0 = time.perf_counter()
    text = lower_for_h200(jax.grad(loss), params, tokens)
    seconds = time.perf_counter() - t0
    kernels = {k: len(re.findall(pattern, text)) for k, pattern in
               (("mosaic_gpu", r"custom_call @mosaic_gpu"), ("triton", r"custom_call @__gpu\$xla\.gpu\.triton"),
                ("cudnn", r"custom_call @__cudnn"))}
    results[name] = dict(lower_s=round(seconds, 1), **kernels)
    print(name, results[name], flush=True)
  print(json.dumps(results))


if __name__ == "__main__":
  main()
