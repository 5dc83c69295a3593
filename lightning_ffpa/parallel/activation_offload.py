"""Activation offload: what autograd saves for backward goes to pinned host memory in forward and back in backward.

At full depth on one GPU the saved activations, not the weights, set the peak. With
`activation_checkpointing="full"` each decoder layer saves little more than its input, so moving those costs
one host copy each way per layer (the approach of Unsloth's offloaded checkpointing). Parameters are never
moved (FSDP2's gathered weights are saved by the matmuls that use them), nor tensors below `min_bytes`.

Owns the saved-tensor hooks and their counts; `FSDP2Strategy(activation_offload=True)` opens them around each
training step's forward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

__all__ = ["ActivationOffload"]


@dataclass
class ActivationOffload:
    """Saved-tensor hooks that move tensors on `device_type` to host memory (pinned when `pin_memory`)."""

    device_type: str = "cuda"
    pin_memory: bool = True
    min_bytes: int = 1 << 20
    stats: dict[str, int] = field(default_factory=lambda: dict(moved=0, moved_bytes=0, kept=0))

    def _pack(self, t: torch.Tensor):
        nbytes = t.numel() * t.element_size()
        if (isinstance(t, nn.Parameter) or t.device.type != self.device_type or nbytes < self.min_bytes
                or not t.is_contiguous() or t.is_sparse):
            self.stats["kept"] += 1
            return t
        host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=self.pin_memory)
        host.copy_(t, non_blocking=self.pin_memory)  # ordered on the current stream before any reuse of t's memory
        self.stats["moved"] += 1
        self.stats["moved_bytes"] += nbytes
        return t.device, host

    @staticmethod
    def _unpack(packed):
        if isinstance(packed, torch.Tensor):
            return packed
        device, host = packed
        # non_blocking from pinned memory: the host allocator keeps `host` until the copy is done
        return host.to(device, non_blocking=host.is_pinned())

    @contextlib.contextmanager
    def hooks(self) -> Iterator[None]:
        """Offload what is saved inside this context (backward may run after it closes)."""
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield

    def reset_stats(self) -> dict[str, int]:
        """The counts since the last reset (moved tensors, their bytes, tensors kept on the device)."""
        out, self.stats = self.stats, dict(moved=0, moved_bytes=0, kept=0)
        return out
