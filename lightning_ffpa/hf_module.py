"""The LightningModule base that builds the HF Gemma4 model from the model options every module here shares.

Owns: the shared options (`pretrained`, `preset`, `config_overrides`, `model_class`, `attn_implementation`,
`dtype`, `lora`, `save_frozen_weights`) and their checks, the HF config, building the model (pretrained or
preset; on meta under FSDP2Strategy), LoRA (and its float8 base, once the weights are final), loading pretrained
weights into shards, comparing these options with a checkpoint's, and leaving the frozen base out of checkpoints (`save_frozen_weights: false`; the digest
and its check are `lightning_ffpa.checkpoint.frozen`'s). Does not own training (`Gemma4LM` in module.py,
`GRPOModule` in rl/module.py), sharding (`lightning_ffpa.parallel`) or attention kernels
(`lightning_ffpa.attention`).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import re
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn
from transformers import (
    AutoConfig,
    Gemma4Config,
    Gemma4ForCausalLM,
    Gemma4ForConditionalGeneration,
    PretrainedConfig,
    PreTrainedModel,
)

from lightning_ffpa._compat.torch import without_wrapper_levels
from lightning_ffpa._compat.transformers import (  # noqa: F401 - text_config re-exported
    CONFIG_VALUE_ERRORS,
    config_error_text,
    disable_kv_cache,
    from_config,
    per_layer_overrides,
    per_layer_overrides_follow_types,
    text_config,
)
from lightning_ffpa.attention.plan import (
    AttentionPlan,
    plan_for,
    registered_attention,
    resolve_plan,
)
from lightning_ffpa.checkpoint.frozen import FROZEN_BASE_KEY, check_frozen_base, frozen_names, frozen_record
from lightning_ffpa.checkpoint.frozen import OPTION as FROZEN_OPTION
from lightning_ffpa.checkpoint.pretrained_files import check_weight_files
from lightning_ffpa.dtypes import parse_dtype
from lightning_ffpa.errors import NOT_GIVEN, CheckpointError, ConfigError, data_option, one_line
from lightning_ffpa.fp8_base import check_device as fp8_base_check_device
from lightning_ffpa.lora import (
    PEFT_LEVEL,
    LoraSpec,
    apply_lora,
    check_targets_given,
    lora_hparam,
    unwrap_peft,
)
from lightning_ffpa.presets import (
    build_text_config,
    check_experts,
    check_heads,
    check_overrides,
    check_preset_overrides,
    config_fields,
)

# Hyper-parameters that define the architecture: a checkpoint trained with other values cannot be resumed.
ARCHITECTURE_HPARAMS = ("pretrained", "preset", "config_overrides", "model_class", "lora")
LORA_RUN_MODES = ("expert_adapters",)  # how the adapters compute, not what they are: free to change on resume
LORA_SHAPES = ("lora.r", "lora.target_modules", "lora.target_parameters", "lora")  # the adapters' tensors
# What a resume cannot change besides the architecture: the weights and AdamW's state are stored in `dtype`, and
# another one would convert them. An evaluation builds no optimizer and converts for its own forward only.
RESUME_HPARAMS = (*ARCHITECTURE_HPARAMS, "dtype")
# Text-config fields that size a checkpoint's weights: a `pretrained` run cannot override them.
SHAPE_FIELDS = frozenset({"hidden_size", "intermediate_size", "vocab_size", "num_attention_heads",
                          "num_key_value_heads", "head_dim", "global_head_dim", "num_global_key_value_heads",
                          "num_experts", "moe_intermediate_size", "hidden_size_per_layer_input",
                          "vocab_size_per_layer_input", "attention_k_eq_v"})
# The checkpoint key naming the module class (`pkg.module.Class`), so an export can rebuild the model's config
# from a checkpoint saved outside LightningCLI (which saves it as the `_class_path` hyper-parameter).
MODULE_CLASS_KEY = "module_class"
# Where the fit read its inputs: its working folder (relative `model.pretrained` / `data.tokenizer` paths resolve
# against it) and the data's tokenizer spec (datamodules save no hyper-parameters), for `lightning-ffpa-export`.
SOURCES_KEY = "fit_sources"
TOKENIZER_DIGEST_KEY = "data.tokenizer_digest"  # in SOURCES_KEY: what its token ids mean (`tokenizer_digest`)
_MODEL_CLASSES = {"causal_lm": Gemma4ForCausalLM, "conditional_generation": Gemma4ForConditionalGeneration}


# peft's adapter weights (its infixes on base weights: `lora.PEFT_LEVEL`).
# torch.compile and activation checkpointing wrap each decoder layer (`parallelize`).
_ADAPTER_KEY = re.compile(r"\.lora_(A|B|embedding_A|embedding_B|magnitude_vector)\.")


def resolve_dtype(dtype: str) -> torch.dtype:
    """The torch dtype of the `model.dtype` option ('auto' is bf16 where the device supports it, else fp32)."""
    return parse_dtype("model.dtype", dtype)


def canonical_option(key: str, value: Any) -> Any:
    """A model option in a comparable form: LoRA options normalised, mappings/sequences/namespaces as plain data."""
    if hasattr(value, "as_dict"):  # a jsonargparse Namespace (a dataclass option before instantiation)
        value = value.as_dict()
    if key == "lora":
        lora = lora_hparam(value)
        if isinstance(lora, dict):  # the same targets in another order are the same adapters
            lora = {k: sorted(v) if k in ("target_modules", "target_parameters") and isinstance(v, list) else v
                    for k, v in lora.items() if k not in LORA_RUN_MODES}
        return lora
    if key == "pretrained" and isinstance(value, str) and os.path.isdir(os.path.expanduser(value)):
        return os.path.realpath(os.path.expanduser(value))  # one folder, however spelled
    if key == "dtype" and isinstance(value, str):
        try:
            return resolve_dtype(value)  # `bf16` and `bfloat16` are one dtype
        except ConfigError:
            return value
    if isinstance(value, dict):
        return {k: canonical_option("", v) for k, v in value.items()} or None  # {} and None both mean "none"
    if isinstance(value, (list, tuple)):
        return [canonical_option("", v) for v in value]
    return value


def differing_options(saved: dict[str, Any], current: dict[str, Any],
                      keys: tuple[str, ...] | None = None) -> list[tuple[str, Any, Any]]:
    """(option, saved value, current value) for each option both sides set differently (`_`-keys skipped)."""
    names = keys if keys is not None else tuple(k for k in saved if not k.startswith("_"))
    out = []
    for key in names:
        if key in saved and key in current:
            a, b = canonical_option(key, saved[key]), canonical_option(key, current[key])
            if a != b:
                out.append((key, saved[key], current[key]))
    return out


class HFModule(L.LightningModule):
    """Base for LightningModules that train an HF Gemma4 model built from the shared model options.

    A subclass takes the options as constructor arguments (same names, types and docs as `Gemma4LM`),
    calls `self.save_hyperparameters()`, then `self.init_model_options()`; the model itself is built in
    `configure_model` (on meta under FSDP2Strategy, which shards, materialises and loads it).
    """

    def init_model_options(self) -> None:
        """Check the shared options and load the HF config (no weights); raises ConfigError on a bad option."""
        hp = self.hparams
        hp["lora"] = lora_hparam(hp.get("lora"))  # checked, and plain data for hparams/checkpoints
        if isinstance(hp.get("pretrained"), str) and os.path.isdir(os.path.expanduser(hp["pretrained"])):
            # absolute in the checkpoint: a resume or export from another folder finds the same weights
            hp["pretrained"] = os.path.abspath(os.path.expanduser(hp["pretrained"]))
        attn = hp.get("attn_implementation", "sdpa")
        if attn not in (known := registered_attention()):
            raise ConfigError("model.attn_implementation", attn, f"is unknown; choose one of {sorted(known)}")
        parse_dtype("model.dtype", hp.get("dtype", "auto"))
        if self.model_class_name not in _MODEL_CLASSES:
            raise ConfigError("model.model_class", self.model_class_name, f"must be one of {sorted(_MODEL_CLASSES)}")
        if not hp.get("save_frozen_weights", True) and not hp["lora"]:
            raise ConfigError(FROZEN_OPTION, False, "leaves the frozen base weights out of checkpoints, and without "
                              "`model.lora` no weight is frozen (a full fine-tune trains them all); drop the option")
        self.config = self._load_config()
        check_targets_given(hp["lora"], self.config.model_type)
        self.model: PreTrainedModel | None = None

    @property
    def model_class_name(self) -> str:
        """`causal_lm` or `conditional_generation` (modules without a `model_class` option build a CausalLM)."""
        return self.hparams.get("model_class", "causal_lm")

    def _load_config(self) -> PretrainedConfig:
        hp = self.hparams
        overrides = hp.get("config_overrides") or {}
        if hp.get("pretrained") is None:
            check_preset_overrides(hp.preset, overrides)
            cfg = build_text_config(hp.preset, **overrides)
            if self.model_class_name == "conditional_generation":
                cfg = Gemma4Config(text_config=cfg.to_dict(), vision_config=None, audio_config=None)
            return cfg
        local = Path(hp.pretrained).expanduser()
        if not local.exists() and (hp.pretrained.startswith((".", "/", "~")) or os.environ.get("HF_HUB_OFFLINE")):
            raise ConfigError("model.pretrained", hp.pretrained, "no such directory")
        if local.is_file():
            raise ConfigError("model.pretrained", hp.pretrained, "is a file; give the checkpoint's directory (the one "
                              "holding config.json) or a hub model id")
        if (local / "adapter_config.json").is_file() and not (local / "config.json").is_file():
            raise ConfigError("model.pretrained", hp.pretrained, "is a LoRA adapter folder (adapter_config.json, no "
                              "config.json); give the base model's folder, or export with --merge_lora for one model")
        if (local / "adapter" / "adapter_config.json").is_file():  # lightning-ffpa-export's layout, not merged
            from lightning.pytorch.utilities import rank_zero_warn

            rank_zero_warn(f"`model.pretrained={hp.pretrained}` holds an exported LoRA adapter in adapter/, which is "
                           "not loaded: the weights beside it are the base it was trained on; to start from the "
                           "trained weights, export with --merge_lora")
        try:
            cfg = AutoConfig.from_pretrained(hp.pretrained)
        except (OSError, ValueError) as err:  # ValueError: a config.json transformers knows no model type of
            raise ConfigError("model.pretrained", hp.pretrained, f"could not be loaded: {one_line(err)}") from err
        self._check_checkpoint(cfg, local)
        # Set on the text config (not through `from_pretrained(**overrides)`, which drops unknown keys
        # silently and would put text fields on a multimodal config's top level).
        text = text_config(cfg)
        check_overrides(overrides, config_fields(text), type(text).__name__)
        layers_before, types_before = per_layer_overrides(text), list(getattr(text, "layer_types", None) or [])
        if "num_hidden_layers" in overrides and "layer_types" not in overrides:
            # the checkpoint's pattern, cut (the usual case: its first N layers) or repeated to the new depth
            types = list(getattr(text, "layer_types", None) or [])
            n = overrides["num_hidden_layers"]
            if types and isinstance(n, int) and n > 0:
                text.layer_types = [types[i % len(types)] for i in range(n)]
        for key, value in overrides.items():
            if key in SHAPE_FIELDS and value != getattr(text, key, value):
                raise ConfigError(f"model.config_overrides.{key}", value, f"changes the shape of weights the "
                                  f"checkpoint holds ({key}={getattr(text, key)} in {hp.pretrained})")
            try:
                setattr(text, key, value)
            except CONFIG_VALUE_ERRORS as err:
                raise ConfigError(f"model.config_overrides.{key}", value, config_error_text(err)) from err
        if layers_before and list(text.layer_types) != types_before:
            option = "num_hidden_layers" if "layer_types" not in overrides else "layer_types"
            try:
                per_layer_overrides_follow_types(text, layers_before, types_before)
            except ValueError as err:
                raise ConfigError(f"model.config_overrides.{option}", overrides[option], str(err)) from err
        try:
            text.validate()
        except CONFIG_VALUE_ERRORS as err:
            raise ConfigError("model.config_overrides", overrides, config_error_text(err)) from err
        check_heads(text)
        check_experts(text)
        return cfg

    def _check_checkpoint(self, cfg: PretrainedConfig, local: Path) -> None:
        """The checkpoint must be a Gemma4 of the kind `model_class` builds, and a local one must hold weights."""
        hp = self.hparams
        model_type = getattr(text_config(cfg), "model_type", "")
        if not model_type.startswith("gemma4"):
            raise ConfigError("model.pretrained", hp.pretrained, f"is a {model_type or 'non-Gemma4'} model "
                              f"({type(cfg).__name__}); lightning-ffpa trains Gemma4")
        multimodal = text_config(cfg) is not cfg
        if multimodal != (self.model_class_name == "conditional_generation"):
            kind, fits = (("a multimodal Gemma4 checkpoint", "conditional_generation") if multimodal
                          else ("a text-only Gemma4 checkpoint", "causal_lm"))
            raise ConfigError("model.model_class", self.model_class_name, f"does not load {hp.pretrained}, {kind} "
                              f"({type(cfg).__name__}): its weights load with model_class: {fits}")
        weights = ("*.safetensors", "*.bin", "*.safetensors.index.json", "*.bin.index.json")
        if local.is_dir() and not any(next(local.glob(w), None) for w in weights):
            raise ConfigError("model.pretrained", hp.pretrained, "holds a config but no weights (*.safetensors or "
                              "*.bin); to start from random weights, use `preset` with `config_overrides`")
        if local.is_dir():
            check_weight_files(local, text_config(cfg), hp.pretrained)

    def check_seq_length(self, seq_len: int | None, option: str) -> None:
        """`option` (a sequence length) must fit the model's `max_position_embeddings`."""
        limit = getattr(text_config(self.config), "max_position_embeddings", None)
        if seq_len is not None and limit is not None and seq_len > limit:
            raise ConfigError(option, seq_len, f"exceeds the model's max_position_embeddings={limit}")

    @property
    def shards_model(self) -> bool:
        """True under FSDP2Strategy, which shards, materialises and loads weights; the model is built on meta.

        Other strategies get a fully built model (Lightning's FSDP wraps it as is).
        """
        if self._trainer is None:
            return False
        from lightning_ffpa.parallel import FSDP2Strategy

        return isinstance(self.trainer.strategy, FSDP2Strategy)

    def build_model(self, device: torch.device | str | None = None, announce: bool = True) -> nn.Module:
        """Create the HF model (weights loaded or randomly initialised) with the configured attention and LoRA.
        `announce=False`: the meta models of checks and estimates, which must not repeat the trained model's lines."""
        hp = self.hparams
        dtype = resolve_dtype(hp.get("dtype", "auto"))
        cls = _MODEL_CLASSES[self.model_class_name]
        requested = hp.get("attn_implementation", "sdpa")
        attn = "sdpa" if requested == "ffpa" else requested
        if hp.get("pretrained") is not None and device != "meta":
            model = cls.from_pretrained(hp.pretrained, config=self.config, dtype=dtype, attn_implementation=attn)
            model.train()  # from_pretrained returns eval mode, and Lightning keeps modes: dropout would stay off
        else:
            # No device given: the ambient one (Lightning's `configure_model` runs under the root device, so a
            # one-GPU fit initialises on the GPU instead of spending minutes on CPU init and a copy).
            with torch.device(device) if device is not None else contextlib.nullcontext():
                model = from_config(cls, self.config, dtype=dtype, attn_implementation=attn)
        if requested == "ffpa":
            from lightning_ffpa.attention import register_ffpa

            register_ffpa()
            model.set_attn_implementation("ffpa")
        if hp.get("lora"):
            model = apply_lora(model, hp.lora, announce=announce)
            if device != "meta":  # a meta build (FSDP2Strategy) is quantised once its weights are loaded
                self._store_base_in_fp8(model, announce)
        return model

    def _store_base_in_fp8(self, model: nn.Module, announce: bool = True) -> None:
        """`lora.base_dtype: fp8`: the LoRA targets' base weights, now final, become float8 (`fp8_base.py`)."""
        if (self.hparams.get("lora") or {}).get("base_dtype") != "fp8":
            return
        from lightning.pytorch.utilities import rank_zero_info

        from lightning_ffpa.fp8_base import describe, quantize_lora_bases

        device = next(p.device for p in model.parameters() if p.requires_grad)
        self.fp8_base = quantize_lora_bases(model)
        if announce:
            rank_zero_info(describe(self.fp8_base, device))

    @property
    def attention_plan(self) -> AttentionPlan:
        """This run's attention plan (`lightning_ffpa.attention.plan`), the one the pre-flight checks and the
        FFPAAttention callback read; before a trainer is attached, the one pre-flight made, else this model's option."""
        if self._trainer is not None:
            from lightning_ffpa.parallel.dims import context_parallel_size

            return plan_for(self._trainer, self, context_parallel_size(self._trainer, self))
        cached = getattr(self, "_attention_plan", None)
        return cached[1] if cached is not None else resolve_plan(self.hparams.get("attn_implementation", "sdpa"))

    @property
    def saves_frozen_weights(self) -> bool:
        """Whether checkpoints hold the frozen base weights (`save_frozen_weights`, default True)."""
        return bool(self.hparams.get("save_frozen_weights", True))

    def configure_model(self) -> None:
        if self.model is not None:
            return
        self._check_frozen_weights_strategy()
        fp8_base_check_device(self.hparams.get("lora"), self.device)  # before the build: never a silent bf16 base
        if self.shards_model:
            lora = self.hparams.get("lora") or {}
            if lora.get("use_dora") or lora.get("init_lora_weights", True) not in (True, False, "gaussian"):
                key = "use_dora" if lora.get("use_dora") else "init_lora_weights"
                raise ConfigError(f"model.lora.{key}", lora[key], "needs the base weights when the adapter is "
                                  "created, which FSDP2Strategy (a meta-device build) does not have; use plain LoRA")
            check_fp8_base_placement(lora, self.trainer.strategy)
            # Sharded: build on meta; the strategy shards, materialises and initialises (parallel/).
            self.model = self.build_model(device="meta")
            self._needs_weight_init = True
        else:
            self.model = self.build_model()
        disable_kv_cache(self.model)

    @property
    def loads_pretrained(self) -> bool:
        """Whether `load_sharded_weights` replaces the weights materialisation draws (a `pretrained` checkpoint)."""
        return self.hparams.get("pretrained") is not None

    def load_sharded_weights(self) -> None:
        """Finish a sharded, materialised model (called by FSDP2Strategy after sharding): load `pretrained`
        into the base weights, then initialise the LoRA adapters as peft does.

        Rank 0 reads the checkpoint through `from_pretrained` (so HF's key mapping applies) and broadcasts;
        each rank keeps only its shards. Materialisation ran HF's `_init_weights` over every Linear, adapters
        included, so without the reset `lora_B` would not start at zero (the model would not start at the base).
        """
        if not getattr(self, "_needs_weight_init", False):
            return
        if self.loads_pretrained:
            self._load_pretrained_into_shards()
        if self.hparams.get("lora"):
            self._reset_lora_adapters(self.hparams.lora.get("init_lora_weights", True))
            self._store_base_in_fp8(self.model)
        self._needs_weight_init = False

    def _reset_lora_adapters(self, init: bool | str) -> None:
        """peft's `init_lora_weights` on every adapter, drawn as one process would draw it: a linear layer's A
        random and B zero, an embedding's A zero and B random."""
        if init is False:  # peft draws nothing: the adapters keep the values materialisation gave them
            return
        from peft.tuners.lora import LoraLayer

        from lightning_ffpa.parallel.strategy import init_as_whole

        with torch.no_grad():
            for module in self.model.modules():
                if isinstance(module, LoraLayer):
                    for adapter in module.lora_A:
                        with init_as_whole([module.lora_A[adapter], module.lora_B[adapter]]):
                            module.reset_lora_parameters(adapter, init)
                    if module.lora_embedding_A:  # an embedding's adapters: parameters of two ParameterDicts
                        with init_as_whole([module.lora_embedding_A, module.lora_embedding_B]):
                            for adapter in module.lora_embedding_A:
                                module.reset_lora_parameters(adapter, init)

    def _load_pretrained_into_shards(self) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        full: dict[str, torch.Tensor] = {}
        if self.global_rank == 0:
            cls = _MODEL_CLASSES[self.model_class_name]
            ref = cls.from_pretrained(self.hparams.pretrained, config=self.config,
                                      dtype=resolve_dtype(self.hparams.get("dtype", "auto"))).state_dict()
            # peft renames wrapped weights (`q_proj.weight` -> `q_proj.base_layer.weight`); adapters are not in `ref`.
            missing = []
            for key in self.hf_model.state_dict():
                if _ADAPTER_KEY.search(key):
                    continue
                key = without_wrapper_levels(key)  # DCP's state-dict helpers name parameters without wrappers
                source = PEFT_LEVEL.sub("", key)
                if source in ref:
                    full[key] = ref[source]
                else:
                    missing.append(source)
            if missing:
                raise RuntimeError(f"`model.pretrained={self.hparams.pretrained!r}` has no weights for {missing[:5]} "
                                   f"({len(missing)} missing)")
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
        set_model_state_dict(self.hf_model, full, options=options)

    @property
    def hf_model(self) -> PreTrainedModel:
        """The underlying HF model (peft wrapper removed)."""
        return unwrap_peft(self.model)

    def _check_frozen_weights_strategy(self) -> None:
        """`save_frozen_weights: false` needs a strategy whose resume this module or FSDP2Strategy completes."""
        if self.saves_frozen_weights or self._trainer is None:
            return
        from lightning_ffpa.parallel import FSDP2Strategy

        strategy = self.trainer.strategy
        if strategy.restore_checkpoint_after_setup and not isinstance(strategy, FSDP2Strategy):
            raise ConfigError(FROZEN_OPTION, False, f"is not supported with {type(strategy).__name__}, which loads "
                              "checkpoints itself; use FSDP2Strategy or a single-device/DDP strategy")

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Name this module's class in the checkpoint (what `lightning-ffpa-export` rebuilds the config with); with
        `save_frozen_weights: false`, leave the frozen base out of the checkpoint and record its digest.

        Collective where the base is sharded (every rank saves). FSDP2Strategy already left the base out of
        the state dict it gathered; the plain strategies' state dict holds references, dropped here.
        """
        checkpoint[MODULE_CLASS_KEY] = f"{type(self).__module__}.{type(self).__qualname__}"
        datamodule = getattr(self._trainer, "datamodule", None)
        tokenizer = getattr(datamodule, "tokenizer_spec", None)
        if isinstance(tokenizer, str) and os.path.isdir(os.path.expanduser(tokenizer)):
            tokenizer = os.path.abspath(os.path.expanduser(tokenizer))  # found from any folder, as `pretrained`
        checkpoint[SOURCES_KEY] = {"cwd": os.getcwd(), "data.tokenizer": tokenizer,
                                   TOKENIZER_DIGEST_KEY: getattr(datamodule, "tokenizer_digest", None)}
        if self.saves_frozen_weights:
            return
        frozen = frozen_names(self)
        if not frozen:
            raise ConfigError(FROZEN_OPTION, False, "this model has no frozen weights to leave out of the checkpoint")
        state = checkpoint.get("state_dict") or {}
        for key in [k for k in state if without_wrapper_levels(k) in frozen]:
            del state[key]
        checkpoint[FROZEN_BASE_KEY] = frozen_record(self)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Refuse (before any weight is loaded) a checkpoint whose architecture options differ from this module's;
        complete a checkpoint saved without the frozen base with this run's rebuilt base, once its digest matches.

        Under FSDP2Strategy the weights are loaded (and the base checked) by the strategy before this hook,
        and the checkpoint it passes holds no `state_dict`.
        """
        fitting = self._trainer is not None and self.trainer.state.fn == "fit"  # else no optimizer is resumed
        check_hparams_match(checkpoint.get("hyper_parameters"), self, "ckpt_path", resume=fitting,
                            saved_class=checkpoint.get(MODULE_CLASS_KEY))
        saved = checkpoint.get(FROZEN_BASE_KEY)
        state = checkpoint.get("state_dict")
        if saved is None or state is None:
            return
        check_frozen_base(saved, self, getattr(self._trainer, "ckpt_path", None))
        # The base's own tensors fill the keys left out: the load copies them onto themselves, and a missing
        # trained weight is still a missing key to the strict load that follows.
        for key, value in self.frozen_base_state(saved).items():
            state.setdefault(key, value)

    def frozen_base_state(self, record: dict[str, Any]) -> dict[str, torch.Tensor]:
        """This module's state-dict entries of the frozen base a checkpoint's `record` digests (what a checkpoint
        saved with `save_frozen_weights: false` leaves out): filled in by a resume, and by the export."""
        return {key: value for key, value in self.state_dict().items()
                if without_wrapper_levels(key) in record["tensors"]}


