"""FP8 training of the decoder layers' linear layers (torchao float8): the `fp8` option, its checks, the module
swap, the SAC rule for the float8 casts, and the per-step scale precompute of FSDP2's float8 all-gather.

Owns which modules become torchao `Float8Linear`: every `nn.Linear` inside a decoder layer whose dimensions FP8
matmuls accept (multiples of 16), except MoE routers. The lm_head, the embeddings and everything outside the
decoder layers stay in high precision. It does not own the order of the parallelize recipe (`fsdp.parallelize`
converts first, and says why there) nor the SAC policy (`checkpointing`), which it only hands op names.

Recipes: "rowwise" (one scale per row: closer to bf16, no float8 all-gather, which torchao allows only for
tensorwise scales) and "tensorwise" (one scale per tensor; under FSDP2 the weights are all-gathered in float8,
half the bytes, and their scales are computed for all layers in one all-reduce after each optimizer step).

SAC rule for the float8 casts: the amax reductions (`aten.max` for tensorwise, `aten.amax` for rowwise scales)
are saved, a scalar per tensor or one value per row, so the recompute pass runs no reduction and casts with the
scales the forward used; the elementwise work of a cast (abs, scale, clamp, conversion to float8) is recomputed
like the norms. The float8 matmuls follow the `sac_save_mm` rule as any matmul, and the attention forwards (FFPA
and the others) stay must-save.

torchao is imported only when `fp8` is not "none" (`pip install lightning-ffpa[fp8]`).
"""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import Any, Literal

import torch
from torch import nn

from lightning_ffpa.errors import ConfigError

__all__ = ["FP8Recipe", "FP8_RECIPES", "Float8Training", "MIN_CAPABILITY", "SAC_SAVE_OPS"]

FP8Recipe = Literal["none", "rowwise", "tensorwise"]
FP8_RECIPES = ("none", "rowwise", "tensorwise")
MIN_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada (SM89), Hopper (SM90) and later
SAC_SAVE_OPS = ("aten.max.default", "aten.amax.default")  # the amax of each float8 cast (rule above)
_DIM_MULTIPLE = 16  # torch._scaled_mm needs both dims of the weight divisible by 16
OPTION = "fp8"


