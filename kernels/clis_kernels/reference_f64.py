"""Dense float64 attention in NumPy, forward and gradients: the ground truth of the tests, notes and benchmarks."""

from __future__ import annotations

import numpy as np


def visible(s_q, s_k, segment_ids, causal, window=None):
  """[B, Sq, Sk] bool under the library's convention (segment id 0 = padding). segment_ids: one
  [B, S] array for queries and keys, or an object with .q [B, Sq] and .kv [B, Sk]."""
  mask = np.ones((1, s_q, s_k), bool)
  if causal:
    mask = mask & np.tril(np.ones((s_q, s_k), bool))[None]
  if window is not None:  # (left, right): query i sees keys i - left .. i + right
    offset = np.arange(s_k)[None, :] - np.arange(s_q)[:, None]
    mask = mask & ((offset >= -window[0]) & (offset <= window[1]))[None]
  if segment_ids is not None:
    q_ids = np.asarray(getattr(segment_ids, "q", segment_ids))
    kv_ids = np.asarray(getattr(segment_ids, "kv", segment_ids))
    mask = mask & (q_ids[:, :, None] == kv_ids[:, None, :]) & (kv_ids[:, None, :] != 0)
  return mask


def attention(q, k, v, do, segment_ids=None, *, causal, scale=None, window=None, softcap=None):
  """Returns (o, dq, dk, dv) in float64; rows with no visible key give 0. window: (left, right);
  softcap: c, logits c·tanh(s / c)."""
  q, k, v, do = (np.asarray(x, np.float64) for x in (q, k, v, do))
  scale = 1 / np.sqrt(q.shape[-1]) if scale is None else scale
  group = q.shape[2] // k.shape[2]
  kr, vr = np.repeat(k, group, 2), np.repeat(v, group, 2)
  mask = visible(q.shape[1], k.shape[1], segment_ids, causal, window)[:, None]
  raw = np.einsum("bqhd,bkhd->bhqk", q, kr) * scale
  s = raw if softcap is None else softcap * np.tanh(raw / softcap)
  s = np.where(mask, s, -np.inf)
  row_max = np.max(s, -1, keepdims=True)
  row_max = np.where(np.isfinite(row_max), row_max, 0.0)
  p = np.exp(s - row_max)
  denom = p.sum(-1, keepdims=True)
  p = np.where(denom > 0, p / np.where(denom > 0, denom, 1.0), 0.0)
  o = np.einsum("bhqk,bkhd->bqhd", p, vr)
  dv = np.einsum("bhqk,bqhd->bkhd", p, do)
  dp = np.einsum("bqhd,bkhd->bhqk", do, vr)
  delta = np.einsum("bqhd,bqhd->bhq", do, o)[..., None]
  ds = p * (dp - delta)
  if softcap is not None:
    ds = ds * (1 - np.tanh(raw / softcap) ** 2)
  dq = np.einsum("bhqk,bkhd->bqhd", ds, kr) * scale
  dk = np.einsum("bhqk,bqhd->bkhd", ds, q) * scale
  fold = lambda x: x.reshape(x.shape[0], x.shape[1], k.shape[2], group, x.shape[3]).sum(3)
  return o, dq, fold(dk), fold(dv)


def rel_err(got, want):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-300))


def max_abs_err(got, want):
  return float(np.max(np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64)), initial=0.0))