def check_fp8_base_placement(lora: dict[str, Any] | None, strategy: Any) -> None:
    """`lora.base_dtype: fp8` under FSDP2Strategy keeps the float8 base whole on every rank, out of FSDP2
    (`replicate_frozen`, which "auto" then picks), so a strategy that shards or offloads the base is refused."""
    if (lora or {}).get("base_dtype") != "fp8":
        return
    if getattr(strategy, "replicate_frozen", "auto") is False or getattr(strategy, "cpu_offload", False):
        what = "cpu_offload=true" if getattr(strategy, "cpu_offload", False) else "replicate_frozen=false"
        raise ConfigError("model.lora.base_dtype", "fp8", f"keeps the float8 base whole on every rank's device "
                          f"(not sharded by FSDP2), and the strategy has {what}: drop it, or set base_dtype model")


def check_options_match_checkpoint(given: Any, saved: dict[str, Any] | None, ckpt_path: str, switch: str,
                                   resume: bool = True) -> None:
    """Refuse `model.*` options that differ from those saved in the checkpoint `ckpt_path` (ConfigError).

    Why: with an explicit checkpoint file, LightningCLI re-parses the checkpoint's hyper-parameters over the
    user's `model` options, so a changed option would be replaced silently. `given` is the parsed `model`
    config (`{class_path, init_args}` in subclass mode, or the init args); `switch` names the option that
    takes the checkpoint's values instead. Without `resume` (validate/test/predict: no optimizer is built),
    the class's optimizer and schedule options are not compared.
    """
    if not saved or given is None:
        return
    given = given.as_dict() if hasattr(given, "as_dict") else dict(given)
    init_args = dict(given.get("init_args") or {}) if "class_path" in given else given
    if not resume:
        for key in optimizer_options(given.get("class_path") or saved.get("_class_path")):
            init_args.pop(key, None)
    fix = (f"set it to the checkpoint's value (a `--config` file may be where it comes from), or pass `--{switch} "
           "true` to take the checkpoint's model options")
    saved_class, given_class = saved.get("_class_path"), given.get("class_path")
    if saved_class and given_class and not _same_class(saved_class, given_class):
        raise ConfigError("model.class_path", given_class, f"differs from `ckpt_path={ckpt_path}`, which was "
                                                           f"trained with {saved_class!r}; {fix}")
    diffs = differing_options(saved, init_args or {})
    if diffs:
        key, was, now = diffs[0]
        also = f" (also differ: {', '.join('model.' + k for k, _, _ in diffs[1:])})" if len(diffs) > 1 else ""
        raise ConfigError(f"model.{key}", now, f"differs from `ckpt_path={ckpt_path}`, which has {was!r} and would "
                                               f"replace it silently; {fix}{also}")


