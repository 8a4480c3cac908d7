"""Measuring and reporting, shared by the scripts in scripts/ (variants interleaved and repeated,
spread reported: BENCHMARKS.md's rules).

`interleaved_samples` / `interleaved_medians` time several variants round-robin, each round starting one variant later
(A B C, B C A, C A B, …) so that no variant always runs first or always follows the same one; each
sample is `inner` back-to-back calls after a warm-up; they return each round's samples or the medians with their
spread. `paired_ratio` compares two variants round by round. `write_report` writes the JSON records plus a markdown
table and a PNG plot beside it.
"""

from __future__ import annotations

import datetime
import json
import pathlib
import statistics
import time
from typing import Callable

import jax


def round_orders(names: list[str], repeats: int) -> list[list[str]]:
  """The order of each round: round r starts at variant r mod n and wraps, so over n rounds every variant takes
  every position once: with one fixed order the first variant always followed the last one's kernel, a position
  effect that would fall on one variant's ratios only."""
  n = len(names)
  return [[names[(r + i) % n] for i in range(n)] for r in range(repeats)]


def interleaved_samples(fns: dict[str, Callable[[], object]], *, repeats: int, inner: int,
                        warmup: int = 3) -> dict[str, list[float]]:
  """{name: [ms of one call, per round]} of each zero-argument function, rounds in `round_orders`; entry r of every
  list comes from round r, so two variants' lists pair up round by round (`paired_ratio`)."""
  for fn in fns.values():
    for _ in range(warmup):
      jax.block_until_ready(fn())
  samples = {name: [] for name in fns}
  for order in round_orders(list(fns), repeats):
    for name in order:
      fn = fns[name]
      t0 = time.perf_counter()
      out = None
      for _ in range(inner):
        out = fn()
      jax.block_until_ready(out)
      samples[name].append((time.perf_counter() - t0) / inner * 1e3)
  return samples


def spread(samples: list[float]) -> tuple[float, float, float]:
  """(median, min, max) of one variant's samples: what every table reports."""
  return statistics.median(samples), min(samples), max(samples)


def interleaved_medians(fns: dict[str, Callable[[], object]], *, repeats: int, inner: int, warmup: int = 3):
  """{name: (median_ms, min_ms, max_ms)} of one call of each zero-argument function (`interleaved_samples`)."""
  samples = interleaved_samples(fns, repeats=repeats, inner=inner, warmup=warmup)
  return {name: spread(s) for name, s in samples.items()}


def paired_ratio(base_ms: list[float], ms: list[float]) -> tuple[float, float, float]:
  """Speed against a baseline timed in the same rounds: (median, min, max) over rounds of base_ms[r] / ms[r]. Drift
  that moves both variants of one round cancels, which a ratio of two medians does not."""
  if len(base_ms) != len(ms) or not ms:
    raise ValueError(f"paired_ratio needs samples from the same rounds: got {len(base_ms)} and {len(ms)}")
  return spread([b / m for b, m in zip(base_ms, ms)])


def device_meta() -> dict:
  return dict(device=jax.devices()[0].device_kind, jax_version=jax.__version__,
              date=datetime.date.today().isoformat())


def default_output(name: str, root: str = "benchmarks/results") -> str:
  device = jax.devices()[0].device_kind.replace("NVIDIA ", "").replace(" ", "_").lower()
  return str(pathlib.Path(root) / f"{datetime.date.today().isoformat()}-{device}-{name}.json")


def online_baseline(impl: str) -> str:
  """The implementation a ratio "vs online" divides by: the same backend's online loop."""
  return "online_mgpu" if "_mgpu" in impl else "online"


def markdown_table(records: list[dict], value: str = "tflops") -> str:
  """One row per (case, pass, impl): median ms, [min, max], the rate, and the speed against the same backend's
  online baseline (`online_baseline`): round by round where both records keep their samples (`paired_ratio`, shown
  with its [min, max]), else the ratio of the medians."""
  base = {(r["case"], r["pass"], r["impl"]): r for r in records if r["impl"] in ("online", "online_mgpu")}
  certified = any(r.get("certified") is not None for r in records)
  lines = [f"| case | pass | impl | ms | [min, max] | {value} | vs online |{' certified |' if certified else ''}",
           f"|---|---|---|---|---|---|---|{'---|' if certified else ''}"]
  for r in records:
    b = base.get((r["case"], r["pass"], online_baseline(r["impl"])))
    rate, cert = r.get(value), r.get("certified")
    if b is None:
      speed = "—"
    elif b.get("samples_ms") and len(b["samples_ms"]) == len(r.get("samples_ms") or ()):
      med, lo, hi = paired_ratio(b["samples_ms"], r["samples_ms"])
      speed = f"{med:.3f}× [{lo:.3f}, {hi:.3f}]"
    else:
      speed = f"{b['ms'] / r['ms']:.3f}×"
    lines.append(f"| {r['case']} | {r['pass']} | {r['impl']} | {r['ms']:.3f} | [{r['ms_min']:.3f}, {r['ms_max']:.3f}] "
                 f"| {'—' if rate is None else f'{rate:.4g}'} | {speed} |"
                 + ((" — |" if cert is None else f" {cert:.3f} |") if certified else ""))
  return "\n".join(lines) + "\n"


def save_figure(fig, path, meta: dict) -> None:
  """Titles a matplotlib figure with the run's device, JAX version and date, and writes it as PNG."""
  import matplotlib.pyplot as plt
  fig.suptitle(f"{meta.get('device', '')}, JAX {meta.get('jax_version', '')}, {meta.get('date', '')}", fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def plot(records: list[dict], path: pathlib.Path, value: str = "tflops") -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  groups = sorted({(r["case"], r["pass"]) for r in records})
  impls = sorted({r["impl"] for r in records if r.get(value) is not None})  # pre-pass rows have no rate
  fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(groups) * len(impls) / 2), 4))
  width = 0.8 / max(len(impls), 1)
  colours = plt.get_cmap("tab20" if len(impls) > 10 else "tab10").colors  # one colour per implementation
  for i, impl in enumerate(impls):
    ys = [next((r.get(value) or 0.0 for r in records if (r["case"], r["pass"]) == g and r["impl"] == impl), 0.0)
          for g in groups]
    ax.bar([g + i * width for g in range(len(groups))], ys, width, label=impl, color=colours[i % len(colours)])
  ax.set_xticks([g + 0.4 - width / 2 for g in range(len(groups))])
  ax.set_xticklabels([f"{c}\n{p}" for c, p in groups], fontsize=7)
  ax.set_ylabel(value)
  ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # outside: bars stay visible
  save_figure(fig, path, records[0])


def write_report(records: list[dict], out: str, value: str = "tflops", plotter=plot) -> None:
  """records -> out (.json), out with .md (table) and .png (plotter(records, path, value); the
  default: a bar per implementation and case)."""
  path = pathlib.Path(out)
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(records, indent=1))
  path.with_suffix(".md").write_text(markdown_table(records, value))
  plotter(records, path.with_suffix(".png"), value)
