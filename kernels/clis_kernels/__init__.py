"""clis_kernels: CLiS attention (certified loop-invariant stabilization) for JAX."""

from clis_kernels.api import AttentionStats, attention
from clis_kernels.masks import SegmentIds
from clis_kernels.stabilizer import Certificate, certify

__all__ = ["attention", "AttentionStats", "Certificate", "SegmentIds", "certify"]