def optimizer_options(class_path: str | None) -> tuple[str, ...]:
    """The options of module class `class_path` that only its optimizer and schedule read (none if not found)."""
    try:
        cls = getattr(importlib.import_module(class_path.rsplit(".", 1)[0]), class_path.rsplit(".", 1)[1])
    except (AttributeError, ImportError, ValueError, IndexError):
        return ()
    return (*getattr(cls, "RESUMED_FROM_OPTIMIZER", ()), *getattr(cls, "RESUMED_SCHEDULE", ()))


def _same_class(saved: str, given: str | type) -> bool:
    """Whether import path `saved` names the class `given` (a class or its import path), however it is spelled
    (`lightning_ffpa.Gemma4LM` is `lightning_ffpa.module.Gemma4LM`)."""
    name = given if isinstance(given, str) else f"{given.__module__}.{given.__qualname__}"
    if saved == name:
        return True
    try:
        found = [getattr(importlib.import_module(p.rsplit(".", 1)[0]), p.rsplit(".", 1)[1]) for p in (saved, name)]
    except (ImportError, AttributeError, ValueError, IndexError):
        return False
    return found[0] is found[1]


def _first_lora_difference(was: dict[str, Any], now: dict[str, Any]) -> tuple[str, Any, Any]:
    """The first LoRA sub-option that differs, as (`lora.<name>`, saved, current): canonical values, so one left
    at its default (not stored) shows the default, not None."""
    a, b = canonical_option("lora", was) or {}, canonical_option("lora", now) or {}
    default = LoraSpec()
    for name in sorted(set(a) | set(b)):
        if a.get(name) != b.get(name):
            return f"lora.{name}", a.get(name, getattr(default, name, None)), b.get(name, getattr(default, name, None))
    return "lora", was, now


