"""The `lora` option of every LightningModule here: `LoraSpec`, its checks, and the peft model it builds.

Owns the typed LoRA options (a subset of peft's `LoraConfig` fields, so LightningCLI/jsonargparse type and
document them: `--model.init_args.lora '{r: 16, lora_alpha: 32, target_modules: [q_proj, v_proj]}'` or
`--model.init_args.lora.r 16`; `base_dtype` and `expert_adapters` are ours: the FP8 frozen base of `fp8_base.py`,
the expert adapters' path of `experts.py`), their range checks,
the plain dict form kept in `hparams` and checkpoints
(`torch.load(weights_only=True)` cannot unpickle a dataclass), `apply_lora`, `unwrap_peft` (the HF model inside a
peft wrapper), and the peft naming and merge rule shared by export and the rollout weight sync (`PEFT_PREFIX`,
`hf_name`, `merged_weight`, for a Linear's 2-D weight and a 3-D expert stack adapted through
`target_parameters`). Does not own which modules and parameters exist (validation.py checks that
`target_modules` and `target_parameters` match) or reading/writing checkpoints (export.py).
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from lightning_ffpa.errors import ConfigError

__all__ = ["LoraSpec", "lora_hparam", "lora_spec", "peft_options", "check_targets_given", "check_targets_match", "apply_lora",
           "unwrap_peft", "PEFT_PREFIX", "hf_name", "merged_weight", "dora_weight"]

PEFT_PREFIX = "base_model.model."  # PeftModel -> LoraModel -> HF model
# Levels peft puts inside a wrapped module: a LoRA layer's `base_layer`, a `modules_to_save` module's copies.
PEFT_LEVEL = re.compile(r"\.(base_layer|original_module|modules_to_save\.[^.]+)(?=\.)")


@dataclass
class LoraSpec:
    """peft LoRA adapter options (the `peft.LoraConfig` fields of the same names and defaults)."""

    r: int = 8
    """adapter rank (>= 1)."""
    lora_alpha: float = 8
    """scaling numerator: the update is scaled by lora_alpha / r (lora_alpha / sqrt(r) with use_rslora)."""
    target_modules: list[str] | str | None = None
    """module name suffixes to adapt (e.g. [q_proj, v_proj]), a regex over full names, or `all-linear`."""
    target_parameters: list[str] | None = None
    """parameter name suffixes to adapt where no Linear holds them: the 3-D MoE expert stacks (e.g.
    [experts.gate_up_proj, experts.down_proj]; peft's `target_parameters`, no lora_dropout, no DoRA)."""
    lora_dropout: float = 0.0
    """dropout on the adapter input, in [0, 1)."""
    bias: Literal["none", "all", "lora_only"] = "none"
    """which biases train."""
    use_rslora: bool = False
    """rank-stabilised scaling lora_alpha / sqrt(r)."""
    use_dora: bool = False
    """weight-decomposed LoRA (DoRA)."""
    modules_to_save: list[str] | None = None
    """modules trained in full and saved with the adapter (e.g. [lm_head])."""
    layers_to_transform: list[int] | None = None
    """only these decoder layer indices get adapters (None: all)."""
    exclude_modules: list[str] | str | None = None
    """module names (or a regex) never adapted."""
    init_lora_weights: bool | str = True
    """peft's adapter initialisation (True: B = 0, so training starts from the base model)."""
    base_dtype: Literal["model", "fp8"] = "model"
    """the targets' frozen W0: `model` (in model.dtype) or `fp8` (float8_e4m3fn, one fp32 scale per row)."""
    expert_adapters: Literal["unmerged", "folded"] = "unmerged"
    """how `target_parameters` adapters run: `unmerged` (x W^T + s (x A^T) B^T inside the experts' grouped GEMMs,
    `experts.py`) or `folded` (peft's: W + s B A for every expert on each forward, and a gradient for the whole stack)."""


_FIELDS = {f.name: f for f in dataclasses.fields(LoraSpec)}
BASE_DTYPES = ("model", "fp8")  # `base_dtype`: the frozen base as built, or float8 (`fp8_base.py`)
EXPERT_ADAPTERS = ("unmerged", "folded")
OURS = ("base_dtype", "expert_adapters")  # LoraSpec fields that are not peft's: never passed to `LoraConfig`


def _spec(value: LoraSpec | dict[str, Any], option: str) -> LoraSpec:
    if isinstance(value, LoraSpec):
        return value
    if not isinstance(value, dict):
        raise ConfigError(option, value, "must be a mapping of peft LoraConfig fields, e.g. {r: 16, lora_alpha: 32}")
    for key in value:
        if key not in _FIELDS:
            close = difflib.get_close_matches(key, list(_FIELDS), n=1)
            hint = f"; did you mean `{close[0]}`?" if close else f"; known fields: {sorted(_FIELDS)}"
            raise ConfigError(f"{option}.{key}", value[key], f"is not a LoRA option{hint}")
    return LoraSpec(**value)


def lora_spec(owner: Any) -> dict[str, Any] | None:
    """The `lora` options of a module (its `hparams`) or of a checkpoint's hyper-parameters, or None. Only a
    mapping counts: a module of the user's own may keep a `lora` hyper-parameter of its own meaning (`lora=True`)."""
    hparams = owner if isinstance(owner, Mapping) else getattr(owner, "hparams", None)
    spec = hparams.get("lora") if isinstance(hparams, Mapping) else None
    return dict(spec) if isinstance(spec, Mapping) and spec else None


def lora_hparam(value: LoraSpec | dict[str, Any] | None, option: str = "model.lora") -> dict[str, Any] | None:
    """The checked LoRA options as a plain dict (`r` plus the fields that differ from their default), or None."""
    if value is None:
        return None
    spec = _spec(value, option)
    if not isinstance(spec.r, int) or spec.r < 1:
        raise ConfigError(f"{option}.r", spec.r, "must be an integer >= 1")
    if not spec.lora_alpha > 0:
        raise ConfigError(f"{option}.lora_alpha", spec.lora_alpha, "must be > 0")
    if not 0.0 <= spec.lora_dropout < 1.0:
        raise ConfigError(f"{option}.lora_dropout", spec.lora_dropout, "must be in [0, 1)")
    if spec.bias not in ("none", "all", "lora_only"):
        raise ConfigError(f"{option}.bias", spec.bias, "must be one of 'none', 'all', 'lora_only'")
    _check_target_parameters(spec, option)
    _check_base_dtype(spec, option)
    if spec.expert_adapters not in EXPERT_ADAPTERS:
        raise ConfigError(f"{option}.expert_adapters", spec.expert_adapters,
                          f"must be one of {', '.join(EXPERT_ADAPTERS)}")
    if spec.expert_adapters != "unmerged" and not spec.target_parameters:
        raise ConfigError(f"{option}.expert_adapters", spec.expert_adapters,
                          f"has no expert adapters to run: `{option}.target_parameters` puts them on the expert "
                          "stacks; leave it unset otherwise")
    plain = {"r": spec.r}
    for name, field in _FIELDS.items():
        v = getattr(spec, name)
        if name != "r" and v != field.default:
            plain[name] = list(v) if isinstance(v, tuple) else v
    return plain


def _check_target_parameters(spec: LoraSpec, option: str) -> None:
    """`target_parameters` is a list of names, and peft's parameter LoRA has no dropout and no DoRA (its
    `ParamWrapper` refuses both only when the model is built)."""
    names = spec.target_parameters
    if names is None:
        return
    if isinstance(names, str) or not all(isinstance(n, str) and n for n in names) or not names:
        raise ConfigError(f"{option}.target_parameters", names, "must be a non-empty list of parameter names "
                          "(peft matches by suffix; no regex), e.g. [experts.gate_up_proj, experts.down_proj]")
    if spec.lora_dropout:
        raise ConfigError(f"{option}.lora_dropout", spec.lora_dropout, "must be 0 with `target_parameters` "
                          "(peft folds the adapter into the weight, so there is no adapter input to drop)")
    if spec.use_dora:
        raise ConfigError(f"{option}.use_dora", True, "does not work with `target_parameters` (peft's parameter "
                          "LoRA has no DoRA)")


def _check_base_dtype(spec: LoraSpec, option: str) -> None:
    """`base_dtype` is one of `BASE_DTYPES`; an fp8 base holds Linear weights only, and DoRA reads W0's norms."""
    if spec.base_dtype not in BASE_DTYPES:
        raise ConfigError(f"{option}.base_dtype", spec.base_dtype, f"must be one of {', '.join(BASE_DTYPES)}")
    if spec.base_dtype != "fp8":
        return
    if spec.target_parameters:
        raise ConfigError(f"{option}.base_dtype", "fp8", "stores Linear LoRA targets only, and `target_parameters` "
                          "adapts expert stacks: drop one of them")
    if spec.use_dora:
        raise ConfigError(f"{option}.base_dtype", "fp8", "does not work with `use_dora` (DoRA reads the base "
                          "weight's norms in high precision): drop one of them")


def peft_options(lora: dict[str, Any]) -> dict[str, Any]:
    """The `peft.LoraConfig` fields of a LoRA hyper-parameter dict (ours, `OURS`, left out)."""
    return {k: v for k, v in lora.items() if k not in OURS}


def check_targets_given(lora: dict[str, Any] | None, model_type: str, option: str = "model.lora") -> None:
    """Refuse LoRA without `target_modules` where peft has no default for the model type (the text-only
    `gemma4_text` of a CausalLM): peft would fail only when the model is built, after the run folder exists."""
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as PEFT_DEFAULTS

    if (lora and lora.get("target_modules") is None and not lora.get("target_parameters")
            and model_type not in PEFT_DEFAULTS):
        raise ConfigError(f"{option}.target_modules", None, f"must be set: peft has no default modules for "
                          f"{model_type!r}; set it, e.g. [q_proj, v_proj] or all-linear")


def check_targets_match(model: nn.Module, lora: dict[str, Any], option: str = "model.lora") -> None:
    """Every `target_modules` entry must name a Linear/Embedding of `model` and every `target_parameters` entry a
    parameter, by peft's rules (the name or a `.`-suffix of it; one string is a regex over full module names).
    peft raises only when nothing at all matches, and otherwise trains without the names that matched nothing."""
    params = lora.get("target_parameters")
    if params:
        names = [n for n, _ in model.named_parameters()]
        unmatched = [t for t in params if not any(_peft_matches([t], n) for n in names)]
        if unmatched:
            stacks = sorted({".".join(n.split(".")[-2:]) for n, p in model.named_parameters() if p.dim() == 3})
            raise ConfigError(f"{option}.target_parameters", unmatched, "match no parameter of the model; its "
                              f"expert stacks: {stacks or 'none (not a MoE model)'}")
    targets = lora.get("target_modules")
    if targets is None or targets == "all-linear":
        return
    _check_wrappable(model, targets, lora.get("exclude_modules"), option)
    names = [n for n, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Embedding))]
    available = sorted({n.rsplit(".", 1)[-1] for n in names})
    if isinstance(targets, str):
        if not any(_peft_matches(targets, n) for n in names):
            raise ConfigError(f"{option}.target_modules", targets, f"(a regex) matches no Linear/Embedding module; "
                              f"e.g. {available}")
        return
    unmatched = [t for t in targets if not any(_peft_matches([t], n) for n in names)]
    if unmatched:
        raise ConfigError(f"{option}.target_modules", unmatched, f"match no Linear/Embedding module of the model; "
                          f"available: {available}")


