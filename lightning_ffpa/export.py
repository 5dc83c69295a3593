"""Export a Lightning checkpoint (a `.ckpt` file or a DCP folder) to a Hugging Face model folder.

Owns: reading the model weights out of a checkpoint one shard-sized group of tensors at a time (a `.ckpt`
is memory-mapped; a DCP folder is read key group by key group with DCP, with no process group and without
ever holding the whole model), mapping Lightning/PEFT names to HF names, writing safetensors shards, the
index and `config.json`; LoRA adapters in PEFT format, or merged into the base weights in fp32.
Does not own training-time saving (`ModelCheckpoint`) or checking the checkpoint (`lightning_ffpa.validation`).

    python -m lightning_ffpa.export CKPT OUT [--merge-lora] [--dtype bfloat16] [--max-shard-size 5GB]

The result loads with `Gemma4ForCausalLM.from_pretrained(OUT)`; a LoRA run also writes `OUT/adapter`
(`PeftModel.from_pretrained(base, OUT/adapter)`) unless `--merge-lora`.

Inside a running FSDP2 job, `save_hf_sharded(model, OUT)` writes the same folder straight from the
sharded model: each rank writes its own shards through torch's `HuggingFaceStorageWriter` (no all-gather),
then rank 0 consolidates them file by file.
"""

from __future__ import annotations

import json
import math
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from lightning_ffpa.checkpoint import _compat
from lightning_ffpa.errors import ArgumentParser, ConfigError, InputError, console_entry
from lightning_ffpa.validation import check_checkpoint

MODULE_PREFIX = "model."  # Gemma4LM keeps the HF model in `self.model`
PEFT_PREFIX = "base_model.model."  # PeftModel -> LoraModel -> HF model
_LORA = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>[AB])\.(?P<adapter>[^.]+)\.weight$")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class ExportResult:
    """What was written, for callers and tests."""

    out_dir: Path
    num_tensors: int
    shards: list[str]
    adapter_dir: Path | None = None
    merged: list[str] = field(default_factory=list)


class _Source:
    """Model tensors of a checkpoint by their Lightning names, read lazily; `.ckpt` file or DCP folder."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.meta = check_checkpoint(path, "checkpoint", resume=False, verify_checksums=False)
        if path.is_dir():
            md = _compat.read_dcp_metadata(str(path))
            self._dcp_keys = {k.removeprefix("state_dict."): k for k in md.state_dict_metadata
                              if k.startswith("state_dict.")}
            self.specs = {k: (tuple(md.state_dict_metadata[full].size), md.state_dict_metadata[full].properties.dtype)
                          for k, full in self._dcp_keys.items()}
        else:
            self._state = self.meta["state_dict"]  # memory-mapped: tensors are read when touched
            self.specs = {k: (tuple(v.shape), v.dtype) for k, v in self._state.items() if torch.is_tensor(v)}

    @property
    def hparams(self) -> dict[str, Any]:
        return dict(self.meta.get("hyper_parameters") or {})

    def load(self, keys: list[str]) -> dict[str, torch.Tensor]:
        if not self.path.is_dir():
            return {k: self._state[k] for k in keys}
        loaded = _compat.load_dcp_keys(str(self.path), {self._dcp_keys[k] for k in keys})
        flat = dict(_flatten(loaded))
        return {k: flat[self._dcp_keys[k]] for k in keys}


def _flatten(tree: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _flatten(v, f"{prefix}{k}.")
    else:
        yield prefix[:-1], tree


def model_config(hparams: dict[str, Any], config_dir: str | None = None):
    """The HF config of the checkpoint's model: from `config_dir`, or rebuilt from the module hyper-parameters."""
    if config_dir is not None:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(config_dir)
    from lightning_ffpa.module import Gemma4LM

    kwargs = {k: v for k, v in hparams.items() if not k.startswith("_")}
    if not kwargs:
        raise InputError("the checkpoint has no `hyper_parameters`; pass `--config DIR` (an HF config folder)")
    return Gemma4LM(**kwargs).config  # reads the config only; builds no weights


@dataclass
class _Plan:
    """HF name -> Lightning names it is made from ([weight] or [base weight, lora_A, lora_B])."""

    base: dict[str, list[str]]
    adapter: dict[str, str]  # PEFT adapter name -> Lightning name


