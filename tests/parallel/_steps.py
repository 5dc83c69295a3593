"""Training steps for the parallel tests, counted: aten ops seen under a dispatch mode in one forward+backward,
and passes on the CPU reference kernels with their losses, gradients (under the names before wrapping) and
attention counters. The tests build, wrap and compile their own models; this module only runs and counts."""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_ffpa import attention


class OpCounter(TorchDispatchMode):
    """Counts the calls of `ops` that reach dispatch (a checkpoint's recompute included)."""

    def __init__(self, ops):
        super().__init__()
        self.ops, self.counts = ops, Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.ops:
            self.counts[func] += 1
        return func(*args, **(kwargs or {}))


def count_ops(model, ops=()) -> Counter:
    """One forward+backward of `model` on fixed (2, 24) ids; how often each of `ops` ran."""
    ids = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(1))
    with OpCounter(set(ops)) as counter:
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    return counter.counts


def plain_name(name: str) -> str:
    """A parameter's name without the compile and activation-checkpoint wrappers' parts."""
    return name.replace("._orig_mod", "").replace("._checkpoint_wrapped_module", "")


def run_steps(model, ids, steps: int):
    """`steps` forward+backward passes on the reference kernels: (losses, the last step's grads by plain name,
    dispatch counts, kernel counts)."""
    attention.reset_dispatch_counts()
    losses = []
    with attention.force_kernel("reference"):
        for _ in range(steps):
            model.zero_grad(set_to_none=True)
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
            losses.append(loss.detach())
    grads = {plain_name(n): p.grad for n, p in model.named_parameters()}
    return losses, grads, attention.dispatch_counts(), attention.kernel_counts()
