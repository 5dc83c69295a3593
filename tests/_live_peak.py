"""A dispatch mode that counts the most bytes of live tensors an op sequence made (tests of memory bounds)."""

from __future__ import annotations

import weakref

import torch


class LivePeak(torch.utils._python_dispatch.TorchDispatchMode):
    """The most bytes, after any op, of the storages the ops made (`exclude`'s aside) that are still referenced."""

    def __init__(self, exclude=()):
        super().__init__()
        self.refs, self.peak = [], 0
        self.exclude = {t.untyped_storage().data_ptr() for t in exclude}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in self.exclude:
                self.refs.append((weakref.ref(t), t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()))
        self.refs = [r for r in self.refs if r[0]() is not None]
        self.peak = max(self.peak, sum({ptr: n for _, ptr, n in self.refs}.values()))
        return out
