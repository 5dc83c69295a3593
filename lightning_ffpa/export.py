"""Export a Lightning checkpoint (a `.ckpt` file or a DCP folder) to a Hugging Face model folder.

Owns: reading the model weights out of a checkpoint one shard-sized group of tensors at a time (a `.ckpt`
is memory-mapped; a DCP folder is read key group by key group with DCP, with no process group and without
ever holding the whole model), mapping Lightning/PEFT names to HF names, writing safetensors shards, the
index and `config.json`; LoRA adapters in PEFT format, or merged into the base weights in fp32 (a Linear's weight,
or a 3-D expert stack adapted through `model.lora.target_parameters`, expert by expert, in HF's layout). A float8
base (`model.lora.base_dtype: fp8`) is dequantised (q * its rowwise scales, in fp32) and written in the model's
dtype, merged or beside the adapter, and the command says so.
Does not own training-time saving (`ModelCheckpoint`) or checking the checkpoint (`lightning_ffpa.validation`).

    python -m lightning_ffpa.export CKPT OUT [--merge_lora] [--dtype bfloat16] [--max_shard_size 5GB] [--config DIR]

The checkpoint is verified first (every record's CRC for a `.ckpt`, shard sizes for a DCP folder), and a
`--config` folder must describe the checkpoint's tensors (same names and shapes). Bad input exits with
code 2 and one line (`lightning_ffpa.errors.console_entry`); `--merge-lora`-style spellings also work.

A LoRA checkpoint saved without its frozen base (`model.save_frozen_weights: false`) gets the base rebuilt as a
resume rebuilds it (`rebuilt_base`: from `pretrained`, or the preset under the fit's seed; held in memory), refused
in one line unless its digest is the checkpoint's.

The result loads with `Gemma4ForCausalLM.from_pretrained(OUT)` (`Gemma4ForConditionalGeneration` for a
`model_class: conditional_generation` run; `AutoModelForCausalLM` for either); a LoRA run also writes `OUT/adapter`
(`PeftModel.from_pretrained(base, OUT/adapter)`) unless `--merge_lora`.

Inside a running FSDP2 job, `save_hf_sharded(model, OUT)` writes the same folder straight from the
sharded model: each rank writes its own shards through torch's `HuggingFaceStorageWriter` (no all-gather),
then rank 0 consolidates them file by file.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from lightning_ffpa._compat import torch as torch_compat
from lightning_ffpa._compat.transformers import text_config
from lightning_ffpa.checkpoint.frozen import FROZEN_BASE_KEY, check_frozen_base, under_fit_seed
from lightning_ffpa.cli_checks import check_folder_writable
from lightning_ffpa.data.tokenizer import BYTE_TOKENIZER, TOKENIZER_FILES, load_tokenizer, tokenizer_digest
from lightning_ffpa.dtypes import DtypeName, parse_dtype
from lightning_ffpa.dtypes import choices as dtype_choices
from lightning_ffpa.errors import NOT_GIVEN, CheckpointError, ConfigError, InputError, console_entry
from lightning_ffpa.fp8_base import FP8_DTYPE, dequantize
from lightning_ffpa.lora import PEFT_PREFIX, dora_weight, hf_name, lora_spec, merged_weight, peft_options
from lightning_ffpa.validation import check_checkpoint

MODULE_PREFIX = "model."  # Gemma4LM keeps the HF model in `self.model`
_LORA = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>[AB])\.(?P<adapter>[^.]+)\.weight$")
# DoRA's per-row magnitude; PEFT's adapter file names it without the adapter name and without ".weight"
_MAGNITUDE = re.compile(r"^(?P<module>.+)\.lora_magnitude_vector\.(?P<adapter>[^.]+)\.weight$")


@dataclass
class ExportResult:
    """What was written, for callers and tests."""

    out_dir: Path
    num_tensors: int
    shards: list[str]
    adapter_dir: Path | None = None
    merged: list[str] = field(default_factory=list)
    dequantized: list[str] = field(default_factory=list)  # float8 base weights (`model.lora.base_dtype: fp8`)
    dtype: torch.dtype | None = None  # of the weights written
    tokenizer_from: Path | None = None  # the local folder whose tokenizer files were copied in, if any
    generation_config_from: Path | None = None  # the local folder whose generation_config.json was copied in
    tokenizer_note: str | None = None  # why no tokenizer was written, where one was found but not taken
    special_ids: str | None = None  # the config's special token ids set from the tokenizer's (a preset-built fit)


class _Source:
    """Model tensors of a checkpoint by their Lightning names, read lazily; `.ckpt` file or DCP folder."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.meta = resolve_fit_paths(check_checkpoint(path, "ckpt", resume=False, verify_checksums=True))
        if path.is_dir():
            md = torch_compat.read_dcp_metadata(str(path))
            self._dcp_keys = {k.removeprefix("state_dict."): k for k in md.state_dict_metadata
                              if k.startswith("state_dict.")}
            self.specs = {k: (tuple(md.state_dict_metadata[full].size), md.state_dict_metadata[full].properties.dtype)
                          for k, full in self._dcp_keys.items()}
        else:
            self._state = self.meta["state_dict"]  # memory-mapped: tensors are read when touched
            self.specs = {k: (tuple(v.shape), v.dtype) for k, v in self._state.items() if torch.is_tensor(v)}

        self._added: dict[str, torch.Tensor] = {}

    @property
    def hparams(self) -> dict[str, Any]:
        return dict(self.meta.get("hyper_parameters") or {})

    def add(self, tensors: dict[str, torch.Tensor]) -> None:
        """Serve `tensors` (the rebuilt frozen base) beside the checkpoint's own, which they must not overlap."""
        overlap = sorted(tensors.keys() & self.specs.keys())
        if overlap:
            raise CheckpointError(f"`ckpt={str(self.path)!r}` holds `{overlap[0]}`, a frozen weight it records as "
                                  "left out (`model.save_frozen_weights=false`); the checkpoint is inconsistent")
        self._added.update(tensors)
        self.specs.update({k: (tuple(v.shape), v.dtype) for k, v in tensors.items()})

    def load(self, keys: list[str]) -> dict[str, torch.Tensor]:
        out = {k: self._added[k] for k in keys if k in self._added}
        keys = [k for k in keys if k not in self._added]
        if not self.path.is_dir():
            return {**out, **{k: self._state[k] for k in keys}}
        loaded = torch_compat.load_dcp_keys(str(self.path), {self._dcp_keys[k] for k in keys}) if keys else {}
        flat = dict(_flatten(loaded))
        return {**out, **{k: flat[self._dcp_keys[k]] for k in keys}}


