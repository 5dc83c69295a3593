"""Gemma4 text-config presets: a tiny random model for CPU, and the real 31B / 26B-A4B shapes.

This file owns shapes only; building and loading models lives in `module.py`.
"""

from __future__ import annotations

from typing import Any

from transformers import Gemma4TextConfig

# Real shapes, from the public Gemma4 config.json files (random weights are used for benchmarks).
_GEMMA4_31B: dict[str, Any] = dict(
    vocab_size=262_144,
    hidden_size=5376,
    intermediate_size=21504,
    num_hidden_layers=60,
    num_attention_heads=32,
    num_key_value_heads=16,
    head_dim=256,
    global_head_dim=512,
    num_global_key_value_heads=4,
    attention_k_eq_v=True,
    sliding_window=1024,
    final_logit_softcapping=30.0,
    max_position_embeddings=262_144,
    hidden_size_per_layer_input=0,
)

# 26B-A4B: the 31B attention recipe (head dims, k_eq_v, window, softcap) at a smaller width, with MoE blocks.
_GEMMA4_26B_A4B: dict[str, Any] = dict(
    _GEMMA4_31B,
    hidden_size=2816,
    intermediate_size=2112,
    num_hidden_layers=30,
    num_attention_heads=16,
    num_key_value_heads=8,
    num_global_key_value_heads=2,
    enable_moe_block=True,
    num_experts=128,
    top_k_experts=8,
    moe_intermediate_size=704,
)

# Tiny random model: both layer types, full layers at head_dim 512, k_eq_v; runs fwd+bwd on CPU in ms.
_TINY: dict[str, Any] = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    global_head_dim=512,
    num_global_key_value_heads=1,
    attention_k_eq_v=True,
    sliding_window=16,
    layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    final_logit_softcapping=30.0,
    max_position_embeddings=2048,
    hidden_size_per_layer_input=0,
    vocab_size_per_layer_input=512,
)

_TINY_MOE: dict[str, Any] = dict(
    _TINY, enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32
)

PRESETS: dict[str, dict[str, Any]] = {
    "tiny": _TINY,
    "tiny-moe": _TINY_MOE,
    "gemma4-31b": _GEMMA4_31B,
    "gemma4-26b-a4b": _GEMMA4_26B_A4B,
}


def build_text_config(preset: str = "tiny", **overrides: Any) -> Gemma4TextConfig:
    """Return a `Gemma4TextConfig` for `preset`, with `overrides` applied (e.g. `num_hidden_layers=6`)."""
    if preset not in PRESETS:
        raise ValueError(f"model.preset={preset!r} is unknown; choose one of {sorted(PRESETS)}")
    kwargs = dict(PRESETS[preset])
    kwargs.update(overrides)
    if "num_hidden_layers" in overrides and "layer_types" not in overrides and "layer_types" in kwargs:
        del kwargs["layer_types"]  # let Gemma4 derive the 5:1 pattern for the new depth
    return Gemma4TextConfig(**kwargs)
