"""Lightning Callbacks: attention backend by CP size, throughput/MFU logging."""

from lightning_ffpa.callbacks.attention import FFPAAttention
from lightning_ffpa.callbacks.throughput import TokenThroughput

__all__ = ["FFPAAttention", "TokenThroughput"]
