"""Pre-flight checks that run before any model is built or any checkpoint is written.

Owns: checkpoint integrity (plain `.ckpt` files and DCP folders: truncation, corruption, missing state),
checkpoint/config compatibility (architecture hyper-parameters), LoRA targets that match nothing, and the
cross-component layout checks no single component can make alone (mesh sizes x world size, sequence length
x CP; the attention plan, `lightning_ffpa.attention.plan`, refuses attention x CP x packing), all before `fit` launches processes or builds the model.
Each failure is one `ValueError`/`FileNotFoundError` naming the option (`ckpt_path`, `model.lora...`).
Does not own checks a component can make on its own arguments (the module, data modules and strategy
validate those in their constructors) and does not load weights into a model.

Entry points: `preflight(trainer, model, datamodule, ckpt_path)` for any script, and `PreflightCLIMixin`
for LightningCLI subclasses (`class FFPACLI(PreflightCLIMixin, LightningCLI)`).
"""

from __future__ import annotations

import os
import zipfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_ffpa._compat import lightning as lightning_compat
from lightning_ffpa._compat import torch as torch_compat
from lightning_ffpa._compat.transformers import from_config
from lightning_ffpa.attention.plan import plan_for
from lightning_ffpa.checkpoint.frozen import FROZEN_BASE_KEY, check_frozen_seed
from lightning_ffpa.checkpoint.paths import (
    HPC_PREFIX,
    newer_than_hpc,
    root_checkpoint_dirs,
    saved_checkpoints,
)
from lightning_ffpa.errors import NOT_GIVEN, CheckpointError, ConfigError, data_option
from lightning_ffpa.fp8_base import check_device as fp8_base_check_device
from lightning_ffpa.hf_module import (  # noqa: F401 - re-exported
    ARCHITECTURE_HPARAMS,
    MODULE_CLASS_KEY,
    check_data_fits_model,
    check_fp8_base_placement,
    check_hparams_match,
)
from lightning_ffpa.lora import check_targets_match, lora_spec

# LightningCLI option: take the model options from an explicit checkpoint file even where they differ.
RESUME_SWITCH = "resume_model_from_checkpoint"


