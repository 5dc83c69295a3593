"""Lightning Callbacks: attention backend by CP size, throughput/MFU, non-finite guard, SLURM requeue, rollouts."""

from lightning_ffpa.callbacks.attention import FFPAAttention
from lightning_ffpa.callbacks.nonfinite import NonFiniteGuard
from lightning_ffpa.callbacks.preemption import DeferredRequeue
from lightning_ffpa.callbacks.throughput import TokenThroughput

__all__ = ["DeferredRequeue", "FFPAAttention", "NonFiniteGuard", "TokenThroughput"]
