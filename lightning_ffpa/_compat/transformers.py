"""Private and version-dependent transformers surfaces (checked on 5.17 and 5.24), and the HF model lookups.

Owns: the version floor, attention/mask registration, padded <-> packed conversion, how a decoder layer
wants its cache arguments, reading and writing `config._attn_implementation`, reading an experts module's
`config._experts_implementation`, `_from_config`, `_init_weights`, and finding the HF model (and its decoder
layers) inside any module. Does not own the attention functions or models themselves: callers import these
names so an upgrade breaks only this file.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import transformers
from packaging.version import Version
from torch import nn
from transformers import AttentionInterface, PretrainedConfig, PreTrainedModel
from transformers.masking_utils import AttentionMaskInterface, prepare_padding_mask

# Private helpers, identical in 5.17 and 5.24 (transformers/modeling_flash_attention_utils.py).
from transformers.modeling_flash_attention_utils import _pad_input, _unpad_input, _upad_input

__all__ = [
    "AmbiguousModelError",
    "CONFIG_VALUE_ERRORS",
    "config_error_text",
    "MIN_TRANSFORMERS",
    "PACKED_KWARGS",
    "attention_names",
    "cache_kwarg",
    "check_version",
    "config_attn_implementation",
    "decoder_layer_params",
    "disable_kv_cache",
    "experts_implementation",
    "find_decoder_layers",
    "find_hf_model",
    "from_config",
    "init_weights_fn",
    "kv_head_counts",
    "per_layer_overrides",
    "per_layer_overrides_follow_types",
    "pad",
    "prepare_padding_mask",
    "register_attention",
    "register_mask",
    "rotary_takes_layer_type",
    "set_attn_implementation",
    "set_config_attn_implementation",
    "text_config",
    "unpad",
]

try:  # strict-dataclass configs (transformers 5 on huggingface_hub 1.x) raise these for a bad field value
    from huggingface_hub.errors import StrictDataclassError
except ImportError:  # pragma: no cover - older huggingface_hub: configs raise plain errors
    StrictDataclassError = ValueError
CONFIG_VALUE_ERRORS = (TypeError, ValueError, StrictDataclassError)


def config_error_text(err: BaseException) -> str:
    """One line from a config validation error (huggingface_hub puts the reason on the lines after the first)."""
    return " ".join(line.strip() for line in str(err).splitlines() if line.strip())

MIN_TRANSFORMERS = "5.13"  # SDPA GQA fix for head_dim > 256 (transformers PR #46960)

# FlashAttentionKwargs that carry packed-sequence boundaries (DataCollatorWithFlattening).
PACKED_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "cu_seqlens_q", "cu_seqlens_k")


def check_version() -> None:
    """Fail early on transformers older than the Gemma4/SDPA fixes the "ffpa" backend relies on."""
    if Version(transformers.__version__).release < Version(MIN_TRANSFORMERS).release:
        raise RuntimeError(f"lightning_ffpa's 'ffpa' attention needs transformers>={MIN_TRANSFORMERS}, "
                           f"found {transformers.__version__}")


# --------------------------------------------------------------------------- attention registry


def register_attention(name: str, fn: Callable) -> None:
    """Register an attention function globally (ALL_ATTENTION_FUNCTIONS)."""
    AttentionInterface.register(name, fn)


def register_mask(name: str, fn: Callable) -> None:
    """Register a mask function globally (ALL_MASK_ATTENTION_FUNCTIONS); without it every layer gets mask None."""
    AttentionMaskInterface.register(name, fn)


def attention_names() -> set[str]:
    """Every attention implementation name registered with transformers."""
    return set(AttentionInterface._global_mapping)


def config_attn_implementation(config: PretrainedConfig) -> str | None:
    """The attention implementation name a config's layers dispatch on."""
    return config._attn_implementation


def experts_implementation(experts: nn.Module) -> str:
    """The MoE experts implementation an experts module's forward dispatches on (its config's; "eager" unset)."""
    return getattr(getattr(experts, "config", None), "_experts_implementation", None) or "eager"


def set_config_attn_implementation(config: PretrainedConfig, name: str) -> None:
    """Route the layers reading `config` to attention `name`, without the model-level checks of
    `set_attn_implementation` (for names registered after the model was built, and for restoring a saved name)."""
    config._attn_implementation = name


