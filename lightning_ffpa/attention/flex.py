"""Flex attention as the sliding-window path and fallback of training: the one compiled flex callable.

Owns how flex is called (compiled on CUDA with the training kernel options, eager elsewhere, outside dispatch
modes) and the registry's "flex" entry (block masks of any shape: training's sliding layers, the CP ring's
baseline block ops, the rollout engine's paged attention). Does not own the kernel options
(`lightning_ffpa.flex_options`, one table with the rollout engine's) nor when flex runs (``plan.py`` and
``backend.py`` decide).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from lightning_ffpa import compile_fallbacks
from lightning_ffpa._compat import torch as torch_compat
from lightning_ffpa.attention import registry
from lightning_ffpa.flex_options import LARGE_HEAD_DIM_CANDIDATES, flex_kernel_options

__all__ = ["LARGE_HEAD_DIM_CANDIDATES", "compiled_flex", "flex_forward", "kernel_options"]  # candidates: benchmarks/attention.py


def kernel_options(head_dim: int, dtype: torch.dtype = torch.bfloat16) -> dict[str, Any]:
    """Flex training options (forward + backward): the main Triton kernel, with tiles that fit H200 shared
    memory at this head_dim; the table is `lightning_ffpa.flex_options`."""
    return flex_kernel_options(head_dim, "train", dtype)


def _product_flex(*args: Any, **kwargs: Any) -> Any:
    # flex_attention's own signature, under the product's own code object: dynamo keeps one compile cache per
    # code object, so a compile of `flex_attention` itself elsewhere in the process (the user's, HF's flex
    # integration) neither fills this cache nor, past its recompile limit, switches this path to unfused eager.
    return flex_attention(*args, **kwargs)


@functools.cache
def compiled_flex(backend: str | Callable = "inductor") -> Callable:
    """The one compiled flex_attention of training, the CP ring and the rollout engine (same signature).

    Static shapes: with automatic dynamic shapes inductor finds no flex template for a symbolic sequence
    length at small head dims (NoValidChoicesError on an H200, torch 2.11); a shape recompiles instead.
    ``fullgraph``: past dynamo's recompile limit a call raises (naming ``torch._dynamo.config.recompile_limit``)
    instead of running flex unfused (the full score matrix, no fused kernel).
    ``backend`` is for tests.
    """
    compile_fallbacks.prepare(fullgraph=_product_flex)
    return torch.compile(_product_flex, backend=backend, dynamic=False, fullgraph=True)


def flex_forward(query: Tensor, key: Tensor, value: Tensor, block_mask: BlockMask, scale: float,
                 options: dict[str, int] | None = None) -> Tensor:
    """flex_attention on ``[B,H,S,D]`` with GQA; compiled with per-head_dim options on CUDA, eager elsewhere."""
    gqa = query.shape[1] != key.shape[1]
    cuda = query.device.type == "cuda"
    if options is None and cuda:
        options = kernel_options(query.shape[-1], query.dtype)
    if torch.compiler.is_compiling() or not cuda:
        # Inside a compiled layer dynamo inlines flex_attention into the layer's graph, kernel options
        # included, and inductor emits the fused kernel; calling the cached compiled callable instead
        # would make dynamo trace functools.cache and torch.compile, which breaks the layer's graph.
        # Eager on CPU is the unfused reference path: fine for tests, never used for speed.
        return flex_attention(query, key, value, block_mask=block_mask, scale=scale, enable_gqa=gqa,
                              kernel_options=options)
    # An eager activation-checkpoint region (SAC's caching mode, or its replay during backward) or a user's
    # TorchDispatchMode: dynamo cannot trace a dispatch mode (gb0008), so the compiled kernel runs with the modes
    # set aside. SAC then does not see this call and replays it in backward like any PREFER_RECOMPUTE op; the
    # FFPA forwards stay must-save.
    modes = torch_compat.without_dispatch_modes() if torch_compat.dispatch_mode_active() else contextlib.nullcontext()
    with modes:
        return compiled_flex()(query, key, value, block_mask=block_mask, scale=scale, enable_gqa=gqa,
                               kernel_options=options)


def _masked(compiled: bool) -> tuple[Callable, str]:
    return (compiled_flex(), "flex_compiled") if compiled else (flex_attention, "flex_eager")


registry.register(registry.Kernel(
    name="flex", head_dims=(1, 512), features=frozenset({"causal", "sliding_window", "gqa", "softcap", "block_mask",
                                                         "lse"}),
    masked=_masked, block_ops="flex",
    doc="torch's flex_attention over a BlockMask (compiled on CUDA; eager, forward-only, on CPU)"))