def _peft_matches(patterns: list[str] | str | None, name: str) -> bool:
    """peft's rule: one string is a regex over the full module name; a list matches the name or a `.`-suffix."""
    if not patterns:
        return False
    if isinstance(patterns, str):
        return re.fullmatch(patterns, name) is not None
    return any(name == t or name.endswith("." + t) for t in patterns)


# what peft's LoRA wraps (Linear and Embedding in Gemma4's text layers; the convolutions for completeness)
_WRAPPABLE = (nn.Linear, nn.Embedding, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.MultiheadAttention)


def _check_wrappable(model: nn.Module, targets: list[str] | str, exclude: list[str] | str | None, option: str) -> None:
    """A target name that also matches a module peft cannot wrap (the multimodal model's vision tower holds
    `q_proj`s that are `Gemma4ClippableLinear`) failed in peft after the weights were loaded."""
    from transformers.pytorch_utils import Conv1D

    odd = [(n, type(m).__name__) for n, m in model.named_modules()
           if n and _peft_matches(targets, n) and not _peft_matches(exclude, n) and not isinstance(m, (*_WRAPPABLE, Conv1D))]
    if odd:
        raise ConfigError(f"{option}.target_modules", targets, f"also match {len(odd)} module(s) that LoRA cannot "
                          f"wrap, e.g. {odd[0][0]} ({odd[0][1]}); name the language model's layers only, e.g. the "
                          "regex '.*language_model.*\\.(q_proj|v_proj)', or list the others in `exclude_modules`")