def resolve_fit_paths(meta: dict[str, Any]) -> dict[str, Any]:
    """`meta` with the fit's relative `model.pretrained` and `data.tokenizer` made absolute against the folder the fit
    ran in (the checkpoint's `fit_sources`), where that path exists: an export run elsewhere reads the same files,
    instead of asking the Hub for a name like `exp1`."""
    from lightning_ffpa.hf_module import SOURCES_KEY

    sources = dict(meta.get(SOURCES_KEY) or {})
    cwd = sources.get("cwd")

    def resolved(value: Any) -> Any:
        if not isinstance(cwd, str) or not isinstance(value, str) or Path(value).expanduser().is_absolute():
            return value
        there = Path(cwd) / value
        return str(there) if there.exists() else value

    hparams = dict(meta.get("hyper_parameters") or {})
    if "pretrained" in hparams:
        hparams["pretrained"] = resolved(hparams["pretrained"])
    sources["data.tokenizer"] = resolved(sources.get("data.tokenizer"))
    return {**meta, "hyper_parameters": hparams, SOURCES_KEY: sources}


def _flatten(tree: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _flatten(v, f"{prefix}{k}.")
    else:
        yield prefix[:-1], tree


# The module classes a checkpoint without a class path can come from (written before the path was saved).
_KNOWN_MODULES = ("lightning_ffpa.module.Gemma4LM", "lightning_ffpa.rl.module.GRPOModule")


def _import_class(path: str):
    import importlib

    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def module_class_path(meta: dict[str, Any]) -> str:
    """The LightningModule class a checkpoint was trained with.

    LightningCLI saves it as the `_class_path` hyper-parameter, `HFModule.on_save_checkpoint` as `module_class`;
    an older checkpoint with neither is matched to the one known module whose constructor takes all its
    hyper-parameters.
    """
    from lightning_ffpa.hf_module import MODULE_CLASS_KEY

    hparams = meta.get("hyper_parameters") or {}
    path = hparams.get("_class_path") or meta.get(MODULE_CLASS_KEY)
    if path:
        return path
    import inspect

    given = {k for k in hparams if not k.startswith("_")}
    fits = [p for p in _KNOWN_MODULES if given <= set(inspect.signature(_import_class(p)).parameters)]
    if len(fits) != 1:
        raise CheckpointError(f"the checkpoint does not name its module class and its hyper-parameters "
                              f"{sorted(given)} fit {len(fits)} of {list(_KNOWN_MODULES)}; pass `--config DIR` "
                              "(an HF config folder)")
    return fits[0]


def build_module(meta: dict[str, Any]):
    """The checkpoint's module class built from its hyper-parameters: its HF config, no weights yet."""
    from lightning_ffpa.hf_module import HFModule

    kwargs = {k: v for k, v in (meta.get("hyper_parameters") or {}).items() if not k.startswith("_")}
    if not kwargs:
        raise ValueError("the checkpoint has no `hyper_parameters`; pass `--config DIR` (an HF config folder)")
    path = module_class_path(meta)
    try:
        cls = _import_class(path)
    except (ImportError, AttributeError, ValueError) as err:
        raise CheckpointError(f"cannot import {path!r}, the module class the checkpoint was trained with "
                              f"({type(err).__name__}: {err}); install it, or pass `--config DIR`") from err
    if not (isinstance(cls, type) and issubclass(cls, HFModule)):
        raise CheckpointError(f"the checkpoint's module class {path!r} does not build its model from the shared "
                              "model options (not an HFModule); pass `--config DIR` (an HF config folder)")
    return cls(**kwargs)


def model_config(meta: dict[str, Any], config_dir: str | None = None):
    """The HF config of the checkpoint's model: from `config_dir`, or rebuilt by the checkpoint's module class."""
    if config_dir is not None:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(config_dir)
    return build_module(meta).config  # reads the config only; builds no weights


def rebuilt_base(meta: dict[str, Any], ckpt: str | Path) -> dict[str, torch.Tensor]:
    """The frozen base a checkpoint saved with `model.save_frozen_weights: false` was trained over, by Lightning
    name: rebuilt on CPU under the fit's seed (the checkpoint's module class from its hyper-parameters), and refused
    in one line unless its digest is the checkpoint's. A random base is drawn in two orders: as one process builds
    the model (`_whole_build`), or as FSDP2Strategy materialises it on meta, adapters interleaved
    (`_materialized_build`); both are tried, in that order."""
    record = meta[FROZEN_BASE_KEY]
    hparams = meta.get("hyper_parameters") or {}
    if hparams.get("pretrained") is not None:
        rebuilt = f"the one export loaded from `model.pretrained={hparams['pretrained']!r}`"
        fix = "restore the weights the fit read there, or export a checkpoint saved with the base"
        builds = (_whole_build,)
    else:
        rebuilt = (f"the ones export drew on CPU from `model.preset={hparams.get('preset')!r}` under the fit's "
                   f"`seed_everything={record.get('seed')}` (as one process builds it, and as FSDP2Strategy "
                   "materialises it)")
        fix = "a fit on GPU draws another; export a checkpoint saved with the base (`model.save_frozen_weights: true`)"
        builds = (_whole_build, _materialized_build)
    *earlier, last = builds
    for build in earlier:
        with under_fit_seed(record):
            module = build(meta)
        try:
            check_frozen_base(record, module, ckpt, "ckpt", rebuilt=rebuilt, fix=fix)
            return module.frozen_base_state(record)
        except ConfigError:
            module = None  # drawn in the other order: freed before the next build (a whole base on CPU)
    with under_fit_seed(record):
        module = last(meta)
    check_frozen_base(record, module, ckpt, "ckpt", rebuilt=rebuilt, fix=fix)  # the refusal names both builds
    return module.frozen_base_state(record)


def _whole_build(meta: dict[str, Any]):
    """The checkpoint's module with its whole model on CPU, as a single-device fit or resume builds it."""
    module = build_module(meta)
    module.model = module.build_model(announce=False)  # `configure_model`'s build, without the fit's log lines
    return module


def _materialized_build(meta: dict[str, Any]):
    """The checkpoint's module with its model built on meta and materialised on CPU as FSDP2Strategy does (each
    tensor drawn whole, in module order), which draws a random base in another order than `_whole_build`."""
    from lightning_ffpa.parallel.strategy import materialize

    module = build_module(meta)
    module.model = module.build_model("meta", announce=False)
    materialize(module.model, torch.device("cpu"))
    module._needs_weight_init = True  # as `configure_model` sets it for a sharded build
    module.load_sharded_weights()  # what the strategy runs next: the adapters reset, a float8 base stored
    return module


@dataclass
class _Plan:
    """HF name -> Lightning names it is made from ([weight] or [base weight, lora_A, lora_B])."""

    base: dict[str, list[str]]
    adapter: dict[str, str]  # PEFT adapter name -> Lightning name
    untie: bool = False  # a tied model whose head training made its own: written as its own tensor


_HEAD = "lm_head.weight"


def adapted_parameters(meta: dict[str, Any]) -> dict[str, str]:
    """peft module name -> the parameter its LoRA adapts, for the `target_parameters` adapters (peft's
    `ParamWrapper`s, nested one per parameter: their names in a checkpoint do not say which parameter each one
    adapts). Read from the checkpoint's module built on meta; empty without `target_parameters`."""
    if not (lora_spec(meta.get("hyper_parameters") or {}) or {}).get("target_parameters"):
        return {}
    model = build_module(meta).build_model(device="meta", announce=False)
    return {name: module.parameter_name for name, module in model.named_modules()
            if isinstance(getattr(module, "parameter_name", None), str) and hasattr(module, "lora_A")}


def _plan(names: list[str], tied: bool, merge: bool, params: dict[str, str] | None = None) -> _Plan:
    """`params`: `adapted_parameters` (which parameter each parameter adapter adapts)."""
    params = params or {}
    base: dict[str, list[str]] = {}
    adapter: dict[str, str] = {}
    loras: dict[str, dict[str, str]] = {}
    saved_whole = []  # `modules_to_save` copies: trained whole, beside the LoRA
    for name in names:
        if not name.startswith(MODULE_PREFIX):
            continue  # metrics or other module state, not model weights
        inner = name[len(MODULE_PREFIX):]
        if "lora_embedding" in inner:
            raise CheckpointError(f"cannot export {inner}: export writes LoRA on Linear layers only (not LoRA on "
                                  "the embedding)")
        if ".original_module." in inner:
            continue  # the frozen original of a `modules_to_save` module: its trained copy is what ran
        if ".modules_to_save." in inner:
            if not merge:
                raise CheckpointError(f"cannot export {inner} as an adapter: the run trained whole modules beside "
                                      "its LoRA (`model.lora.modules_to_save`); export it with --merge_lora")
            saved_whole.append(hf_name(inner))
        if inner.startswith(PEFT_PREFIX):
            match = _LORA.match(inner)
            if match:
                module = match["module"].removeprefix(PEFT_PREFIX)
                loras.setdefault(module, {})[match["ab"]] = name
                adapter[f"{match['module']}.lora_{match['ab']}.weight"] = name  # PEFT drops the adapter name
                continue
            match = _MAGNITUDE.match(inner)
            if match:
                loras.setdefault(match["module"].removeprefix(PEFT_PREFIX), {})["M"] = name
                adapter[f"{match['module']}.lora_magnitude_vector"] = name
                continue
            inner = hf_name(inner)
        elif "lora_" in inner:
            raise ValueError(f"unexpected LoRA tensor outside a PEFT model: {name}")
        base[inner] = [name]
    # A tied head stays tied unless training gave it (or the embedding) weights of its own.
    untie = tied and merge and (any(n in (_HEAD, "model.embed_tokens.weight") for n in saved_whole)
                                or "lm_head" in loras)
    if tied and not untie:
        base.pop(_HEAD, None)  # tied to embed_tokens; from_pretrained re-ties it
    if merge:
        for module, ab in loras.items():
            wrapped = PEFT_PREFIX + module
            weight = hf_name(f"{wrapped}.{params[wrapped]}") if wrapped in params else f"{module}.weight"
            base[weight] += [ab["A"], ab["B"], *([ab["M"]] if "M" in ab else [])]  # M: DoRA's magnitude
        adapter = {}
    return _Plan(base, adapter, untie)


def _split(names: dict[str, tuple[tuple[int, ...], torch.dtype]], max_shard_size: str | int, option: str):
    """huggingface_hub's shard split over meta tensors of the given shapes (nothing is read to plan it)."""
    from huggingface_hub import split_torch_state_dict_into_shards

    meta = {n: torch.empty(shape, dtype=dtype, device="meta") for n, (shape, dtype) in names.items()}
    try:
        split = split_torch_state_dict_into_shards(meta, max_shard_size=max_shard_size)
    except ValueError as err:
        raise ConfigError(option, max_shard_size, f"must look like 500MB or 5GB ({err})") from err
    number = re.match(r"\s*(-?\d+(?:\.\d+)?)", str(max_shard_size))
    if number and float(number[1]) <= 0:  # huggingface_hub splits these one tensor per file
        raise ConfigError(option, max_shard_size, "must be a size above zero, like 500MB or 5GB")
    return split


def model_class(hparams: dict[str, Any]) -> str:
    """The HF class the checkpoint's module built (its `model_class` hyper-parameter)."""
    return {"conditional_generation": "Gemma4ForConditionalGeneration"}.get(hparams.get("model_class"),
                                                                          "Gemma4ForCausalLM")


def check_config_matches(config, hparams: dict[str, Any], shapes: dict[str, tuple[int, ...]], tied: bool,
                         option: str, value: Any) -> None:
    """The HF model `config` describes must have exactly the checkpoint's tensors (names and shapes)."""
    import transformers

    name = model_class(hparams)
    cls = getattr(transformers, name)
    model_type = getattr(text_config(config), "model_type", "") or ""
    if not model_type.startswith("gemma4"):
        raise ConfigError(option, value, f"is a {model_type or 'non-Gemma4'} config ({type(config).__name__}); the "
                          f"checkpoint is a {name}")
    multimodal = text_config(config) is not config
    if multimodal != (name == "Gemma4ForConditionalGeneration"):
        raise ConfigError(option, value, f"is a {'multimodal' if multimodal else 'text-only'} config "
                          f"({type(config).__name__}), the checkpoint a {name} (its `model.model_class`="
                          f"{hparams.get('model_class') or 'causal_lm'}); give a config of that kind")
    try:
        with torch.device("meta"):  # shapes only: no memory, no init
            expected = {k: tuple(v.shape) for k, v in cls(config).state_dict().items()}
    except Exception as err:  # noqa: BLE001 - any failure to build is the same user-facing problem
        raise ConfigError(option, value, f"cannot build {name} from it ({type(err).__name__}: {err})") from err
    if tied:
        expected.pop("lm_head.weight", None)
    wrong = [f"`{k}` is {shapes[k]} in the checkpoint but {expected[k]} for this config"
             for k in shapes if k in expected and expected[k] != shapes[k]]
    wrong += [f"the checkpoint has `{k}`, this config does not" for k in shapes if k not in expected]
    wrong += [f"this config has `{k}`, the checkpoint does not" for k in expected if k not in shapes]
    if wrong:
        raise ConfigError(option, value, f"does not match the checkpoint's tensors: {len(wrong)} differ, "
                                         f"e.g. {wrong[0]}")


def export(ckpt: str | Path, out_dir: str | Path, *, merge_lora: bool = False, dtype: str | None = None,
           max_shard_size: str = "5GB", config_dir: str | None = None) -> ExportResult:
    """Write the checkpoint's model as an HF folder (and its LoRA adapter in PEFT format, unless merged)."""
    target = parse_dtype("--dtype", dtype, allow_auto=False, allow_none=True)  # checked before any file is written
    out = Path(out_dir)
    # the cheap option checks come before the checkpoint is read; a file where the folder goes first
    blocking = next((p for p in (out, *out.parents) if p.exists() and not p.is_dir()), None)
    if blocking is not None:
        raise ConfigError("out", str(out), f"cannot be created: {str(blocking)!r} is a file, not a folder")
    check_folder_writable(out, "out")  # read-only, or a place no folder can go (`/proc/x`): before the read
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"`out={str(out)!r}` exists and is not empty; choose a new folder")
    if config_dir is not None and not (Path(config_dir) / "config.json").is_file():
        raise ConfigError("--config", config_dir, "is not a folder with a config.json (an HF config folder)")
    _split({}, max_shard_size, "--max_shard_size")
    source = _Source(Path(ckpt))
    hparams = source.hparams
    lora = lora_spec(hparams)
    if merge_lora and not lora:  # from the hyper-parameters alone: before the module class is resolved
        raise ConfigError("--merge_lora", True, "the checkpoint has no `model.lora` options (lightning-ffpa's "
                          "LoRA hyper-parameter), so there is nothing to merge by")
    config = model_config(source.meta, config_dir)
    text = text_config(config)
    tied = bool(getattr(text, "tie_word_embeddings", False))
    if source.meta.get(FROZEN_BASE_KEY) is not None:  # an adapter-only checkpoint: the base is rebuilt, checked
        source.add(rebuilt_base(source.meta, ckpt))
    params = adapted_parameters(source.meta) if merge_lora else {}
    plan = _plan(sorted(source.specs), tied=tied, merge=merge_lora, params=params)
    if plan.adapter and not lora:  # before anything is written: peft's adapter_config comes from these options
        raise ConfigError("ckpt", str(ckpt), f"holds {len(plan.adapter)} LoRA tensors but no `model.lora` options "
                          "(lightning-ffpa's LoRA hyper-parameter) to describe them; export a module of your own "
                          "with peft's `save_pretrained`")
    scales = _float8_scales(plan)  # HF weight -> its rowwise scales' Lightning name (`lora.base_dtype: fp8`)
    # The model's own dtype (its norms and embeddings): what a float8 base weight is dequantised to.
    model_dtype = next(dt for src in plan.base.values() if (dt := source.specs[src[0]][1]) != FP8_DTYPE)
    if plan.untie:
        tied = text.tie_word_embeddings = config.tie_word_embeddings = False
    check_config_matches(config, hparams, {hf: source.specs[src[0]][0] for hf, src in plan.base.items()}, tied,
                         *(("--config", config_dir) if config_dir else ("ckpt", str(ckpt))))
    scaling = _lora_scaling(lora) if lora else 1.0
    split = _split({hf: (source.specs[src[0]][0], target or (model_dtype if hf in scales else source.specs[src[0]][1]))
                    for hf, src in plan.base.items()}, max_shard_size, "--max_shard_size")

    out.mkdir(parents=True, exist_ok=True)
    names = list(split.filename_to_tensors)
    weight_map, total, merged, dequantized = {}, 0, [], []
    for file_name, group in split.filename_to_tensors.items():
        wanted = [src for hf in group for src in (*plan.base[hf], *([scales[hf]] if hf in scales else []))]
        loaded = source.load(wanted)  # one shard's worth of tensors at a time
        tensors = {}
        for hf in group:
            srcs = plan.base[hf]
            weight = loaded[srcs[0]]
            keep = weight.dtype
            if hf in scales:  # a float8 base: W0 = q * scale, in fp32, then the model's dtype
                weight, keep = dequantize(weight, loaded[scales[hf]], torch.float32), model_dtype
                dequantized.append(hf)
            if len(srcs) >= 3:  # merge in fp32, then back to the weight's dtype
                a, b = loaded[srcs[1]].float(), loaded[srcs[2]].float()
                weight = merged_weight(weight.float(), a, b, scaling)
                if len(srcs) == 4:
                    weight = dora_weight(weight, loaded[srcs[3]].float())
                merged.append(hf)
            weight = weight.to(keep)
            weight = weight.to(target) if target is not None else weight
            tensors[hf] = weight.contiguous().clone()  # safetensors needs owned, non-shared storage
            weight_map[hf] = file_name
            total += tensors[hf].numel() * tensors[hf].element_size()
        _save_safetensors(tensors, out / file_name)
        del tensors, loaded
    if split.is_sharded:
        (out / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    save_dtype = target or model_dtype
    config.dtype = save_dtype
    config.architectures = [model_class(hparams)]  # what AutoModel* and pipelines build
    tokenizer_from, tokenizer_note = _copy_tokenizer(source.meta, hparams, config_dir, out)
    # a preset's config keeps Gemma4's ids (eos 1), which mean other tokens in the fit's own tokenizer
    special_ids = _special_ids_from_tokenizer(config, out) if tokenizer_from and not (
        config_dir or hparams.get("pretrained")) else None
    config.save_pretrained(out)
    generation_from = _copy_generation_config(source.meta, hparams, config_dir, out)
    adapter_dir = None
    if plan.adapter:
        adapter_dir = out / "adapter"
        # absolute: peft resolves the base from wherever the adapter is loaded, a relative path from the cwd
        _export_adapter(source, plan.adapter, lora, adapter_dir, base=str(out.resolve()))
    return ExportResult(out, len(weight_map), names, adapter_dir, merged, dequantized, save_dtype, tokenizer_from,
                        generation_from, tokenizer_note, special_ids)


# What `AutoTokenizer.from_pretrained` reads from a model folder beside the weights.
TOKENIZER_SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
                        "added_tokens.json", "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json")