def _plan(names: list[str], tied: bool, merge: bool) -> _Plan:
    base: dict[str, list[str]] = {}
    adapter: dict[str, str] = {}
    loras: dict[str, dict[str, str]] = {}
    for name in names:
        if not name.startswith(MODULE_PREFIX):
            continue  # metrics or other module state, not model weights
        inner = name[len(MODULE_PREFIX):]
        if "modules_to_save" in inner or "original_module" in inner:
            raise NotImplementedError(f"cannot export {inner}: PEFT `modules_to_save` is not supported")
        if inner.startswith(PEFT_PREFIX):
            match = _LORA.match(inner)
            if match:
                if "lora_embedding" in inner or "lora_magnitude" in inner:
                    raise NotImplementedError(f"cannot export {inner}: only Linear LoRA (no DoRA/embedding LoRA)")
                module = match["module"].removeprefix(PEFT_PREFIX)
                loras.setdefault(module, {})[match["ab"]] = name
                adapter[f"{match['module']}.lora_{match['ab']}.weight"] = name  # PEFT drops the adapter name
                continue
            inner = inner[len(PEFT_PREFIX):].replace(".base_layer.", ".")
        elif "lora_" in inner:
            raise ValueError(f"unexpected LoRA tensor outside a PEFT model: {name}")
        base[inner] = [name]
    if tied:
        base.pop("lm_head.weight", None)  # tied to embed_tokens; from_pretrained re-ties it
    if merge:
        for module, ab in loras.items():
            base[f"{module}.weight"] += [ab["A"], ab["B"]]
        adapter = {}
    return _Plan(base, adapter)


def _shards(plan: dict[str, list[str]], specs: dict[str, tuple], max_bytes: int, dtype) -> list[list[str]]:
    groups, current, size = [], [], 0
    for hf_name, sources in plan.items():
        shape, src_dtype = specs[sources[0]]
        nbytes = math.prod(shape) * (dtype or src_dtype).itemsize
        if current and size + nbytes > max_bytes:
            groups.append(current)
            current, size = [], 0
        current.append(hf_name)
        size += nbytes
    return groups + ([current] if current else [])


def _parse_size(text: str) -> int:
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([KMG]?B)", text.strip().upper())
    if not match:
        raise ConfigError("--max-shard-size", text, "must look like 500MB or 5GB")
    return int(float(match[1]) * {"B": 1, "KB": 2**10, "MB": 2**20, "GB": 2**30}[match[2]])