def set_attn_implementation(model: nn.Module, name: str) -> None:
    """Set the HF attention implementation on `model` (and its sub-configs)."""
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(name)
    else:
        set_config_attn_implementation(model.config, name)


# --------------------------------------------------------------------------- padded <-> packed


def unpad(query, key, value, padding_mask, q_len: int):
    """[B,S,H,D] q/k/v + 2D bool mask -> THD tensors, q indices, (cu_q, cu_k), (max_q, max_k)."""
    return _upad_input(query, key, value, padding_mask, q_len, _unpad_input)


def pad(hidden, indices, batch: int, seqlen: int):
    """THD -> [B,S,...] with zeros at padded positions."""
    return _pad_input(hidden, indices, batch, seqlen)


# --------------------------------------------------------------------------- decoder-layer signatures


def decoder_layer_params(layer: nn.Module) -> frozenset[str]:
    """Keyword names a decoder layer's forward accepts (follows `functools.wraps` decorators)."""
    return frozenset(inspect.signature(layer.forward).parameters)


def cache_kwarg(params: frozenset[str]) -> str:
    """transformers >= 5.2x renamed `past_key_values` to `cache` on decoder layers."""
    return "cache" if "cache" in params else "past_key_values"


def rotary_takes_layer_type(rotary: nn.Module) -> bool:
    """Gemma4 computes RoPE per layer type; Llama/Qwen have one rotary table."""
    return "layer_type" in inspect.signature(rotary.forward).parameters


# --------------------------------------------------------------------------- building models