GENERATION_CONFIG = "generation_config.json"  # `generate`'s defaults (eos ids, e.g. a chat model's end of turn)


def _local_folders(meta: dict[str, Any], hparams: dict[str, Any], config_dir: str | None, *keys: str) -> list[Path]:
    """The existing local folders among `--config` and the fit's recorded sources, in the order of `keys`."""
    from lightning_ffpa.hf_module import SOURCES_KEY

    named = {"config": config_dir, "data.tokenizer": (meta.get(SOURCES_KEY) or {}).get("data.tokenizer"),
             "pretrained": hparams.get("pretrained")}
    folders = [Path(named[k]).expanduser() for k in keys if isinstance(named[k], str)]
    return [f for f in folders if f.is_dir()]


def _copy_tokenizer(meta: dict[str, Any], hparams: dict[str, Any], config_dir: str | None,
                    out: Path) -> tuple[Path | None, str | None]:
    """Copy the tokenizer into `out` from the first local folder holding the one the fit trained with: `--config`,
    the fit's `data.tokenizer`, then `model.pretrained` (a hub id is not fetched). Returns (folder or None, why
    none where one was found but not taken): a checkpoint records its tokenizer's digest, and a folder whose
    tokenizer means other ids (a pretrained model's own, beside a fit on the byte tokenizer) is not written."""
    import shutil

    from lightning_ffpa.hf_module import SOURCES_KEY, TOKENIZER_DIGEST_KEY

    trained_with = (meta.get(SOURCES_KEY) or {}).get(TOKENIZER_DIGEST_KEY)
    if trained_with == BYTE_TOKENIZER:
        return None, ("the fit's data used the byte tokenizer (`data.tokenizer: byte`): its ids are bytes, which no "
                      "Hugging Face tokenizer file describes")
    note = None
    for folder in _local_folders(meta, hparams, config_dir, "config", "data.tokenizer", "pretrained"):
        if not any((folder / f).is_file() for f in TOKENIZER_FILES):
            continue
        if trained_with is not None:
            try:
                digest = tokenizer_digest(load_tokenizer(str(folder)))
            except Exception as err:  # an unreadable folder is not the fit's tokenizer either
                digest = f"unreadable ({type(err).__name__})"
            if digest != trained_with:
                note = note or (f"{folder}'s tokenizer is not the one the fit trained with (digest {digest}, the "
                                f"checkpoint's {trained_with})")
                continue
        for name in TOKENIZER_SIDE_FILES:
            if (folder / name).is_file():
                shutil.copyfile(folder / name, out / name)
        return folder, None
    return None, note