def export(ckpt: str | Path, out_dir: str | Path, *, merge_lora: bool = False, dtype: str | None = None,
           max_shard_size: str = "5GB", config_dir: str | None = None) -> ExportResult:
    """Write the checkpoint's model as an HF folder (and its LoRA adapter in PEFT format, unless merged)."""
    if dtype is not None and dtype not in _DTYPES:
        raise ConfigError("--dtype", dtype, f"must be one of {sorted(_DTYPES)}")
    max_bytes = _parse_size(max_shard_size)
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"`out_dir={str(out)!r}` exists and is not empty; choose a new folder")
    source = _Source(Path(ckpt))
    hparams = source.hparams
    config = model_config(hparams, config_dir)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    lora = hparams.get("lora")
    plan = _plan(sorted(source.specs), tied=bool(getattr(text, "tie_word_embeddings", False)), merge=merge_lora)
    if merge_lora and not lora:
        raise ConfigError("--merge-lora", True, "the checkpoint was not trained with `model.lora`")
    scaling = _lora_scaling(lora) if lora else 1.0
    target = _DTYPES[dtype] if dtype else None

    out.mkdir(parents=True, exist_ok=True)
    groups = _shards(plan.base, source.specs, max_bytes, target)
    names = (["model.safetensors"] if len(groups) == 1 else
             [f"model-{i:05d}-of-{len(groups):05d}.safetensors" for i in range(1, len(groups) + 1)])
    weight_map, total, merged = {}, 0, []
    for file_name, group in zip(names, groups):
        wanted = [src for hf in group for src in plan.base[hf]]
        loaded = source.load(wanted)  # one shard's worth of tensors at a time
        tensors = {}
        for hf in group:
            srcs = plan.base[hf]
            weight = loaded[srcs[0]]
            if len(srcs) == 3:  # merge in fp32, then back to the weight's dtype
                a, b = loaded[srcs[1]].float(), loaded[srcs[2]].float()
                weight = (weight.float() + scaling * (b @ a)).to(weight.dtype)
                merged.append(hf)
            weight = weight.to(target) if target is not None else weight
            tensors[hf] = weight.contiguous().clone()  # safetensors needs owned, non-shared storage
            weight_map[hf] = file_name
            total += tensors[hf].numel() * tensors[hf].element_size()
        save_file(tensors, str(out / file_name), metadata={"format": "pt"})
        del tensors, loaded
    if len(groups) > 1:
        (out / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    save_dtype = target or source.specs[plan.base[next(iter(plan.base))][0]][1]
    config.dtype = save_dtype
    config.save_pretrained(out)

    adapter_dir = None
    if plan.adapter:
        adapter_dir = out / "adapter"
        _export_adapter(source, plan.adapter, lora, adapter_dir, base=str(out))
    return ExportResult(out, len(weight_map), names, adapter_dir, merged)


def _lora_scaling(lora: dict[str, Any]) -> float:
    for unsupported in ("rank_pattern", "alpha_pattern"):
        if lora.get(unsupported):
            raise NotImplementedError(f"merging with `model.lora.{unsupported}` is not supported; export the adapter")
    if lora.get("use_dora"):
        raise NotImplementedError("merging DoRA adapters is not supported; export the adapter")
    r, alpha = int(lora.get("r", 8)), float(lora.get("lora_alpha", 8))
    return alpha / math.sqrt(r) if lora.get("use_rslora") else alpha / r


def _export_adapter(source: _Source, names: dict[str, str], lora: dict[str, Any], out: Path, base: str) -> None:
    from peft import LoraConfig

    out.mkdir(parents=True)
    loaded = source.load(list(names.values()))
    save_file({peft: loaded[src].contiguous().clone() for peft, src in names.items()},
              str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    spec = {"task_type": "CAUSAL_LM", **lora, "base_model_name_or_path": base}
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
    max_bytes, index, size = _parse_size(max_shard_size), {}, 0
    file_index = 1
    for name, t in state.items():  # global shapes: the same mapping on every rank
        nbytes = t.numel() * t.element_size()
        if size and size + nbytes > max_bytes:
            file_index, size = file_index + 1, 0
        index[name], size = file_index, size + nbytes
    writer = _compat.hf_storage_writer(str(out), fqn_to_index_mapping=index, save_distributed=True,
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


def run(argv: list[str] | None = None) -> ExportResult:
    """Command line: `python -m lightning_ffpa.export CKPT OUT [...]`; returns what was written."""
    parser = ArgumentParser(prog="lightning-ffpa-export", description=__doc__.split("\n\n")[0])
    parser.add_argument("ckpt", help="Lightning checkpoint: a .ckpt file or a DCP folder (FSDP2 ModelCheckpoint)")
    parser.add_argument("out", help="new folder for the HF model (config.json + safetensors)")
    parser.add_argument("--merge-lora", action="store_true", help="merge LoRA into the weights (fp32 math)")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), help="cast the weights (default: as stored)")
    parser.add_argument("--max-shard-size", default="5GB", help="largest safetensors file, e.g. 500MB, 5GB")
    parser.add_argument("--config", dest="config_dir", help="HF config folder (default: rebuilt from hparams)")
    args = parser.parse_args(argv)
    _parse_size(args.max_shard_size)  # checked before the checkpoint is read
    existing = next(p for p in [Path(args.out), *Path(args.out).absolute().parents] if p.exists())
    if existing != Path(args.out) and not existing.is_dir():
        raise ConfigError("out", args.out, f"{str(existing)!r} is a file, not a folder")
    if args.config_dir is not None and not Path(args.config_dir, "config.json").is_file():
        raise ConfigError("--config", args.config_dir, "is not an HF config folder (no config.json)")
    result = export(args.ckpt, args.out, merge_lora=args.merge_lora, dtype=args.dtype,
                    max_shard_size=args.max_shard_size, config_dir=args.config_dir)
    print(f"wrote {result.num_tensors} tensors in {len(result.shards)} file(s) to {result.out_dir}"
          + (f"; adapter in {result.adapter_dir}" if result.adapter_dir else "")
          + (f"; merged LoRA into {len(result.merged)} weights" if result.merged else ""))
    return result


def main(argv: list[str] | None = None) -> int:
    """The `lightning-ffpa-export` console script: exit code 0, or 2 with one `error:` line on a bad input."""
    from lightning_ffpa.validation import CheckpointError

    return console_entry(run, user_errors=(CheckpointError,), argv=argv)


if __name__ == "__main__":
    sys.exit(main())