def apply_lora(model: nn.Module, lora: dict[str, Any], option: str = "model.lora", announce: bool = False) -> nn.Module:
    """Wrap `model` in a peft LoRA model (only the adapters train). `announce`: say once how the expert adapters
    run (the trained model's build; the meta models of checks and estimates stay quiet)."""
    from peft import LoraConfig, get_peft_model

    hparam = lora_hparam(lora, option)
    spec = {"task_type": "CAUSAL_LM", **peft_options(hparam)}
    check_targets_match(model, spec, option)
    try:
        model = get_peft_model(model, LoraConfig(**spec))
    except ValueError as err:
        raise ConfigError(f"{option}.target_modules", spec.get("target_modules"), str(err)) from err
    if spec.get("target_parameters") and hparam.get("expert_adapters", "unmerged") == "unmerged":
        from lightning.pytorch.utilities import rank_zero_info

        from lightning_ffpa.experts import unmerge_expert_adapters

        done = unmerge_expert_adapters(model, f"{option}.expert_adapters")
        if announce:
            rank_zero_info(f"{option}.target_parameters: {done['stacks']} expert stacks in {done['unmerged']} MoE layers "
                           "run their adapters unmerged in the experts' GEMMs (expert_adapters: unmerged)")
    return model


def unwrap_peft(model: nn.Module) -> nn.Module:
    """The model inside a peft wrapper (`PeftModel.get_base_model()`), or `model` itself when it is not wrapped."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def hf_name(train_name: str) -> str:
    """The HF name of a peft-wrapped model's tensor: without `PEFT_PREFIX` and peft's levels (`.base_layer`, and
    `.original_module` / `.modules_to_save.<adapter>` of a `modules_to_save` module)."""
    return PEFT_LEVEL.sub("", train_name.removeprefix(PEFT_PREFIX))


def dora_weight(merged: torch.Tensor, magnitude: torch.Tensor) -> torch.Tensor:
    """DoRA's merged Linear weight from W0 + scaling * B @ A (out, in) and its magnitude (out,): each output row
    rescaled to the magnitude's length, as peft's merge does."""
    return merged * (magnitude / torch.linalg.vector_norm(merged, dim=1)).unsqueeze(1)


def merged_weight(base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """W0 + scaling * B @ A in the inputs' dtype; written into `out` when given.

    A Linear's weight: W0 (out, in), A (r, in), B (out, r). An expert stack (peft's `ParamWrapper` over a
    parameter stored (experts, out, in), as HF's MoE layers store it): A (r * experts, in) holds expert e's rows
    at [e*r, (e+1)*r), B (out, r * experts) its columns at e, e + experts, ... (peft's layout), and each expert
    gets its own B_e @ A_e.
    """
    if base.dim() == 2:
        return torch.addmm(base, b, a, alpha=scaling, out=out)
    from lightning_ffpa.experts import peft_stack_factors  # the experts' module reads the same layout

    a_e, b_e = peft_stack_factors(a, b, base.shape[0])  # (E, r, in), (E, r, out)
    return torch.baddbmm(base, b_e.transpose(-2, -1), a_e, alpha=scaling, out=out)
