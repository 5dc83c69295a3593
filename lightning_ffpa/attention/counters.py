"""Dispatch counters (attention path, fallback reason, kernel; the FP8 frozen base's matmul path, `fp8_base.py`;
the experts' path with unmerged LoRA, `experts.py`)
that stay truthful under torch.compile.

Owns the counter storage, what one count means, and how a count is taken in eager and in compiled
code. It does not decide what to count: ``backend.py`` (paths, fallback reasons) and ``kernels.py``
(kernels) call ``count``.

What one count means: one attention call in a *forward* pass. The forward that activation
checkpointing re-runs during backward is not counted (it is the same call, and under SAC the saved
FFPA/flex/SDPA forward is not even executed again), so eager, SAC and compiled runs report the same
numbers for the same steps.

How it is taken:
- eager: a plain Python increment, skipped while autograd's backward is running (the recompute);
- compiled (dynamo tracing): the call becomes ``torch.ops.lightning_ffpa.count_dispatch``, an opaque
  op with no outputs that is marked side-effectful, so dynamo neither graph-breaks nor guards on
  counter values, DCE keeps it, and its Python body runs once per real forward at runtime.
  A Python ``+= 1`` here would instead become a trace-time constant that dynamo guards on, which
  recompiles the layer on every call, and
  ``warnings.warn`` would graph-break; ``reorderable_logging_functions`` calls are silently dropped
  inside the checkpoint higher-order op, so they are no alternative.
  (A CUDA-graph replay would skip the op's Python body; compiled layers here do not use CUDA graphs.)
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import torch
from torch import Tensor

from lightning_ffpa._compat.torch import in_backward

__all__ = ["TrainingCalls", "count", "counts", "on_first", "reset"]

GROUPS = ("path", "reason", "kernel", "fp8_base", "expert_lora")

_counts: dict[str, Counter] = {g: Counter() for g in GROUPS}
_first_hooks: dict[str, Callable[[str], None]] = {}


def _record(group: str, name: str) -> None:
    if in_backward():  # an AC recompute: the call was counted in forward
        return
    bucket = _counts[group]
    bucket[name] += 1
    hook = _first_hooks.get(group)
    if hook is not None and bucket[name] == 1:
        hook(name)


@torch.library.custom_op("lightning_ffpa::count_dispatch", mutates_args=())
def _count_dispatch(anchor: Tensor, group: str, name: str) -> None:
    """Runtime body of a count taken inside compiled code (`anchor` only orders it among the layer's ops)."""
    _record(group, name)


@_count_dispatch.register_fake
def _(anchor, group, name):
    return None


# No outputs: without this mark FX/AOT/inductor dead-code elimination drops the op (checked on torch 2.13:
# the count stays 0); torch._library.utils.is_impure reads this set in torch 2.11 and 2.13.
torch.fx.node.has_side_effect(torch.ops.lightning_ffpa.count_dispatch.default)


def count(group: str, name: str, anchor: Tensor) -> None:
    """Count one forward call of `name` in `group` (one of `GROUPS`); compile-safe."""
    if torch.compiler.is_compiling():
        torch.ops.lightning_ffpa.count_dispatch(anchor.detach(), group, name)
    else:
        _record(group, name)


def counts(group: str) -> dict[str, int]:
    """A copy of one group's counters."""
    return dict(_counts[group])


def on_first(group: str, hook: Callable[[str], None]) -> None:
    """Call `hook(name)` (at runtime, eager or compiled) the first time `name` is counted since `reset`."""
    _first_hooks[group] = hook


def reset(*groups: str) -> None:
    """Zero the given groups' counters, all groups if none given (re-arms their first-count hooks)."""
    for group in groups or GROUPS:
        _counts[group].clear()


class TrainingCalls:
    """A fit's training-forward calls out of counters that count every forward: the calls before the fit and those
    of its evaluation loops (the sanity check and validation, between `eval_start` and `eval_end`) are put aside.
    One bookkeeping for every writer of `attention/<path>`, so the key means the same whoever logs it."""

    def __init__(self, read: Callable[[], dict[str, int]]) -> None:
        self._read = read  # every call counted so far, by key
        self._aside: Counter = Counter()
        self._eval_start: Counter | None = None

    def start(self, counted_before: bool = True) -> None:
        """A fit begins: what was counted before it is not its training. `counted_before=False` where the caller has
        just zeroed the counters (and a source it reads, such as a previous ring's, is about to be replaced)."""
        self._aside, self._eval_start = Counter(self._read() if counted_before else {}), None

    def eval_start(self) -> None:
        self._eval_start = Counter(self._read())

    def eval_end(self) -> None:
        if self._eval_start is not None:
            self._aside.update(Counter(self._read()) - self._eval_start)
            self._eval_start = None

    def counts(self) -> dict[str, int]:
        """Training calls per key so far; keys with none left out (a 0 would read as a path that ran nothing)."""
        counts = Counter(self._read())
        counts.subtract(self._aside)
        return {k: v for k, v in counts.items() if v > 0}