def check_hparams_match(saved: dict[str, Any] | None, model: Any, option: str = "ckpt_path", *, resume: bool = True,
                        saved_class: str | None = None) -> None:
    """Refuse a checkpoint of another module class (ConfigError), or whose architecture hyper-parameters differ
    from this run's `model.*` (CheckpointError). A resume (`resume`) also refuses another `dtype` (the weights and
    AdamW's state would be converted), and optimizer or schedule options (`model.RESUMED_FROM_OPTIMIZER`,
    `model.RESUMED_SCHEDULE`; ConfigError) that the loaded optimizer and scheduler would not honour; an evaluation
    builds no optimizer, so those are not compared. `saved_class`: the checkpoint's module class, when it names one.
    """
    current = getattr(model, "hparams", None)
    if not saved or current is None:
        return
    check_same_class(saved_class or saved.get("_class_path"), model, option)
    keys = RESUME_HPARAMS if resume else ARCHITECTURE_HPARAMS
    for key, was, now in differing_options(saved, dict(current), keys)[:1]:
        _refuse_other_weights(key, was, now, option, resume)
    if resume:
        _check_optimizer_options(saved, model, option)


def check_same_class(saved_class: str | None, model: Any, option: str = "ckpt_path") -> None:
    """A checkpoint is loaded into the module class it was trained with: first, since another class's options
    differ anyway (a GRPO policy resumed as SFT was refused for its learning rate, and trained once that was set)."""
    if not saved_class or _same_class(saved_class, type(model)):
        return
    given = f"{type(model).__module__}.{type(model).__qualname__}"
    raise ConfigError("model.class_path", given, f"differs from `{option}`, which was trained with {saved_class!r}: "
                                                 "set `model.class_path` to it (a `--config` file may be where this "
                                                 "one comes from), or, to run its weights in this class, export them "
                                                 "(`lightning-ffpa-export`, `--merge_lora` for LoRA) and give the "
                                                 "folder as `model.init_args.pretrained`")


