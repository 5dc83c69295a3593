"""Gemma4 text-config presets: a tiny random model for CPU, and the real 31B / 26B-A4B shapes.

This file owns shapes and which text-config fields `model.config_overrides` may set; building and loading
models lives in `hf_module.py`.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Iterable
from typing import Any

from transformers import Gemma4TextConfig, PretrainedConfig

from lightning_ffpa._compat.transformers import CONFIG_VALUE_ERRORS, config_error_text, kv_head_counts
from lightning_ffpa.errors import ConfigError

# Config fields that count something (layers, heads, widths): 0 builds a model whose first forward fails.
COUNT_FIELDS = frozenset({"num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
                          "num_key_value_heads", "num_global_key_value_heads", "head_dim", "global_head_dim",
                          "vocab_size", "num_experts", "top_k_experts", "moe_intermediate_size"})

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


def config_fields(config: PretrainedConfig | type[PretrainedConfig], extra: Iterable[str] = ()) -> set[str]:
    """Names a config accepts as overrides: its dataclass fields, its serialised keys, and `extra`."""
    cls = config if isinstance(config, type) else type(config)
    names = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    instance = config if not isinstance(config, type) else None
    if instance is not None:
        names |= set(instance.to_dict())
    return names | set(extra)


def check_overrides(overrides: dict[str, Any], valid: set[str], config_name: str,
                    option: str = "model.config_overrides") -> None:
    """Every key must be a config field (else transformers keeps it as an unused attribute, silently)."""
    if not isinstance(overrides, dict):
        raise ConfigError(option, overrides, "must be a mapping of text-config fields, e.g. {num_hidden_layers: 2}")
    for key, value in overrides.items():
        if key not in valid:
            close = difflib.get_close_matches(key, sorted(valid), n=1)
            hint = f"; did you mean `{close[0]}`?" if close else ""
            raise ConfigError(f"{option}.{key}", value, f"is not a {config_name} field{hint}")
        if key in COUNT_FIELDS and isinstance(value, int) and not isinstance(value, bool) and value < 1:
            raise ConfigError(f"{option}.{key}", value, "must be >= 1")


def check_preset_overrides(preset: str, overrides: dict[str, Any], option: str = "model.config_overrides") -> None:
    """Check `preset` and that every override names a `Gemma4TextConfig` field (or a key the presets set)."""
    if preset not in PRESETS:
        raise ConfigError("model.preset", preset, f"is unknown; choose one of {sorted(PRESETS)}")
    extra = set().union(*PRESETS.values())  # constructor keywords Gemma4TextConfig pops (e.g. global_head_dim)
    check_overrides(overrides, config_fields(Gemma4TextConfig, extra), Gemma4TextConfig.__name__, option)


def build_text_config(preset: str = "tiny", **overrides: Any) -> Gemma4TextConfig:
    """Return a `Gemma4TextConfig` for `preset`, with `overrides` applied (e.g. `num_hidden_layers=6`)."""
    if preset not in PRESETS:
        raise ConfigError("model.preset", preset, f"is unknown; choose one of {sorted(PRESETS)}")
    kwargs = dict(PRESETS[preset])
    kwargs.update(overrides)
    if "num_hidden_layers" in overrides and "layer_types" not in overrides and "layer_types" in kwargs:
        del kwargs["layer_types"]  # let Gemma4 derive the 5:1 pattern for the new depth
    try:
        config = Gemma4TextConfig(**kwargs)
    except CONFIG_VALUE_ERRORS as err:
        raise ConfigError("model.config_overrides", overrides, config_error_text(err)) from err
    check_heads(config)
    check_experts(config)
    return config


def check_heads(config: Any, option: str = "model.config_overrides") -> None:
    """Every layer's key/value heads must divide its query heads (else the first attention call fails)."""
    heads = getattr(config, "num_attention_heads", None)
    for kv in kv_head_counts(config):
        if heads and kv and heads % kv:
            raise ConfigError(f"{option}.num_attention_heads", heads, f"must be a multiple of every layer's key/value "
                              f"heads ({kv} on some layers)")


def check_experts(config: Any, option: str = "model.config_overrides") -> None:
    """A MoE config must route each token to at most all of its experts (else the first forward fails)."""
    experts, top_k = getattr(config, "num_experts", None), getattr(config, "top_k_experts", None)
    if getattr(config, "enable_moe_block", False) and experts is not None and top_k is not None:
        if not 1 <= top_k <= experts:
            raise ConfigError(f"{option}.top_k_experts", top_k, f"must be between 1 and num_experts={experts}")
