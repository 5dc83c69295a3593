"""Ops whose outputs selective activation checkpointing must always save, declared by the code that owns them.

Owns only the set. The attention package adds its kernel forwards when it is installed (`register_ffpa`,
`install_ring`, the `FFPAAttention` Callback); the SAC policy (`lightning_ffpa.parallel.checkpointing`) reads
it when a policy is built. Neither side imports the other: this file is what they share.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["register", "registered"]

_ops: set = set()


def register(ops: Iterable) -> None:
    """Declare `ops` (OpOverloads) must-save for every SAC policy built from now on (register before
    `parallelize` / `FSDP2Strategy.setup` wraps the layers)."""
    _ops.update(ops)


def registered() -> frozenset:
    """The ops declared so far."""
    return frozenset(_ops)
