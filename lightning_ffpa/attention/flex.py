"""Flex attention as the sliding-window path and fallback: kernel options per head_dim, compiled on GPU.

Flex's default Triton options fail at head_dim 512 on an H200: the forward default (BLOCK_M=64,
BLOCK_N=32, 3 stages) needs ~256 KB of shared memory against a 227 KB limit. Single-stage tiles of
32-64 fit (DESIGN.md). This file owns those options and the one compiled flex callable; it does
not decide when flex runs (``backend.py`` does).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from lightning_ffpa._compat import torch as torch_compat

# Candidate option sets for large head dims, best-first by the last recorded H200 run
# (benchmarks/attention.py times all of them and reports the best as the Flex baseline).
# Backward tiles keep BLOCK_N1 % BLOCK_M1 == 0 and BLOCK_M2 % BLOCK_N2 == 0 (torch's bwd config rule).
LARGE_HEAD_DIM_CANDIDATES: tuple[dict[str, int], ...] = (
    {"fwd_BLOCK_M": 64, "fwd_BLOCK_N": 32, "fwd_num_stages": 1, "fwd_num_warps": 4,
     "bwd_BLOCK_M1": 32, "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 32,
     "bwd_num_stages": 1, "bwd_num_warps": 4},
    {"fwd_BLOCK_M": 64, "fwd_BLOCK_N": 64, "fwd_num_stages": 1, "fwd_num_warps": 8,
     "bwd_BLOCK_M1": 32, "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 32,
     "bwd_num_stages": 1, "bwd_num_warps": 8},
    {"fwd_BLOCK_M": 32, "fwd_BLOCK_N": 32, "fwd_num_stages": 1, "fwd_num_warps": 4,
     "bwd_BLOCK_M1": 32, "bwd_BLOCK_N1": 32, "bwd_BLOCK_M2": 32, "bwd_BLOCK_N2": 32,
     "bwd_num_stages": 1, "bwd_num_warps": 4},
)


def kernel_options(head_dim: int, dtype: torch.dtype = torch.bfloat16) -> dict[str, int] | None:
    """Flex kernel options that fit H200 shared memory for this head_dim (None: torch's defaults)."""
    if head_dim <= 256:
        return None  # torch's per-arch defaults cover these
    opts = dict(LARGE_HEAD_DIM_CANDIDATES[0])
    if dtype == torch.float32:  # twice the bytes per element: halve the tiles
        opts.update({k: max(16, v // 2) for k, v in opts.items() if "BLOCK" in k})
    return opts


@functools.cache
def _compiled_flex():
    # Static shapes: with automatic dynamic shapes inductor finds no flex template for a symbolic sequence
    # length at small head dims (NoValidChoicesError on an H200, torch 2.11); a shape recompiles instead.
    return torch.compile(flex_attention, dynamic=False)


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
    if torch_compat.dispatch_mode_active():
        # An eager activation-checkpoint region (SAC's caching mode, or its replay during backward) or a
        # user's TorchDispatchMode: dynamo cannot trace a dispatch mode (gb0008), so the compiled kernel
        # runs with the modes set aside. SAC then does not see this call and replays it in backward like
        # any PREFER_RECOMPUTE op; the FFPA forwards stay must-save.
        with torch_compat.without_dispatch_modes():
            return _compiled_flex()(query, key, value, block_mask=block_mask, scale=scale, enable_gqa=gqa,
                                    kernel_options=options)
    return _compiled_flex()(query, key, value, block_mask=block_mask, scale=scale, enable_gqa=gqa,
                            kernel_options=options)

