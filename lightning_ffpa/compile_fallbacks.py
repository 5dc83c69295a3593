"""Functions that torch.compile gave up on (a recompile limit hit): counted and warned about, never silent.

Every compile of the product (decoder layers, the chunked loss, Flex, the rollout decode step) goes through
`prepare()`: it raises dynamo's per-function graph limit to 64 and starts the watch. Past a limit, dynamo
runs that function eagerly (unfused, slower) for the rest of the process and says so in one log line; here
that event becomes a count (`counts()`, logged by `FSDP2Strategy` as `compile/fallbacks`) and a
`CompileFallbackWarning` naming the function and what to do. Fullgraph compiles (Flex) raise instead.
"""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Callable

from lightning_ffpa._compat import torch as torch_compat

__all__ = ["CompileFallbackWarning", "counts", "prepare", "reset", "total"]

_counts: Counter[str] = Counter()
_raising: set[str] = set()  # fullgraph functions: past the limit they raise, they do not fall back


class CompileFallbackWarning(UserWarning):
    """torch.compile stopped compiling a function; it now runs eagerly."""


def _where(fn: Callable) -> str:
    code = fn.__code__  # as dynamo names a function in its warning
    return f"'{code.co_name}' ({code.co_filename}:{code.co_firstlineno})"


def _hit(function: str, limit: str) -> None:
    if function in _raising:
        return
    _counts[function] += 1
    warnings.warn(CompileFallbackWarning(
        f"torch.compile gave up on {function} past torch._dynamo.config.{limit} graphs: it runs eagerly "
        "(uncompiled, slower) for the rest of this process. Each distinct input shape compiles a new graph; "
        "bound the shapes (packing, `TextDataModule.pad_to_multiple_of`) or raise the limit."), stacklevel=2)


def prepare(fullgraph: Callable | None = None) -> None:
    """Call before each torch.compile of the product: raises the graph limit and watches for it being hit.

    `fullgraph`: the function about to be compiled with `fullgraph=True` (past the limit it raises, and dynamo's
    warning before that is not a fallback).
    """
    if fullgraph is not None:
        _raising.add(_where(fullgraph))
    torch_compat.raise_recompile_limit()
    torch_compat.on_recompile_limit_hit(_hit)


def counts() -> dict[str, int]:
    """Functions dynamo gave up compiling in this process (this rank), with how often each was reported."""
    return dict(_counts)


def total() -> int:
    """How many times dynamo gave up on a function in this process (this rank)."""
    return sum(_counts.values())


def reset() -> None:
    """Forget the counts (tests)."""
    _counts.clear()