@dataclasses.dataclass(frozen=True)
class Float8Training:
    """One strategy's FP8 choice: the recipe and whether torchao emulates the float8 matmuls (tests, CPU)."""

    recipe: str = "none"
    emulate: bool = False

    def __post_init__(self) -> None:
        if self.recipe not in FP8_RECIPES:
            raise ConfigError(OPTION, self.recipe, f"is not one of {', '.join(map(repr, FP8_RECIPES))}")
        if self.emulate and self.recipe == "none":  # it would emulate nothing
            raise ConfigError(f"{OPTION}_emulate", True, f"emulates the float8 matmuls of `{OPTION}`, which is "
                              "'none'; set `fp8: rowwise` or `tensorwise` with it, or drop it")

    @property
    def enabled(self) -> bool:
        """Whether any layer is converted."""
        return self.recipe != "none"

    @property
    def float8_all_gather(self) -> bool:
        """Whether FSDP2 all-gathers the converted weights in float8 (tensorwise only: torchao's limit)."""
        return self.recipe == "tensorwise"

    def check_device(self, device: torch.device) -> None:
        """Refuse a device without FP8 matmuls (never a silent bf16 run), and a missing torchao."""
        if not self.enabled:
            return
        if device.type == "cuda":
            cap = torch.cuda.get_device_capability(device)
            if cap < MIN_CAPABILITY and not self.emulate:
                raise ConfigError(OPTION, self.recipe,
                                  f"needs FP8 tensor cores (CUDA capability >= 8.9); "
                                  f"{torch.cuda.get_device_name(device)} has {cap[0]}.{cap[1]}: set fp8 none")
        elif not self.emulate:
            raise ConfigError(OPTION, self.recipe, f"needs a CUDA GPU with FP8 (capability >= 8.9); this run's "
                                                   f"device is {device.type} (`fp8_emulate=true` emulates the "
                                                   "float8 matmuls in high precision, for tests)")
        if not torchao_available():
            raise ConfigError(OPTION, self.recipe, _NO_TORCHAO)

    def check_no_lora(self, lora: Any) -> None:
        """Refuse a LoRA module's hyper-parameters: this option is for full fine-tuning."""
        if self.enabled and lora:
            raise ConfigError(OPTION, self.recipe, _LORA_REASON)

    def config(self):
        """The torchao `Float8LinearConfig` of the recipe (torchao imported here, on first use)."""
        try:
            from torchao.float8 import Float8LinearConfig
        except ImportError as e:
            raise ConfigError(OPTION, self.recipe, _NO_TORCHAO) from e
        base = Float8LinearConfig.from_recipe_name(self.recipe)
        return dataclasses.replace(base, emulate=self.emulate, enable_fsdp_float8_all_gather=self.float8_all_gather)

    def convert(self, layers: nn.ModuleList) -> dict[str, list[str]]:
        """Swap the decoder layers' nn.Linear modules for torchao's Float8Linear in place (meta weights allowed).

        Returns {"converted": [...], "kept": [...]} (names within `layers`); "kept" are the Linear modules left in
        high precision (MoE routers, dims not multiples of 16), counted so the choice is never silent."""
        if not self.enabled:
            return {"converted": [], "kept": []}
        frozen = [n for n, m in layers.named_modules() if isinstance(m, nn.Linear) and not m.weight.requires_grad]
        if frozen:
            raise ConfigError(OPTION, self.recipe, f"{_LORA_REASON} ({len(frozen)} decoder Linear weights are frozen, "
                                                   f"e.g. {frozen[0]})")
        from torchao.float8 import convert_to_float8_training

        config = self.config()
        kept: list[str] = []

        def wanted(module: nn.Linear, fqn: str) -> bool:  # torchao asks for each nn.Linear only
            if _is_float8_linear(module):
                return False  # converted by an earlier call
            if "router" in fqn.split(".") or any(d % _DIM_MULTIPLE for d in (module.in_features, module.out_features)):
                kept.append(fqn)
                return False
            return True

        convert_to_float8_training(layers, config=config, module_filter_fn=wanted)
        converted = [n for n, m in layers.named_modules() if _is_float8_linear(m)]
        # MoE expert stacks are 3-D parameters, not nn.Linear: torchao's float8 training leaves them as they are
        experts = [n for n, m in layers.named_modules() if any(p.dim() == 3 for p in m.parameters(recurse=False))]
        return {"converted": converted, "kept": sorted(set(kept)), "experts": experts}

    def describe(self, layout: dict[str, list[str]]) -> str:
        """One line saying what `convert` did (the strategy logs it, so a run shows FP8 ran and where)."""
        kept = f" ({', '.join(layout['kept'][:3])}{', ...' if len(layout['kept']) > 3 else ''})" if layout["kept"] else ""
        experts = layout.get("experts") or []
        stacks = (f"; {len(experts)} MoE expert modules ({experts[0]}{', ...' if len(experts) > 1 else ''}) stay in "
                  "high precision (torchao converts nn.Linear only, not the 3-D expert stacks)") if experts else ""
        return (f"fp8 {self.recipe}: {len(layout['converted'])} decoder Linear layers train in torchao float8"
                f"{' (emulated in high precision)' if self.emulate else ''}, {len(layout['kept'])} kept in high "
                f"precision{kept}{stacks}; the lm_head and embeddings stay in high precision")

    def plain_tensors(self, tree: Any) -> Any:
        """`tree` (a checkpoint's nested dicts and lists) with torchao's float8 all-gather weight wrappers replaced
        by plain tensors of the same values: a single-file checkpoint then loads without torchao, with
        `weights_only=True`, and exports as plain safetensors. DCP writes the wrapped values already."""
        if isinstance(tree, dict):
            return {k: self.plain_tensors(v) for k, v in tree.items()}
        if type(tree) in (list, tuple):
            return type(tree)(self.plain_tensors(v) for v in tree)
        if isinstance(tree, torch.Tensor) and type(tree).__name__ == "WeightWithDynamicFloat8CastTensor":
            plain = torch.empty(tree.shape, dtype=tree.dtype, device=tree.device)
            plain.copy_(tree.detach())
            return plain
        return tree

    def after_optimizer_step(self, model: nn.Module) -> None:
        """Tensorwise under FSDP2: compute every float8 weight's scale in one all-reduce for the next all-gather."""
        if self.float8_all_gather:
            from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

            precompute_float8_dynamic_scale_for_fsdp(model)


def torchao_available() -> bool:
    """Whether torchao can be imported (looked up, not imported: transformers and torchao imports are slow)."""
    return importlib.util.find_spec("torchao") is not None


_NO_TORCHAO = "needs torchao: pip install 'lightning-ffpa[fp8]'"
_LORA_REASON = ("converts the weights of a full fine-tune, and this model trains LoRA adapters over a frozen base "
                "(its FP8 frozen base is `model.lora.base_dtype: fp8`): set fp8 none")


def _is_float8_linear(module: nn.Module) -> bool:
    return type(module).__name__ == "Float8Linear" and type(module).__module__.startswith("torchao.")