def _refuse_other_weights(key: str, was: Any, now: Any, option: str, resume: bool) -> None:
    """The CheckpointError for an architecture option (or, on a resume, `dtype`) that differs from the checkpoint's."""
    if key == "lora" and isinstance(was, dict) and isinstance(now, dict):
        key, was, now = _first_lora_difference(was, now)
    why = ("its weights were trained from another base" if key == "pretrained" else
           "its adapters were trained with that value" if key.startswith("lora.") and key not in LORA_SHAPES else
           "its weights and optimizer state would be converted to it" if key == "dtype" else
           "the weights would not fit")
    then = ("a resume continues the saved run as it was (start a new run from the exported weights to change it)"
            if resume else "to be evaluated, the checkpoint's model must be built as it was trained (set it back; a "
                           "`--config` file may be where it comes from)")
    raise CheckpointError(f"`{option}` was trained with `model.{key}={was!r}` but this run has "
                          f"`model.{key}={now!r}`: {why}; {then}")


def _check_optimizer_options(saved: dict[str, Any], model: Any, option: str) -> None:
    """A resume loads the optimizer's param groups and the scheduler's step from the checkpoint: another learning
    rate would be ignored silently, another warmup or floor would rebuild the schedule mid-run (the rate jumps)."""
    fix = ("set it back (a `--config` file may be where it comes from), or start a new run from the exported "
           "weights to train with another")
    current = dict(model.hparams)
    for key, was, now in differing_options(saved, current, getattr(model, "RESUMED_FROM_OPTIMIZER", ()))[:1]:
        raise ConfigError(f"model.{key}", now, f"differs from `{option}`, which has {was!r}: the resumed optimizer "
                                               f"keeps the checkpoint's value, so this one would be ignored; {fix}")
    for key, was, now in differing_options(saved, current, getattr(model, "RESUMED_SCHEDULE", ()))[:1]:
        raise ConfigError(f"model.{key}", now, f"differs from `{option}`, which has {was!r}: the resumed "
                                               "learning-rate schedule continues the checkpoint's, and another value "
                                               f"would rebuild it mid-run (the learning rate jumps); {fix}")


def check_data_fits_model(model: Any, datamodule: Any) -> None:
    """Token ids the data can produce must exist in the model's vocabulary (else: an index error mid-step)."""
    data_vocab = getattr(datamodule, "vocab_size", None)
    config = getattr(model, "config", None)
    if data_vocab is None or config is None:
        return
    text = text_config(config)
    if data_vocab > text.vocab_size:
        if getattr(datamodule, "tokenizer", None) is not None:
            raise ConfigError(data_option(datamodule, "tokenizer"), getattr(datamodule, "tokenizer_spec", NOT_GIVEN),
                              f"has {data_vocab} tokens, more than the model's vocab_size={text.vocab_size}: token "
                              "ids would index past the embedding")
        raise ConfigError(data_option(datamodule, "vocab_size"), data_vocab, f"exceeds the model's vocab_size="
                                                                             f"{text.vocab_size}: token ids would "
                                                                             "index past the embedding")