def check_checkpoint(path: str | os.PathLike, option: str = "ckpt_path", *, resume: bool = True,
                     verify_checksums: bool = True) -> dict[str, Any]:
    """Check a checkpoint file or DCP folder and return its non-tensor state (hyper_parameters, loops...).

    `verify_checksums` reads a `.ckpt` file once to check every record's CRC (bit rot, partial copies);
    DCP folders carry no checksums, so they are checked for truncation against their metadata instead.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"`{option}={str(path)!r}` does not exist")
    state = _check_dcp_folder(path, option) if path.is_dir() else _check_file(path, option, verify_checksums)
    if "state_dict" not in state and not path.is_dir():
        raise CheckpointError(f"`{option}={str(path)!r}` has no `state_dict`; it is not a Lightning checkpoint")
    if resume:
        missing = [k for k in ("loops", "global_step") if k not in state]
        if not path.is_dir() and "optimizer_states" not in state:
            missing.append("optimizer_states")
        if missing:
            raise CheckpointError(
                f"`{option}={str(path)!r}` cannot resume training: it has no {missing} (a weights-only or "
                "exported checkpoint); load its weights with `model.pretrained` instead"
            )
    return state


def _check_file(path: Path, option: str, verify_checksums: bool) -> dict[str, Any]:
    try:
        with zipfile.ZipFile(path) as zf:  # torch.save's format; truncation loses the central directory
            bad = zf.testzip() if verify_checksums else None
    except (zipfile.BadZipFile, OSError, EOFError) as err:
        raise CheckpointError(f"`{option}={str(path)!r}` is truncated or not a torch checkpoint ({err})") from err
    if bad is not None:
        raise CheckpointError(f"`{option}={str(path)!r}` is corrupt: record {bad!r} fails its CRC check")
    try:
        # what the resume itself does (weights_only, like Lightning for local files); mmap keeps tensors on disk
        state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as err:  # noqa: BLE001 - any failure to unpickle is the same user-facing problem
        raise CheckpointError(f"`{option}={str(path)!r}` cannot be loaded ({type(err).__name__}: {err})") from err
    if not isinstance(state, dict):
        raise CheckpointError(f"`{option}={str(path)!r}` holds a {type(state).__name__}, not a checkpoint dict")
    return state


def _check_dcp_folder(path: Path, option: str) -> dict[str, Any]:
    if not (path / ".metadata").is_file():
        raise CheckpointError(f"`{option}={str(path)!r}` is a directory without `.metadata`; "
                              "it is not a distributed (DCP) checkpoint")
    try:
        metadata = torch_compat.read_dcp_metadata(str(path))
    except Exception as err:  # noqa: BLE001
        raise CheckpointError(f"`{option}={str(path)!r}`: unreadable `.metadata` ({err})") from err
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        shard = path / name
        if not shard.is_file():
            raise CheckpointError(f"`{option}={str(path)!r}` is missing its shard file {name!r}")
        if shard.stat().st_size < size:
            raise CheckpointError(f"`{option}={str(path)!r}`: shard {name!r} is truncated "
                                  f"({shard.stat().st_size} of {size} bytes)")
    meta_file = path / lightning_compat.lightning_dcp_meta_filename()
    if not meta_file.is_file():
        return {}
    try:
        return torch.load(meta_file, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001
        raise CheckpointError(f"`{option}={str(path)!r}`: {meta_file.name} cannot be loaded ({err})") from err


def check_no_dangling_last(trainer: Any, option: str = "ckpt_path") -> None:
    """`last` found nothing: refuse if a `last*.ckpt` link points to a save that never completed.

    Lightning would silently start from scratch; a background save killed before it was renamed into
    place leaves exactly that link (the older complete checkpoints are still there).
    """
    for cb in getattr(trainer, "checkpoint_callbacks", []):
        folder = getattr(cb, "dirpath", None)
        if not folder or not Path(folder).is_dir():
            continue
        for link in sorted(Path(folder).glob("last*.ckpt")):
            if link.is_symlink() and not link.exists():
                complete = sorted((p for p in Path(folder).glob("*.ckpt") if p.exists() and not p.is_symlink()),
                                  key=lambda p: p.stat().st_mtime)
                hint = f"e.g. `--ckpt_path {complete[-1]}`" if complete else "no complete checkpoint is left"
                raise CheckpointError(f"`{option}='last'`: {link} points to {os.readlink(link)!r}, a save that "
                                      f"did not complete; pass a complete checkpoint explicitly ({hint})")


def check_last_finds_the_saved_run(trainer: Any) -> None:
    """`last` found no `last` file in a folder that holds checkpoints (ModelCheckpoint's `save_last` off): Lightning
    would warn and train from scratch over them; the newest one is named instead."""
    saved = saved_checkpoints(trainer)
    if saved:
        raise CheckpointError(f"`ckpt_path='last'`: {os.path.dirname(saved[0])} has no `last` checkpoint "
                              f"(ModelCheckpoint's save_last is off) but holds {len(saved)} of an earlier run; "
                              f"continue from the newest with `--ckpt_path {saved[0]}`")


def check_fresh_run_writes_nothing_saved(trainer: Any) -> None:
    """A fit from scratch into a checkpoint folder that holds an earlier run's checkpoints is refused: it would
    replace `last.ckpt` (and files of the same step), and a later `--ckpt_path last` would find the new run."""
    saved = saved_checkpoints(trainer)
    if not saved:
        return
    folder = os.path.dirname(saved[0])
    in_root = os.path.realpath(folder) == os.path.realpath(os.path.join(trainer.default_root_dir, "checkpoints"))
    option = ("trainer.default_root_dir", trainer.default_root_dir) if in_root else ("ModelCheckpoint.dirpath", folder)
    raise CheckpointError(f"`{option[0]}={str(option[1])!r}` holds the checkpoints of an earlier run ({len(saved)} in "
                          f"{folder}, newest {os.path.basename(saved[0])}); a fit from scratch would write over them. "
                          "Continue that run with `--ckpt_path last`, or start a new one in another folder")


def check_lora_targets(model: Any, option: str = "model.lora") -> None:
    """Every LoRA `target_modules` / `target_parameters` entry must match the model (`lora.check_targets_match`
    over the model built on meta), and a float8 base (`lora.base_dtype: fp8`) must fit its targets, before fit
    writes any file."""
    spec = lora_spec(model)
    if not spec or not hasattr(model, "config"):
        return
    if spec.get("base_dtype") == "fp8":  # its refusals (an embedding or tied target) on the model built on meta
        from lightning_ffpa.fp8_base import quantize_lora_bases
        from lightning_ffpa.lora import apply_lora

        quantize_lora_bases(apply_lora(_meta_model(model), spec))
    if spec.get("target_modules") in (None, "all-linear") and not spec.get("target_parameters"):
        return
    check_targets_match(_meta_model(model), spec, option)


def _meta_model(model: Any) -> nn.Module:
    from lightning_ffpa.module import _MODEL_CLASSES

    with torch.device("meta"):  # names only: no memory, no init
        return from_config(_MODEL_CLASSES[getattr(model, "model_class_name", "causal_lm")], model.config)


def available_host_bytes() -> int | None:
    """Memory this machine can still give (Linux `MemAvailable`), or None where it cannot be read."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def check_fits_host_memory(trainer: Any, model: Any) -> None:
    """A model trained on the CPU whose weights alone exceed this machine's available memory is refused: the
    kernel would kill the fit minutes in (exit 137, nothing printed). The weights once, in the model's dtype, is a
    lower bound (gradients and optimizer states come on top), so a model that fits is never refused."""
    if getattr(trainer.strategy.root_device, "type", None) != "cpu" or getattr(model, "config", None) is None:
        return
    if (available := available_host_bytes()) is None:
        return
    from lightning_ffpa.hf_module import resolve_dtype

    hp = dict(getattr(model, "hparams", {}))
    dtype = resolve_dtype(hp.get("dtype") or "auto")
    params = sum(p.numel() for p in _meta_model(model).parameters())
    need = params * dtype.itemsize
    if need > available:
        option, value = ("model.pretrained", hp["pretrained"]) if hp.get("pretrained") else ("model.preset",
                                                                                             hp.get("preset"))
        raise ConfigError(option, value, f"builds {params / 1e9:.1f}B parameters: {need / 2**30:.1f} GiB of "
                          f"{str(dtype).removeprefix('torch.')} weights alone, more than the {available / 2**30:.1f} "
                          "GiB this machine has available for `trainer.accelerator='cpu'`; train it on GPUs, or "
                          "pick a smaller model (the `tiny` recipe runs on a CPU)")


def check_components(trainer: Any, model: Any, datamodule: Any) -> None:
    """The checks the components run in their `setup`, run here instead: Lightning calls `setup` after the
    logger and the config file are written. The model's option checks first (cheap), then the data (it reads
    the rows the callbacks check against)."""
    if callable(getattr(model, "check_data", None)):
        model.check_data(datamodule)
    if callable(getattr(datamodule, "check_before_fit", None)):
        datamodule.check_before_fit()
    for callback in trainer.callbacks:
        if callable(getattr(callback, "check_before_fit", None)):
            callback.check_before_fit(trainer, model, datamodule)


def warn_pretrained_tokenizer_unused(model: Any, datamodule: Any) -> None:
    """A pretrained folder that ships its own tokenizer, beside data on the byte tokenizer (`TextDataModule`'s
    default): the model would learn byte ids in place of the ones its embeddings know, without a word."""
    from lightning.pytorch.utilities import rank_zero_warn

    from lightning_ffpa.data.tokenizer import BYTE_TOKENIZER, TOKENIZER_FILES

    pretrained = (getattr(model, "hparams", None) or {}).get("pretrained")
    if getattr(datamodule, "tokenizer_digest", None) != BYTE_TOKENIZER or not isinstance(pretrained, str):
        return
    folder = Path(pretrained).expanduser()
    if folder.is_dir() and any((folder / f).is_file() for f in TOKENIZER_FILES):
        rank_zero_warn(f"`model.init_args.pretrained={pretrained!r}` holds a tokenizer, but the data is encoded by the "
                       f"byte tokenizer (`{data_option(datamodule, 'tokenizer')}=byte`, the default): the model learns "
                       f"byte ids, not the ones its embeddings know; give `--{data_option(datamodule, 'tokenizer')} "
                       f"{pretrained}` to use its own")


def check_attention_trains_here(trainer: Any, model: Any) -> None:
    """Attention that cannot train on the CPU is refused there: torch's FlexAttention has no CPU backward, and
    the flash-attn kernels no CPU path at all (transformers would try the hub, then fail mid-fit)."""
    device = getattr(getattr(trainer, "strategy", None), "root_device", None)
    if device is None or device.type != "cpu":
        return
    from lightning_ffpa.parallel.dims import context_parallel_size

    plan = plan_for(trainer, model, context_parallel_size(trainer, model))  # the model option, or the Callback's
    attn = plan.attn_implementation
    if plan.ring or not isinstance(attn, str):
        return
    if attn == "flex_attention":
        raise ConfigError(plan.option, attn, "cannot train on CPU (torch's FlexAttention has no CPU backward); use "
                          "'sdpa', 'eager' or 'ffpa'")
    if attn.startswith("flash_attention"):
        raise ConfigError(plan.option, attn, "needs a CUDA GPU (the flash-attn kernels have no CPU path); use 'sdpa', "
                          "'eager' or 'ffpa'")


def check_parallel_layout(trainer: Any, model: Any, datamodule: Any = None) -> None:
    """Mesh sizes vs world size, sequence length vs CP, and the direct ffpa backend vs CP and packing.

    Runs before `fit` launches any process (the world size is known from `devices` x `num_nodes`); the
    strategy repeats the size checks in `setup_environment` for scripts that do not run this.
    """
    strategy = trainer.strategy
    if callable(getattr(strategy, "check_activation_offload", None)):
        strategy.check_activation_offload()
    fp8 = getattr(strategy, "fp8_training", None)
    if fp8 is not None and hasattr(fp8, "check_device"):  # FSDP2Strategy's `fp8`: the device, and no LoRA
        fp8.check_no_lora(lora_spec(model))
        fp8.check_device(strategy.root_device)
    lora = lora_spec(model)
    fp8_base_check_device(lora, strategy.root_device)  # `model.lora.base_dtype: fp8`: FP8 tensor cores on CUDA
    check_fp8_base_placement(lora, strategy)
    cp = getattr(strategy, "context_parallel_size", 1)
    world = trainer.world_size
    _check_replicate_frozen(strategy, model)
    if not isinstance(cp, int):
        return
    if callable(resolve_dims := getattr(strategy, "resolve_dims", None)):  # FSDP2Strategy: dp x cp x ep vs the world
        resolve_dims(world, model)
    seq = getattr(datamodule, "max_seq_length", None)
    if cp > 1 and seq is not None and seq % (2 * cp):
        raise ValueError(f"`{data_option(datamodule, 'max_seq_length', 'seq_length')}={seq}` must be divisible by "
                         f"2 x context_parallel_size = {2 * cp} (each sequence is cut into 2·cp load-balanced chunks)")
    pad = getattr(datamodule, "pad_to_multiple_of", None)
    if cp > 1 and not getattr(datamodule, "pack", False) and isinstance(pad, int) and pad % (2 * cp):
        raise ValueError(f"`data.pad_to_multiple_of={pad}` must be a multiple of 2 x context_parallel_size = "
                         f"{2 * cp}: batches are padded to it, and each sequence is cut into 2·cp chunks")
    # The attention plan (model option x FFPAAttention callback x CP size) refuses what cannot run; made once here,
    # the same object the callback and the module read later.
    from lightning_ffpa.parallel.dims import context_parallel_size

    plan = plan_for(trainer, model, context_parallel_size(trainer, model))
    if getattr(datamodule, "pack", False):
        plan.check_packing(True)


def _check_replicate_frozen(strategy: Any, model: Any) -> None:
    """`replicate_frozen=true` computes with a LoRA's frozen base as stored, so `model.dtype` must be
    `param_dtype` ("auto" leaves such a base to FSDP2 instead, and says so)."""
    if getattr(strategy, "replicate_frozen", False) is not True:
        return
    hp = getattr(model, "hparams", None) or {}
    if "lora" in hp and not lora_spec(hp):  # one of ours, fully fine-tuned
        raise ConfigError("trainer.strategy.init_args.replicate_frozen", True, "has nothing to replicate: a full "
                          "fine-tune (no `model.lora`) has no frozen weights; use auto or false")
    want, dtype = getattr(strategy, "param_dtype", None), hp.get("dtype")
    if not lora_spec(hp) or want is None or not isinstance(dtype, str) or dtype == "auto":
        return
    if getattr(torch, dtype, None) != want:
        raise ValueError(f"`replicate_frozen=True` computes with the LoRA's frozen base as stored, in "
                         f"`model.dtype={dtype}`, while `param_dtype` is {str(want).removeprefix('torch.')}: "
                         "set them alike, or use replicate_frozen auto or false")


def preflight(trainer: Any, model: Any, datamodule: Any = None, ckpt_path: str | None = None) -> str | None:
    """Run every pre-flight check for `fit`; returns the checkpoint path `fit` will resume from (or None): under
    SLURM, the newest save in the checkpoint folder where it is newer than the HPC checkpoint Lightning would take."""
    root_checkpoint_dirs(trainer)  # before `last` is resolved: it is looked up in these folders
    check_parallel_layout(trainer, model, datamodule)
    check_fits_host_memory(trainer, model)
    check_components(trainer, model, datamodule)
    check_data_fits_model(model, datamodule)
    warn_pretrained_tokenizer_unused(model, datamodule)
    check_attention_trains_here(trainer, model)
    check_lora_targets(model)
    if ckpt_path == "best" and not any(getattr(cb, "best_model_path", "") for cb in trainer.checkpoint_callbacks):
        # Lightning's own error blames the ModelCheckpoint configuration
        raise ConfigError("ckpt_path", "best", "there is no best checkpoint yet: `best` is the best one this process's "
                          "ModelCheckpoint saved, and it has saved none; pass a checkpoint file (or `last`)")
    resolved = lightning_compat.resolve_ckpt_path(trainer, ckpt_path)
    if ckpt_path is None and (newer := newer_than_hpc(trainer, resolved)) is not None:
        if trainer.is_global_zero:
            print(f"resuming from {newer}: saved after the HPC checkpoint {resolved}, which is left as it is",
                  flush=True)
        resolved = newer
    if resolved is None:
        if ckpt_path == "last":
            check_no_dangling_last(trainer)
            check_last_finds_the_saved_run(trainer)
            if trainer.is_global_zero:  # resume-or-start is a job script's idiom; a mistyped folder shows here
                folders = ", ".join(sorted({str(cb.dirpath) for cb in trainer.checkpoint_callbacks if cb.dirpath}))
                print(f"`ckpt_path='last'`: no checkpoint in {folders or 'the run folder'} yet, so this fit starts "
                      "from step 0 (the same command resumes once one is saved)", flush=True)
        elif ckpt_path is None:
            check_fresh_run_writes_nothing_saved(trainer)
        return None
    check_strategy_loads(trainer, resolved)
    state = check_checkpoint(resolved, "ckpt_path")
    check_hparams_match(state.get("hyper_parameters"), model, "ckpt_path", saved_class=state.get(MODULE_CLASS_KEY))
    check_frozen_seed(state.get(FROZEN_BASE_KEY), dict(getattr(model, "hparams", {})), resolved)
    check_data_resumes(trainer, datamodule, state)
    check_tokenizer_matches(datamodule, state, resolved)
    check_steps_left(trainer, state, ckpt_path)
    return str(resolved)


def check_steps_left(trainer: Any, state: dict[str, Any], ckpt_path: str | None) -> None:
    """A resume the user asked for whose checkpoint has reached `trainer.max_steps` would train nothing and exit 0
    (Lightning stops at once). A resume found on its own (a requeued job's HPC save) is left to end quietly."""
    step, max_steps = state.get("global_step"), trainer.max_steps
    if ckpt_path is None or not isinstance(step, int) or max_steps is None or max_steps < 0 or step < max_steps:
        return
    raise ConfigError("trainer.max_steps", max_steps, f"`ckpt_path={ckpt_path!r}` is at step {step} already, so the "
                                                      f"fit would train nothing; set it above {step} to continue")


def check_evaluated_checkpoint(trainer: Any, ckpt_path: str | None, subcommand: str) -> None:
    """`validate` / `test` / `predict --ckpt_path last|hpc`: looked up in the run's checkpoint folder, as `fit`
    does; one that finds nothing is refused (Lightning would warn and evaluate the untrained model, exit 0).
    `best` is refused: it names what this process's fit saved, and these commands run no fit."""
    root_checkpoint_dirs(trainer)  # `last` is looked up in these folders
    if ckpt_path == "best":  # Lightning's ValueError blames the ModelCheckpoint configuration
        raise ConfigError("ckpt_path", "best", f"`{subcommand}` has no best checkpoint: `best` is the best one a fit "
                          "in the same process saved; pass `last` or a checkpoint file")
    if ckpt_path not in ("last", "hpc"):
        return
    try:
        resolved = lightning_compat.resolve_ckpt_path(trainer, ckpt_path)
    except ValueError:  # no HPC checkpoint: Lightning's message names `.fit(ckpt_path="hpc")`, said below instead
        if ckpt_path != "hpc":
            raise
        resolved = None
    if resolved is None:
        if ckpt_path == "last":
            check_no_dangling_last(trainer)
        folders = [cb.dirpath for cb in trainer.checkpoint_callbacks if getattr(cb, "dirpath", None)]
        if ckpt_path == "hpc":  # HPC checkpoints (hpc_ckpt_N.ckpt) are looked up in the run folder itself
            folders = [str(trainer.default_root_dir)]
        raise CheckpointError(f"`ckpt_path={ckpt_path!r}`: no such checkpoint in {', '.join(folders) or 'any folder'}"
                              f", so `{subcommand}` would run the untrained model; pass the run's "
                              "`trainer.default_root_dir` or a checkpoint file")
    check_strategy_loads(trainer, resolved)
    check_checkpoint(resolved, "ckpt_path", resume=False)


def check_data_resumes(trainer: Any, datamodule: Any, state: dict[str, Any]) -> None:
    """The data's own resume checks (seed; mid-epoch: data-parallel size, batch size), on the layout this run
    will have, so a mismatch is refused before processes start rather than by every rank after."""
    saved = state.get(type(datamodule).__qualname__) if datamodule is not None else None
    if not isinstance(saved, dict) or not hasattr(datamodule, "resume_conflict"):
        return
    world = trainer.num_nodes * trainer.num_devices
    conflict = datamodule.resume_conflict(saved, world // getattr(trainer.strategy, "context_parallel_size", 1))
    if conflict is not None:
        raise ConfigError(*conflict)


def check_tokenizer_matches(datamodule: Any, state: dict[str, Any], ckpt_path: str | os.PathLike) -> None:
    """The data's tokenizer is the one the checkpoint was trained with (its recorded digest), however either is
    spelled: with another, token ids mean other text, and a loss or a resumed fit would run without a word."""
    from lightning_ffpa.hf_module import SOURCES_KEY, TOKENIZER_DIGEST_KEY

    sources = state.get(SOURCES_KEY) or {}
    saved, now = sources.get(TOKENIZER_DIGEST_KEY), getattr(datamodule, "tokenizer_digest", None)
    if saved is None or now is None or saved == now:
        return
    raise ConfigError(data_option(datamodule, "tokenizer"), getattr(datamodule, "tokenizer_spec", NOT_GIVEN),
                      f"is not the tokenizer `ckpt_path={str(ckpt_path)!r}` was trained with "
                      f"({sources.get('data.tokenizer')!r}): its token ids would mean other text; give that one")


def check_strategy_loads(trainer: Any, ckpt_path: str | os.PathLike | None) -> None:
    """A distributed (DCP) checkpoint folder loads only through a sharding strategy (else: "Is a directory")."""
    from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

    if ckpt_path and Path(ckpt_path).is_dir() and not isinstance(trainer.strategy, (ModelParallelStrategy,
                                                                                     FSDPStrategy)):
        raise CheckpointError(f"`ckpt_path={str(ckpt_path)!r}` is a distributed checkpoint folder, which "
                              f"{type(trainer.strategy).__name__} cannot load: run with `--trainer.strategy "
                              "lightning_ffpa.parallel.FSDP2Strategy`")


class PreflightCLIMixin:
    """LightningCLI mixin: check an explicit `ckpt_path` right after parsing, and run `preflight` before fit.

    Why at parse time: LightningCLI itself `torch.load`s an explicit checkpoint file while parsing (to reuse
    its hyper-parameters), so a truncated file would otherwise fail there with torch's raw zip error.
    """

    def add_default_arguments_to_parser(self, parser: Any) -> None:
        super().add_default_arguments_to_parser(parser)
        parser.add_argument(
            f"--{RESUME_SWITCH}", type=bool, default=False,
            help="With an explicit ckpt_path (a file or an FSDP2 checkpoint folder), the model options come from the "
                 "checkpoint; a `model.*` option that differs from it is an error unless this is true.")

    def parse_arguments(self, parser: Any, args: Any) -> None:
        super().parse_arguments(parser, args)
        subcommand = self.config.get("subcommand")
        ckpt_path = self.config[subcommand].get("ckpt_path") if subcommand else None
        if ckpt_path and ckpt_path not in ("last", "hpc", "best"):
            state = check_checkpoint(ckpt_path, "ckpt_path", resume=subcommand == "fit")
            self._folder_hparams = state.get("hyper_parameters") if Path(ckpt_path).is_dir() else None
            if not self.config[subcommand].get(RESUME_SWITCH):
                from lightning_ffpa.hf_module import check_options_match_checkpoint

                check_options_match_checkpoint(self.config[subcommand].get("model"), state.get("hyper_parameters"),
                                               ckpt_path, RESUME_SWITCH, resume=subcommand == "fit")

    def _parse_ckpt_path(self) -> None:
        """LightningCLI takes the model options from a checkpoint file; do the same for a distributed checkpoint
        folder (FSDP2Strategy's format), which it skips, so an explicit folder behaves as a file does."""
        super()._parse_ckpt_path()
        hparams = dict(getattr(self, "_folder_hparams", None) or {})
        hparams.pop("_instantiator", None)
        if not hparams:
            return
        if "_class_path" in hparams:
            hparams = {"class_path": hparams.pop("_class_path"), "dict_kwargs": hparams}
        self.config = self.parser.parse_object({self.config.subcommand: {"model": hparams}}, self.config)

    def before_fit(self) -> None:
        """Pre-flight checks (checkpoint, LoRA targets, vocab) before any model is built."""
        config = self.config_init[self.subcommand]
        resolved = preflight(self.trainer, self.model, self.datamodule, config.get("ckpt_path"))
        if config.get("ckpt_path") is None and resolved and not Path(resolved).name.startswith(HPC_PREFIX):
            config["ckpt_path"] = resolved  # a save newer than a stale HPC checkpoint (`newer_than_hpc`)
        elif config.get("ckpt_path") == "last" and resolved is None:
            config["ckpt_path"] = None  # said above; Lightning's warning would blame `save_last`, which is on
