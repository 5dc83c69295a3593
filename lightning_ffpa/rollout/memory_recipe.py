"""The GRPO memory estimate of a recipe as a fit runs it: `configs/<recipe>.yaml` with console overrides.

Owns reading the options the estimate needs (preset and depth, LoRA incl. `base_dtype`, the engine's sizes, the
group, the prompt and completion lengths, the micro-batch budget, the log-prob chunk, the checkpointing mode, the
dtypes) from a recipe and `--a.b.c value` overrides applied as the console applies them: a dict value is merged key
by key over the YAML's, and `--trainer.callbacks.init_args.*` lands on the recipe's last callback (the
RolloutCallback in the GRPO recipes). Does not own the arithmetic (`memory.py`) or running the fit.

    from lightning_ffpa.rollout.memory_recipe import recipe_estimate
    recipe_estimate("configs/gemma4_grpo.yaml", ["--model.init_args.max_tokens_per_microbatch", "4608"])
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

from lightning_ffpa.errors import ConfigError
from lightning_ffpa.rollout.engine import EngineConfig
from lightning_ffpa.rollout.memory import LORA_TARGETS, GRPOMemory, estimate

CALLBACK = "trainer.callbacks.init_args."  # the console puts these on the last callback
DTYPE_BYTES = {"bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "float32": 4, "fp32": 4, "auto": 2}
_TOKEN = re.compile(r"\{[^}]*\}|\[[^\]]*\]|\S+")  # a YAML flow dict or list is one token


def split_command(command: str) -> list[str]:
    """A recorded command line as the shell passed it: words, with `{...}` and `[...]` values kept whole."""
    return _TOKEN.findall(command)


def apply_overrides(config: dict[str, Any], args: list[str]) -> dict[str, Any]:
    """`config` with each `--key value` of `args` set (values parsed as YAML; a dict merged over the old one);
    `--config` and words outside pairs (the subcommand) are skipped."""
    import yaml

    out = copy.deepcopy(config)
    i = 0
    while i < len(args):
        key = args[i][2:] if args[i].startswith("--") else None
        if key is None or i + 1 >= len(args) or args[i + 1].startswith("--"):
            i += 1
            continue
        value = yaml.safe_load(args[i + 1])
        i += 2
        if key == "config":
            continue
        node = out
        if key.startswith(CALLBACK):
            node = ((out.get("trainer") or {}).get("callbacks") or [{}])[-1].setdefault("init_args", {})
            key = key[len(CALLBACK):]
        *parents, leaf = key.split(".")
        for p in parents:
            if not isinstance(node.get(p), dict):
                node[p] = {}
            node = node[p]
        old = node.get(leaf)
        node[leaf] = {**old, **value} if isinstance(old, dict) and isinstance(value, dict) else value
    return out


def _dtype_bytes(option: str, value: Any) -> int:
    if value is None:
        return 2  # the strategy's compute dtype: bf16 in the GRPO recipes
    if str(value).removeprefix("torch.") not in DTYPE_BYTES:
        raise ConfigError(option, value, f"is not one of {', '.join(DTYPE_BYTES)}")
    return DTYPE_BYTES[str(value).removeprefix("torch.")]


def recipe_options(config: dict[str, Any]) -> dict[str, Any]:
    """`estimate`'s arguments for a parsed recipe (overrides applied), the update's largest micro-batch included."""
    from lightning_ffpa.rl.algorithm import microbatches

    model = (config.get("model") or {}).get("init_args") or {}
    strategy = ((config.get("trainer") or {}).get("strategy") or {})
    callbacks = (config.get("trainer") or {}).get("callbacks") or []
    rollout = next((c.get("init_args") or {} for c in reversed(callbacks)
                    if str(c.get("class_path", "")).endswith("RolloutCallback")), None)
    if rollout is None:
        raise ConfigError("trainer.callbacks", None, "has no RolloutCallback: not a GRPO recipe")
    data = (config.get("data") or {}).get("init_args") or {}
    lora = model.get("lora")
    if not lora:
        raise ConfigError("model.lora", lora, "the estimate covers LoRA (adapter-only optimizer state)")
    targets = lora.get("target_modules") or list(LORA_TARGETS)
    if isinstance(targets, str):
        raise ConfigError("model.lora.target_modules", targets, "the estimate needs a list of Linear names")
    seq = int(data.get("prompt_len", 0)) + int((rollout.get("sampling") or {}).get("max_new_tokens", 0))
    rows = int(data.get("batch_size", 1)) * int(rollout.get("num_generations", 4))
    budget = model.get("max_tokens_per_microbatch")
    largest = max(len(p) for p in microbatches([seq] * rows, budget)) * seq  # padded tokens of one forward
    mode = (strategy.get("init_args") or {}).get("activation_checkpointing", "selective") \
        if str(strategy.get("class_path", "")).endswith("FSDP2Strategy") else "none"
    return dict(
        preset=model.get("preset", "tiny"),
        num_hidden_layers=(model.get("config_overrides") or {}).get("num_hidden_layers"),
        lora_r=int(lora["r"]), lora_targets=tuple(targets),
        lora_target_parameters=tuple(lora.get("target_parameters") or ()),
        base_dtype=lora.get("base_dtype", "model"),
        weight_bytes=_dtype_bytes("model.dtype", model.get("dtype", "float32")),
        inference_bytes=_dtype_bytes(f"{CALLBACK}inference_dtype", rollout.get("inference_dtype")),
        engine=EngineConfig(**(rollout.get("engine") or {})),
        weights=rollout.get("weights", "shared"),
        train_tokens=rows * seq, max_tokens_per_microbatch=largest,
        logprob_chunk_size=int(model.get("logprob_chunk_size", 4096)),
        activation_checkpointing=mode,
    )


def recipe_estimate(recipe: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> GRPOMemory:
    """The estimate of `recipe` (a YAML path) fitted with `overrides` (console words, as a command records them)."""
    import yaml

    config = apply_overrides(yaml.safe_load(Path(recipe).read_text()), list(overrides))
    return estimate(**recipe_options(config))