def _special_ids_from_tokenizer(config: Any, out: Path) -> str | None:
    """Set the config's bos/eos/pad ids (and its text config's) to those of the tokenizer copied into `out`, so that
    `generate` stops at the tokenizer's eos; returns what changed ("eos_token_id 1 -> 3, ..."), or None."""
    tokenizer = load_tokenizer(str(out), option="out")
    changed = []
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        want, have = getattr(tokenizer, key, None), getattr(config, key, None)
        if want is None or want == have or (isinstance(have, list) and want in have):
            continue
        for cfg in {id(c): c for c in (config, text_config(config))}.values():
            setattr(cfg, key, want)
        changed.append(f"{key} {have} -> {want}")
    return ", ".join(changed) or None


def _copy_generation_config(meta: dict[str, Any], hparams: dict[str, Any], config_dir: str | None,
                            out: Path) -> Path | None:
    """Copy `generation_config.json` from the model's folder (`--config`, then `model.pretrained`; then the
    tokenizer's folder), wherever the tokenizer came from: without it `generate` stops at `config.json`'s eos
    alone (a chat model's end-of-turn id is in the generation config)."""
    import shutil

    for folder in _local_folders(meta, hparams, config_dir, "config", "pretrained", "data.tokenizer"):
        if (folder / GENERATION_CONFIG).is_file():
            shutil.copyfile(folder / GENERATION_CONFIG, out / GENERATION_CONFIG)
            return folder
    return None


