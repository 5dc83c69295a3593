"""Attention for Gemma4: FFPA kernels (kernels.py), the "ffpa" HF backend (backend.py), masks and flex options."""

from lightning_ffpa.attention.backend import (
    FFPABackendConfig,
    FFPAFallbackWarning,
    dispatch_counts,
    fallback_counts,
    register_ffpa,
    reset_dispatch_counts,
)
from lightning_ffpa.attention.kernels import active_kernel, force_kernel, kernel_counts

__all__ = [
    "FFPABackendConfig",
    "FFPAFallbackWarning",
    "active_kernel",
    "dispatch_counts",
    "fallback_counts",
    "force_kernel",
    "kernel_counts",
    "register_ffpa",
    "reset_dispatch_counts",
]