def text_config(config: PretrainedConfig) -> PretrainedConfig:
    """The text (decoder) config: `config` itself, or the text part of a multimodal config."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def from_config(cls: type[PreTrainedModel], config: PretrainedConfig, **kwargs: Any) -> PreTrainedModel:
    """A randomly initialised `cls` for `config` (`_from_config`: takes `dtype`/`attn_implementation` and
    builds on the current default device, which is what meta-device construction needs)."""
    return cls._from_config(config, **kwargs)


def init_weights_fn(model: nn.Module) -> Callable[[nn.Module], None] | None:
    """The HF per-submodule initialiser (`_init_weights`, which also rebuilds non-persistent buffers such as
    rotary `inv_freq`), or None for a module that is not an HF model."""
    return getattr(model, "_init_weights", None)


def disable_kv_cache(model: nn.Module) -> None:
    """Set `use_cache=False` on every HF config inside `model` (a multimodal model's text config included).
    Training has no use for a KV cache, and under activation checkpointing the
    recompute appends to it again, which fails torch's recompute check."""
    for module in model.modules():
        config = getattr(module, "config", None)
        for cfg in {id(c): c for c in (config, text_config(config) if config is not None else None)}.values():
            if isinstance(cfg, PretrainedConfig) and getattr(cfg, "use_cache", False):
                cfg.use_cache = False


# --------------------------------------------------------------------------- finding the HF model


def find_decoder_layers(model: nn.Module) -> tuple[nn.Module, str] | None:
    """The (parent ModuleList owner, attribute) holding the decoder layers: HF `*.model.layers` or `*.layers`."""
    for candidate in (getattr(model, "model", None), model):
        layers = getattr(candidate, "layers", None)
        if isinstance(layers, nn.ModuleList) and len(layers) > 0:
            return candidate, "layers"
    # Fallback for wrappers (e.g. a multimodal model): the first ModuleList named "layers" whose
    # entries are decoder layers (HF marks them GradientCheckpointingLayer).
    for _, module in model.named_modules():
        layers = getattr(module, "layers", None)
        if isinstance(layers, nn.ModuleList) and any(type(_unwrapped(m)).__name__.endswith("DecoderLayer")
                                                      for m in layers):
            return module, "layers"
    return None


def _unwrapped(layer: nn.Module) -> nn.Module:
    """A decoder layer inside the wrappers `parallelize` puts around it (torch.compile, activation checkpointing)."""
    while True:
        inner = getattr(layer, "_orig_mod", None) or getattr(layer, "_checkpoint_wrapped_module", None)
        if not isinstance(inner, nn.Module):
            return layer
        layer = inner


def _outermost(module: nn.Module, qualifies: Callable[[nn.Module], bool]) -> list[tuple[str, nn.Module]]:
    """(name, submodule) for each PreTrainedModel in `module` that `qualifies` and lies inside no other one."""
    found: list[tuple[str, nn.Module]] = []
    for name, m in module.named_modules():
        if isinstance(m, PreTrainedModel) and qualifies(m) and not any(name.startswith(f"{n}.") for n, _ in found):
            found.append((name, m))
    return found


class AmbiguousModelError(ValueError):
    """Several HF models in a LightningModule, and nothing says which one is trained (callers re-raise it as the
    project's one-line input error; this floor imports nothing of the project)."""


def _pick(found: list[tuple[str, nn.Module]], strict: bool) -> nn.Module | None:
    """The one model of `found` to configure: the only one, else the only one with trainable parameters."""
    if len(found) <= 1:
        return found[0][1] if found else None
    trained = [(n, m) for n, m in found if any(p.requires_grad for p in m.parameters())]
    if len(trained) == 1:
        return trained[0][1]
    if not strict:
        return (trained or found)[0][1]
    names = ", ".join(f"`{n}`" for n, _ in (trained or found))
    raise AmbiguousModelError(f"{len(trained or found)} HF models {'with trainable parameters ' if trained else ''}in the "
                     f"LightningModule ({names}), so which one to train is ambiguous: set the trained one as "
                     "`self.model`, or freeze the others (`requires_grad_(False)`)")


def find_hf_model(module: nn.Module, *, with_decoder_layers: bool = False, strict: bool = True) -> nn.Module | None:
    """The HF model inside `module` (a LightningModule, or any wrapper): `module.model` when it qualifies, else
    the outermost PreTrainedModel submodule that does (of several, the only one with trainable parameters: a
    frozen reference beside a trained policy); None if none does.

    Qualifies: a PreTrainedModel. With `with_decoder_layers` (what FSDP shards): any `module.model` whose
    decoder layers `find_decoder_layers` finds (so a PEFT wrapper is sharded at its own root), or a
    PreTrainedModel submodule with decoder layers. `strict`: several candidates none of which is the only
    trained one raise `AmbiguousModelError`; otherwise the first trained (or first) is returned.
    """
    inner = getattr(module, "model", None)
    if with_decoder_layers:
        if isinstance(inner, nn.Module) and find_decoder_layers(inner) is not None:
            return inner
        return _pick(_outermost(module, lambda m: find_decoder_layers(m) is not None), strict)
    if isinstance(inner, PreTrainedModel):
        return inner
    return _pick(_outermost(module, lambda m: True), strict)


def per_layer_overrides(config: PretrainedConfig) -> dict[int, dict[str, Any]]:
    """The config's per-layer overrides by layer index (transformers >= 5.2x: Gemma4's full-attention layers carry
    their own `head_dim`); {} where there are none or transformers has no such notion."""
    if not getattr(config, "is_heterogeneous", False):
        return {}
    return {int(k): dict(v) for k, v in (config.to_dict().get("per_layer_config") or {}).items()}


def per_layer_overrides_follow_types(config: PretrainedConfig, before: dict[int, dict[str, Any]],
                                     types_before: list[str]) -> None:
    """After the depth or `layer_types` changed, give each layer its type's overrides (as Gemma4's config derives
    them from `layer_types` when it is built). ValueError where a type's layers differed, or a type is new."""
    by_type: dict[str, dict[str, Any]] = {}
    for i, kind in enumerate(types_before):
        if by_type.setdefault(kind, before.get(i, {})) != before.get(i, {}):
            raise ValueError(f"the checkpoint's `{kind}` layers differ in their per-layer config, so the new layers' "
                             "shapes are unknown")
    new = set(config.layer_types) - set(by_type)
    if new:
        raise ValueError(f"the checkpoint has no {sorted(new)} layers to take their per-layer config from")
    config.per_layer_config = {i: dict(by_type[k]) for i, k in enumerate(config.layer_types) if by_type[k]}


def kv_head_counts(config: PretrainedConfig) -> set[int]:
    """The key/value head counts the config's layers use: transformers' per-layer configs where it has them
    (>= 5.2x), else the global count and the full layers' `num_global_key_value_heads`."""
    if getattr(config, "is_heterogeneous", False):
        return {c.num_key_value_heads for c in config.per_layer_config} - {None}
    return {getattr(config, k, None) for k in ("num_key_value_heads", "num_global_key_value_heads")} - {None}
