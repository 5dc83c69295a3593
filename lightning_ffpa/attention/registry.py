"""The attention kernel registry: one entry per kernel, with its ops, what it takes and its FLOP formula.

Owns the table (`register`, `get`, `names`) and the `Kernel` record: a kernel's name, the head dims, dtypes and
features it takes (`FEATURES`), where it can run (`unavailable`), its FLOP formula, and the callables each
consumer reads:
- ``contract``: the op contract of ``kernels.py`` (dense/varlen forward returning lse, and a backward from a
  given, possibly merged, o/lse), whose forwards are torch custom ops SAC can save (``forward_ops``);
- ``block_ops``: how the CP ring runs its blocks with it (``lightning_ffpa.cp.ring.RingAttention(block_ops=name)``;
  named here, built by ``cp``: this package does not import it);
- ``masked``: a callable with ``flex_attention``'s signature (the rollout engine's paged attention);
- ``windowed``: differentiable causal sliding-window attention, dense and varlen (the HF backend's sliding layers).
Does not own the kernels (``kernels.py``: FFPA and the CPU reference of its contract; ``flex.py``; ``fa4.py``) nor
which kernel serves which layer (``plan.py`` decides once, ``backend.py`` routes each call). Entries are
registered by the modules that own them; importing ``lightning_ffpa.attention`` registers them all, so adding a
kernel adds an entry, not a branch in each consumer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

__all__ = ["FEATURES", "Contract", "Kernel", "Windowed", "attention_flops", "get", "names", "register"]

FEATURES = frozenset({"causal", "sliding_window", "gqa", "varlen", "softcap", "block_mask", "lse",
                      "merged_lse_backward"})


def attention_flops(batch: int, q_len: int, k_len: int, q_heads: int, head_dim: int) -> int:
    """Forward FLOPs of one attention call; the backward counts twice this.

    torch's SDPA convention (QK^T and PV, no discount for causal or window masks), so MFU compares across
    kernels and with the SDPA baselines.
    """
    return 4 * batch * q_heads * q_len * k_len * head_dim


@dataclass(frozen=True)
class Contract:
    """The op contract of ``kernels.py`` (layouts, bottom-right causal, lse, empty rows), as four callables."""

    dense_fwd: Callable
    """(q, k, v, scale, causal) -> (o [B,Sq,Hq,D], lse [B,Hq,Sq] fp32)."""
    dense_bwd: Callable
    """(do, q, k, v, o, lse, scale, causal) -> (dq, dk, dv), from a given (possibly merged) o and lse."""
    varlen_fwd: Callable
    """(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal) -> (o [Tq,Hq,D], lse [Hq,Tq] fp32)."""
    varlen_bwd: Callable
    """(do, q, k, v, o, lse, cu_q, cu_k, max_q, max_k, scale, causal) -> (dq, dk, dv)."""


@dataclass(frozen=True)
class Windowed:
    """Differentiable causal sliding-window attention (a key is seen when ``0 <= q - k < window``)."""

    dense: Callable
    """(q, k, v [B,S,H,D], scale, window) -> o [B,S,Hq,D]."""
    varlen: Callable
    """(q, k, v THD, cu_seqlens int32, max_seqlen, scale, window) -> o [T,Hq,D] (documents never see each other)."""


def _everywhere(device: torch.device | None) -> str:
    return ""


@dataclass(frozen=True)
class Kernel:
    """One attention kernel: what it takes, where it runs, and the ops each consumer calls."""

    name: str
    """Registry key (e.g. "ffpa", "flex", "fa4", "reference")."""
    head_dims: tuple[int, int]
    """Smallest and largest head_dim it takes (inclusive)."""
    features: frozenset[str]
    """What it supports, from `FEATURES`."""
    head_dim_multiple: int = 1
    """head_dim must be a multiple of this."""
    head_dim_rule: Callable[[int, torch.device | None], bool] | None = None
    """A further per-device head_dim rule (e.g. an architecture with fewer kernels), or None."""
    dtypes: tuple[torch.dtype, ...] | None = None
    """Activation dtypes it takes; None: any floating dtype."""
    unavailable: Callable[[torch.device | None], str] = _everywhere
    """Why it cannot run on a device ('' when it can); called with None for "this process's current device"."""
    flops: Callable[[int, int, int, int, int], int] = attention_flops
    """Forward FLOPs for (batch, q_len, k_len, q_heads, head_dim); the backward is twice that."""
    contract: Contract | None = None
    """The op contract, or None."""
    forward_ops: Callable[[], tuple] = tuple
    """The forward OpOverloads that SAC must save when this kernel runs (those that exist in this process)."""
    block_ops: str | None = None
    """How the CP ring runs one block with it: "contract" (the ring's `BlockOps` over `contract`), "flex" (BlockMask
    blocks, `cp.flex_blocks`), or None (not in the ring)."""
    masked: Callable[[bool], tuple[Callable, str]] | None = None
    """(compiled?) -> (a callable with flex_attention's signature, the path name it reports), or None."""
    windowed: Windowed | None = None
    """Causal sliding-window attention (the HF backend's sliding layers), or None."""
    doc: str = field(default="", compare=False)
    """One line for docs and errors."""

    def why_not(self, head_dim: int, dtype: torch.dtype | None = None, device: torch.device | None = None,
                needs: tuple[str, ...] = ()) -> str:
        """'' when this kernel takes the call, else the first short reason of 'unavailable: <why>' (cannot run on
        this device at all), 'head_dim', 'dtype' or 'feature:<x>'."""
        why = self.unavailable(device)
        if why:
            return f"unavailable: {why}"
        lo, hi = self.head_dims
        if not lo <= head_dim <= hi or head_dim % self.head_dim_multiple:
            return "head_dim"
        if self.head_dim_rule is not None and not self.head_dim_rule(head_dim, device):
            return "head_dim"
        if dtype is not None and self.dtypes is not None and dtype not in self.dtypes:
            return "dtype"
        missing = [f for f in needs if f not in self.features]
        return f"feature:{missing[0]}" if missing else ""


_table: dict[str, Kernel] = {}


def register(kernel: Kernel) -> Kernel:
    """Add (or replace, on re-import) one entry; unknown features are a bug in the entry."""
    unknown = set(kernel.features) - FEATURES
    if unknown:
        raise ValueError(f"kernel {kernel.name!r} declares unknown features {sorted(unknown)}")
    _table[kernel.name] = kernel
    return kernel


def get(name: str, role: str | None = None, option: str = "kernel") -> Kernel:
    """The entry `name`; with `role` ('contract', 'block_ops', 'masked', 'windowed'), one that provides it.

    An unknown name (or one without that role) raises ValueError naming `option` and the names that fit.
    """
    kernel = _table.get(name)
    if kernel is None or (role is not None and getattr(kernel, role) is None):
        raise ValueError(f"`{option}={name!r}`: expected one of {names(role)}")
    return kernel


def names(role: str | None = None) -> list[str]:
    """Registered names, sorted; with `role`, only those that provide it."""
    return sorted(n for n, k in _table.items() if role is None or getattr(k, role) is not None)
