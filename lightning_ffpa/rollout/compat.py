"""Version shim for the rollout engine: every private or version-dependent torch/transformers surface.

Owns attention-backend registration, `BlockMask.from_kv_blocks` keyword drift, how an HF decoder layer
wants its cache/shared-KV arguments, and the dynamo recompile limit. Nothing else imports private APIs.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch.nn.attention.flex_attention import BlockMask

from lightning_ffpa.parallel._shim import raise_recompile_limit  # noqa: F401 - re-exported for the engine

# Read once at import: a compiled decode step traces `block_mask_from_kv_blocks`, and a plain module
# constant keeps inspect/functools.cache out of the traced code.
_HAS_COMPUTE_Q_BLOCKS = "compute_q_blocks" in inspect.signature(BlockMask.from_kv_blocks).parameters


def block_mask_from_kv_blocks(*args: Any, compute_q_blocks: bool = True, **kwargs: Any) -> BlockMask:
    """`BlockMask.from_kv_blocks`, dropping `compute_q_blocks` on torch versions without it."""
    if _HAS_COMPUTE_Q_BLOCKS:
        kwargs["compute_q_blocks"] = compute_q_blocks
    return BlockMask.from_kv_blocks(*args, **kwargs)


def register_attention(name: str, fn: Callable) -> None:
    """Register `fn` as an HF attention implementation called `name`."""
    from transformers import AttentionInterface

    AttentionInterface.register(name, fn)


def decoder_layer_params(layer: torch.nn.Module) -> frozenset[str]:
    """Keyword names a decoder layer's forward accepts (follows `functools.wraps` decorators)."""
    return frozenset(inspect.signature(layer.forward).parameters)


def cache_kwarg(params: frozenset[str]) -> str:
    """transformers >= 5.2x renamed `past_key_values` to `cache` on decoder layers."""
    return "cache" if "cache" in params else "past_key_values"


def rotary_takes_layer_type(rotary: torch.nn.Module) -> bool:
    """Gemma4 computes RoPE per layer type; Llama/Qwen have one rotary table."""
    return "layer_type" in inspect.signature(rotary.forward).parameters


