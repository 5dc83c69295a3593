"""Lightning Callbacks: attention backend by CP size, throughput/MFU, non-finite guard, SLURM requeue and SIGTERM
at a step boundary, rollouts."""

from lightning_ffpa.callbacks.attention import FFPAAttention
from lightning_ffpa.callbacks.lr_monitor import StepLearningRateMonitor
from lightning_ffpa.callbacks.nonfinite import NonFiniteGuard
from lightning_ffpa.callbacks.preemption import DeferredRequeue, StopOnSigterm
from lightning_ffpa.callbacks.throughput import TokenThroughput

__all__ = ["DeferredRequeue", "FFPAAttention", "NonFiniteGuard", "StepLearningRateMonitor", "StopOnSigterm", "TokenThroughput"]