def _float8_scales(plan: _Plan) -> dict[str, str]:
    """Take the rowwise scales of float8 base weights out of `plan.base` (HF has no such tensor): HF weight name ->
    the scales' Lightning name, for the weights the export dequantises."""
    scales = {}
    for hf in [k for k in plan.base if k.endswith(".weight_scale")]:
        weight = hf.removesuffix("_scale")
        if weight in plan.base:
            scales[weight] = plan.base.pop(hf)[0]
    return scales


def _save_safetensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """`save_file`, then the mode a new file gets under the umask (0644 under 022): safetensors creates its
    files 0600, which the rest of a cluster group cannot read, while `config.json` beside it is 0644."""
    save_file(tensors, str(path), metadata={"format": "pt"})
    umask = os.umask(0o077)  # reading the umask means setting it; restored at once
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def _lora_scaling(lora: dict[str, Any]) -> float:
    """The factor B@A is scaled by, as peft computes it (alpha/r, or alpha/sqrt(r) with rsLoRA)."""
    from peft import LoraConfig, get_peft_model

    for unsupported in ("rank_pattern", "alpha_pattern"):
        if lora.get(unsupported):
            raise ConfigError("--merge_lora", True, f"merging with `model.lora.{unsupported}` is not supported; "
                                                    "export the adapter instead")
    keep = ("r", "lora_alpha", "use_rslora")
    probe = get_peft_model(torch.nn.Sequential(torch.nn.Linear(1, 1, device="meta")),
                           LoraConfig(target_modules=["0"], **{k: lora[k] for k in keep if k in lora}))
    return float(probe.base_model.model[0].scaling["default"])


