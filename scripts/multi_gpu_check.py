"""Several devices: the same training run on 1 device, a 2-way data mesh and a 2-way tensor mesh.

Every layout trains from the same initial weights on the same batches with the same global
batch, so the losses must agree step for step (up to reduction order in bf16); tokens/s and
scaling efficiency (1-device step time / (devices × step time)) come from the steps after the
first two. With --attentions clis online the 1-device layout runs both, which also gives the
clis/online training-throughput ratio. Writes JSON records plus a markdown table and a plot.

  python scripts/multi_gpu_check.py recipes/cpt.yaml --steps 20 --out benchmarks/results/x.json
  python scripts/multi_gpu_check.py recipes/cpt_tiny.yaml --steps 3 model.preset=tiny ...   # CPU smoke run
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import numpy as np

from clis_train import benchmarking
from clis_train import data, model
from clis_train.config import load_config
from clis_train.train import Trainer, peak_flops_per_device

# name -> (mesh overrides, per-device batch factor): the global batch is per_device_batch × devices.
LAYOUTS = {
    "1dev": (["mesh.data=1", "mesh.fsdp=1", "mesh.tensor=1"], 2),
    "data2": (["mesh.data=2", "mesh.fsdp=1", "mesh.tensor=1"], 1),
    "tensor2": (["mesh.data=1", "mesh.fsdp=1", "mesh.tensor=2"], 1),
}


def run_layout(recipe, overrides, layout, attention, steps, batch):
  mesh_overrides, factor = LAYOUTS[layout]
  cfg = load_config(recipe, [*overrides, *mesh_overrides, f"data.per_device_batch={batch * factor}",
                             f"attention={attention}", "train.progress_bar=false"])
  t = Trainer(cfg)
  examples = data.build_examples(cfg.data, t.tokenizer)
  batches = data.packed_batches(examples.train, seq_len=cfg.data.seq_len, batch_size=t.global_batch, seed=cfg.seed,
                                packing_bins=cfg.data.packing_bins)
  state = t.init_state(jax.random.PRNGKey(cfg.seed))
  losses, times = [], []
  for _ in range(steps):
    b = jax.device_put(next(batches), t.batch_sharding)
    t0 = time.perf_counter()
    state, metrics = t.train_step(state, b)
    losses.append(float(jax.block_until_ready(metrics)["loss"]))
    times.append(time.perf_counter() - t0)
  timed = times[2:] if len(times) > 2 else times
  med = statistics.median(timed)
  tokens = t.global_batch * cfg.data.seq_len
  peak = peak_flops_per_device(cfg)
  mfu = None if peak is None else model.flops_per_token(t.dims, cfg.data.seq_len) * tokens / med / (peak * t.mesh.size)
  return dict(case=f"{cfg.model.preset}_S{cfg.data.seq_len}", impl=f"{attention}|{layout}", attention=attention,
              layout=layout, mesh=dict(t.mesh.shape), devices=t.mesh.size, **{"pass": "train_step"},
              ms=med * 1e3, ms_min=min(timed) * 1e3, ms_max=max(timed) * 1e3, tokens_per_s=tokens / med, mfu=mfu,
              B=t.global_batch, S=cfg.data.seq_len, Hq=t.dims.n_heads, Hkv=t.dims.n_kv_heads, D=t.dims.head_dim,
              causal=True, losses=losses, repeat=len(timed), **benchmarking.device_meta())


def main():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("recipe")
  p.add_argument("overrides", nargs="*")
  p.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
  p.add_argument("--attentions", nargs="+", default=["clis", "online"],
                 help="all run on 1dev; the first also on the other layouts")
  p.add_argument("--steps", type=int, default=20)
  p.add_argument("--batch", type=int, default=1, help="per-device batch of the 2-device layouts")
  p.add_argument("--out", default=None)
  args = p.parse_intermixed_args()
  records = []
  out = args.out
  for layout in args.layouts:
    for attention in (args.attentions if layout == "1dev" else args.attentions[:1]):
      rec = run_layout(args.recipe, args.overrides, layout, attention, args.steps, args.batch)
      records.append(rec)
      print(f"{rec['impl']:16s} {rec['ms']:8.1f} ms/step {rec['tokens_per_s']:9.0f} tok/s  losses "
            f"{' '.join(f'{x:.4f}' for x in rec['losses'])}", flush=True)
      out = out or benchmarking.default_output(f"multi_gpu_{records[0]['case']}")
      benchmarking.write_report(records, out, value="tokens_per_s")  # after every layout: a cut-off run keeps its data
  first = args.attentions[0]
  base = next((r for r in records if r["impl"] == f"{first}|1dev"), None)
  for r in records:
    if base is not None and r["attention"] == first:
      diff = np.abs(np.array(r["losses"]) - np.array(base["losses"]))
      r["max_abs_loss_diff_vs_1dev"] = float(diff.max())
      r["scaling_efficiency"] = base["ms"] / (r["devices"] * r["ms"]) if r["devices"] > 1 else 1.0
    online = next((o for o in records if o["impl"] == "online|1dev"), None)
    if online is not None and r["layout"] == "1dev":
      r["speedup_vs_online"] = r["tokens_per_s"] / online["tokens_per_s"]
    print(f"{r['impl']:16s} max |loss - 1dev| {r.get('max_abs_loss_diff_vs_1dev')}  "
          f"scaling {r.get('scaling_efficiency')}  vs online {r.get('speedup_vs_online')}", flush=True)
  benchmarking.write_report(records, out, value="tokens_per_s")
  print("wrote", out)


if __name__ == "__main__":
  main()
