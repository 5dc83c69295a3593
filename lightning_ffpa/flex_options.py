"""Flex attention kernel options: one table keyed by (head_dim, phase, dtype), read by training and rollouts.

Flex's default Triton tiles at head_dim > 256 (64x32 for bf16, 3 pipeline stages) need more shared memory
than an H200 has (DESIGN.md), so large head dims keep the tiles and run one stage; fp32 halves the tiles
(twice the bytes per element). The phases:
- `train`: the forward and backward of a training step (`fwd_*` / `bwd_*` keys, `attention/flex.py`, the ring),
  always on the main Triton kernel (`BACKEND`);
- `prefill` / `decode`: the paged rollout engine (`rollout/attention.py`, which also fits BLOCK_N to the page
  size and applies user overrides).
Decode sets at 256 and 512 are the fastest of the sweep in `benchmarks/rollout_attention.py` (its result file:
`benchmarks/results/rollout_attention.json`), each checked against the dense reference on scrambled pages.
Does not own when flex runs, the override store, nor the checks of user-given options.
"""

from __future__ import annotations

from typing import Any, Literal

import torch

__all__ = ["LARGE_HEAD_DIM_CANDIDATES", "PHASES", "Phase", "flex_kernel_options"]

Phase = Literal["train", "prefill", "decode"]
PHASES = ("train", "prefill", "decode")

# Torch's per-arch defaults fit head dims up to this one (decode sets above are tuned, not needed to fit).
_DEFAULTS_FIT = 256
# One-stage forward tile for large head dims (bf16/fp16); fp32 halves the BLOCK sizes.
_LARGE_FORWARD = {"BLOCK_M": 64, "BLOCK_N": 32, "num_stages": 1, "num_warps": 4}

# Training candidates for large head dims, in no order of speed (the benchmarks time all of them and use
# the fastest as the Flex baseline). Backward tiles keep BLOCK_N1 % BLOCK_M1 == 0 and BLOCK_M2 % BLOCK_N2 == 0
# (torch's backward config rule). The first is the forward tile above plus its backward.
LARGE_HEAD_DIM_CANDIDATES: tuple[dict[str, int], ...] = (
    {**{f"fwd_{k}": v for k, v in _LARGE_FORWARD.items()},
     "bwd_BLOCK_M1": 32, "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 32,
     "bwd_num_stages": 1, "bwd_num_warps": 4},
    {"fwd_BLOCK_M": 64, "fwd_BLOCK_N": 64, "fwd_num_stages": 1, "fwd_num_warps": 8,
     "bwd_BLOCK_M1": 32, "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 32,
     "bwd_num_stages": 1, "bwd_num_warps": 8},
    {"fwd_BLOCK_M": 32, "fwd_BLOCK_N": 32, "fwd_num_stages": 1, "fwd_num_warps": 4,
     "bwd_BLOCK_M1": 32, "bwd_BLOCK_N1": 32, "bwd_BLOCK_M2": 32, "bwd_BLOCK_N2": 32,
     "bwd_num_stages": 1, "bwd_num_warps": 4},
)

# Decode in bf16/fp16. USE_TMA gained under 1% in the sweep and needs sm90, so it stays out.
_DECODE_HALF = {256: {"BLOCK_N": 64, "num_stages": 2, "num_warps": 4},
                512: {"BLOCK_N": 16, "num_stages": 3, "num_warps": 4}}


_TRAIN_BACKEND = {"BACKEND": "TRITON"}


def _halve_blocks(options: dict[str, int]) -> dict[str, int]:
    return {k: max(16, v // 2) if "BLOCK" in k else v for k, v in options.items()}


def flex_kernel_options(head_dim: int, phase: Phase, dtype: torch.dtype = torch.bfloat16) -> dict[str, Any] | None:
    """The shipped flex kernel options for one head_dim, phase and dtype (None: torch's defaults)."""
    if phase not in PHASES:
        raise ValueError(f"`phase={phase!r}` is not one of {PHASES}")
    wide = dtype == torch.float32
    if phase == "decode" and not wide and head_dim in _DECODE_HALF:
        return dict(_DECODE_HALF[head_dim])
    if phase == "train":
        # Training always takes the main Triton kernel: for queries under 128 tokens AUTO picks the decode
        # kernel, which found no valid config at a 77-token document on an H200 (NoValidChoicesError, torch 2.11).
        if head_dim <= _DEFAULTS_FIT:
            return dict(_TRAIN_BACKEND)
        train = dict(LARGE_HEAD_DIM_CANDIDATES[0])
        return {**_TRAIN_BACKEND, **(_halve_blocks(train) if wide else train)}
    if head_dim <= _DEFAULTS_FIT:
        return None
    if phase == "decode":  # one stage fits; fp32 also needs BLOCK_N=16
        return {"num_stages": 1, "BLOCK_N": 16} if wide else {"num_stages": 1}
    return _halve_blocks(_LARGE_FORWARD) if wide else dict(_LARGE_FORWARD)