def _export_adapter(source: _Source, names: dict[str, str], lora: dict[str, Any], out: Path, base: str) -> None:
    from peft import LoraConfig

    out.mkdir(parents=True)
    loaded = source.load(list(names.values()))
    _save_safetensors({peft: loaded[src].contiguous().clone() for peft, src in names.items()},
                      out / "adapter_model.safetensors")
    spec = {"task_type": "CAUSAL_LM", **peft_options(lora), "base_model_name_or_path": base}
    LoraConfig(**spec).save_pretrained(str(out))


def save_hf_sharded(model: torch.nn.Module, out_dir: str | Path, *, max_shard_size: str = "5GB",
                    keep_rank_shards: bool = False) -> Path:
    """Write an (FSDP2-sharded) HF model as an HF folder from inside the job; call it on every rank.

    No rank gathers the model: each writes its DTensor shards, then rank 0 merges them per output file.
    LoRA (PEFT) models are refused: export their checkpoint with `export(...)` instead.
    """
    import shutil

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    if hasattr(model, "peft_config"):
        raise TypeError("save_hf_sharded does not take PEFT models; save a checkpoint and run the export on it")
    out = Path(out_dir)
    state = get_model_state_dict(model)  # DTensor shards stay sharded
    if getattr(model.config.get_text_config(), "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    # global shapes: the same split on every rank
    split = _split({n: (tuple(t.shape), t.dtype) for n, t in state.items()}, max_shard_size, "max_shard_size")
    index = {n: i for i, names in enumerate(split.filename_to_tensors.values(), 1) for n in names}
    writer = torch_compat.hf_storage_writer(str(out), fqn_to_index_mapping=index, save_distributed=True,
                                       enable_consolidation=True)
    dcp.save(state, storage_writer=writer)
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    if rank0:
        config = model.config
        config.dtype = next(iter(state.values())).dtype
        config.save_pretrained(out)
        if not keep_rank_shards:
            shutil.rmtree(out / "sharded", ignore_errors=True)
    if dist.is_initialized():
        dist.barrier()
    return out


def command(ckpt: str, out: str, merge_lora: bool = False,
            dtype: DtypeName | None = None, max_shard_size: str = "5GB",
            config: str | None = None) -> ExportResult:
    """Export a Lightning checkpoint (a .ckpt file or a DCP folder) to a Hugging Face model folder.

    Args:
        ckpt: Lightning checkpoint: a .ckpt file or a DCP folder (FSDP2 ModelCheckpoint).
        out: New folder for the HF model (config.json + safetensors).
        merge_lora: Merge LoRA into the weights (fp32 math) instead of writing OUT/adapter.
        dtype: Cast the weights (default: as stored).
        max_shard_size: Largest safetensors file, e.g. 500MB or 5GB (decimal units, as huggingface_hub).
        config: HF config folder (default: rebuilt from the checkpoint's hyper-parameters); must match its tensors.
    """
    result = export(ckpt, out, merge_lora=merge_lora, dtype=dtype, max_shard_size=max_shard_size, config_dir=config)
    print(f"wrote {result.num_tensors} tensors in {len(result.shards)} file(s) to {result.out_dir}"
          + (f"; adapter in {result.adapter_dir}" if result.adapter_dir else "")
          + (f"; dequantised {len(result.dequantized)} float8 base weights (model.lora.base_dtype fp8) to "
             f"{str(result.dtype).removeprefix('torch.')}" if result.dequantized else "")
          + (f"; merged LoRA into {len(result.merged)} weights" if result.merged else "")
          + (f"; tokenizer from {result.tokenizer_from}" if result.tokenizer_from else
             f"; no tokenizer: {result.tokenizer_note}" if result.tokenizer_note else "; no tokenizer: neither "
             "--config, the fit's data.tokenizer nor model.pretrained is a local folder holding one")
          + (f"; {GENERATION_CONFIG} from {result.generation_config_from}"
             if result.generation_config_from not in (None, result.tokenizer_from) else "")
          + (f"; config.json's special ids set from the tokenizer (the model was built from a preset): "
             f"{result.special_ids}" if result.special_ids else ""))
    return result


def _parser():
    from jsonargparse import ActionYesNo, ArgumentParser

    parser = ArgumentParser(prog="lightning-ffpa-export", description=command.__doc__.split("\n")[0],
                            exit_on_error=False)
    parser.add_function_arguments(command, as_positional=True, skip={"merge_lora"})
    parser.add_argument("--merge_lora", action=ActionYesNo, default=False,
                        help="Merge LoRA into the weights (fp32 math) instead of writing OUT/adapter.")
    return parser


def _snake(arg: str) -> str:
    """`--merge-lora` -> `--merge_lora` (the option names; values are left alone)."""
    if not arg.startswith("--"):
        return arg
    name, eq, value = arg[2:].partition("=")
    return "--" + name.replace("-", "_") + eq + value


def _value(argv: list[str], option: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg.startswith(option + "="):
            return arg.split("=", 1)[1]
        if arg == option and i + 1 < len(argv):
            return argv[i + 1]
    return None


def run(argv: list[str]) -> ExportResult:
    """Parse `argv` (jsonargparse over `command`'s signature) and export."""
    from argparse import ArgumentError

    argv = [_snake(a) for a in argv]
    try:
        args = _parser().parse_args(argv)
    except ArgumentError as err:
        key = re.match(r'Parser key "(\w+)"', str(err))
        if key:  # jsonargparse's type errors run over many lines; name the option and its allowed values
            hint = f"must be one of {dtype_choices(allow_auto=False)}" if key[1] == "dtype" else f"is not a valid {key[1]}"
            raise ConfigError(f"--{key[1]}", _value(argv, f"--{key[1]}"), hint) from err
        first = str(err).splitlines()[0]
        if opt := re.match(r"argument (--\w+): (.*)", first):  # argparse's own words, e.g. "expected one argument"
            dash = " (a value starting with `-` needs the `=` form)" if "expected one argument" in first else ""
            raise ConfigError(opt[1], NOT_GIVEN, f"{opt[2]}{dash}") from err
        if missing := re.match(r"the following arguments are required: (\w+)", first):
            raise ConfigError(missing[1], NOT_GIVEN, "is required (`lightning-ffpa-export CKPT OUT`)") from err
        raise InputError(f"lightning-ffpa-export: {first}") from err
    return command(**{k: args[k] for k in ("ckpt", "out", "merge_lora", "dtype", "max_shard_size", "config")})


def main() -> int:
    """Console script `lightning-ffpa-export` / `python -m lightning_ffpa.export`: exit 0, or 2 with one line."""
    return console_entry(run, user_errors=(CheckpointError, FileExistsError))


if __name__ == "__main__":
    sys.exit(main())
