"""Diffusion inference: bidirectional CLiS attention with LiteAttention-style temporal tile skipping."""

from clis_kernels.diffusion import context_parallel
from clis_kernels.diffusion.skipping import (SkipState, SkipStats, attention, calibrate_thr, init_state,
                                             threshold_schedule, tiles)

__all__ = ["SkipState", "SkipStats", "attention", "calibrate_thr", "context_parallel", "init_state",
           "threshold_schedule", "tiles"]
