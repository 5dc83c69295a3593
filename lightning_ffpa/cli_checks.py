"""Checks of the command line's own options that Lightning or argparse would meet with a traceback, a misleading
line, or a silent fallback: a seed outside numpy's range, float16 mixed precision on CPU, a negative number in
the space form (`--opt -3e-3`), and a run folder that is a file or cannot be written.

Owns these checks, each one `ConfigError` naming the option. Does not own when they run (`lightning_ffpa.cli`
calls them before the model is built), the trainer's range checks (`cli.check_trainer_options`) or the checks
between components (`lightning_ffpa.validation`).
"""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from lightning_ffpa.errors import NOT_GIVEN, ConfigError, no_optimizer_option

__all__ = ["check_folder_writable", "check_negative_values", "check_precision_runs_here", "check_seed", "is_number"]


def is_number(value: Any) -> float | None:
    """`value` if it is an int or float (not a bool), else None."""
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


# numpy's seed range, which `seed_everything` enforces with a traceback
SEED_RANGE = (0, 2**32 - 1)


def check_seed(seed: Any) -> None:
    """`seed_everything` must be in numpy's range (Lightning raises its ValueError as a traceback)."""
    if isinstance(seed, int) and not isinstance(seed, bool) and not SEED_RANGE[0] <= seed <= SEED_RANGE[1]:
        raise ConfigError("seed_everything", seed, f"must be in {SEED_RANGE[0]}..{SEED_RANGE[1]} (numpy's seed range)")


def check_precision_runs_here(trainer: Any, precision: Any) -> None:
    """float16 mixed precision on CPU: Lightning only warns and trains in bf16-mixed instead."""
    from lightning.pytorch.accelerators import CPUAccelerator

    if str(precision) in ("16-mixed", "16") and isinstance(trainer.accelerator, CPUAccelerator):
        raise ConfigError("trainer.precision", precision, "float16 mixed precision needs a CUDA GPU (on CPU Lightning "
                          "would train in bf16-mixed instead); use bf16-mixed or 32-true")


# a negative number argparse reads as an option (its own pattern takes `-5` and `-0.5`, not `-3e-3` or `-1.`)
_NEGATIVE = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")
_ARGPARSE_NEGATIVE = re.compile(r"^-\d+$|^-\d*\.\d+$")


def check_negative_values(args: list[str]) -> None:
    """`--opt -3e-3` (space form): argparse takes the value for an unknown option and says only "argument
    --model: expected one argument"; name the option and give the `=` form that works."""
    for option, value in zip(args, args[1:]):
        if option.startswith("--") and "=" not in option and _NEGATIVE.match(value) \
                and not _ARGPARSE_NEGATIVE.match(value):
            raise ConfigError(option, NOT_GIVEN, f"its value {value} starts with `-`, so it is read as an option; "
                                                 f"write `{option}={value}`")


def check_no_optimizer_options(args: list[str]) -> None:
    """`--optimizer AdamW` / `--lr_scheduler StepLR`: the model builds its own (`configure_optimizers`; the CLI adds
    no optimizer options), and argparse said only "unrecognized arguments"; name the model options that set it."""
    for arg in args:
        option = arg.partition("=")[0]
        if option.split(".")[0] in ("--optimizer", "--lr_scheduler"):
            raise no_optimizer_option(option)


def check_config_before_subcommand(args: list[str], subcommands: Iterable[str],
                                   resolve: Callable[[str], str] = str) -> None:
    """`lightning-ffpa --config X fit`: LightningCLI reads a config given before the subcommand only under the
    subcommand's key (`fit: {trainer: ...}`), so a recipe there was ignored (or its keys refused as "not an argument
    of this class"); refuse one without such keys and say where it goes. `resolve`: a recipe name to its path."""
    import yaml

    subcommands = set(subcommands)
    if not subcommands & set(args):
        return  # no subcommand at all: said by the command's own check
    for i, arg in enumerate(args):
        if arg in subcommands:
            return
        option, _, value = arg.partition("=") if arg.startswith("--config=") else (arg, "", None)
        if option not in ("--config", "-c"):
            continue
        value = value if value is not None else args[i + 1] if i + 1 < len(args) else None
        try:
            path = Path(resolve(value)) if value else None
            loaded = yaml.safe_load(path.read_text()) if path is not None and path.is_file() else None
        except (OSError, UnicodeDecodeError, yaml.YAMLError):
            continue  # jsonargparse says what is wrong with the file
        if isinstance(loaded, dict) and not subcommands & set(loaded):
            after = next((a for a in args[i:] if a in subcommands), "fit")
            raise ConfigError("--config", value, f"is given before the subcommand, where only a config keyed by "
                              f"subcommand (`{after}: {{trainer: ...}}`) is read; put it after the subcommand: "
                              f"`lightning-ffpa {after} --config {value}`")


def check_flow_values(args: list[str]) -> None:
    """`--opt '{r:4}'`: YAML reads `r:4` as one key (a flow mapping needs a space after its colons), and
    jsonargparse then says only "Expected a path"; name the option and the spacing that works."""
    import yaml

    for i, option in enumerate(args):
        if not option.startswith("--"):
            continue
        if "=" in option:
            option, _, value = option.partition("=")
        elif i + 1 < len(args):
            value = args[i + 1]
        else:
            continue
        if not value.lstrip().startswith(("{", "[")) or not re.search(r":\S", value):
            continue
        try:
            parsed = yaml.safe_load(value)
        except yaml.YAMLError:
            continue  # jsonargparse says what is wrong with it
        if any(":" in key for key in _mapping_keys(parsed)):
            spaced = re.sub(r"(?<=[\w\]}'\"]):(?=[^\s/])", ": ", value)
            raise ConfigError(option, value, f"a YAML flow mapping needs a space after each colon: write {spaced!r}")


def _mapping_keys(value: Any) -> Iterator[str]:
    """Every string key of the mappings in `value`, nested ones included."""
    if isinstance(value, dict):
        for key, item in value.items():
            if isinstance(key, str):
                yield key
            yield from _mapping_keys(item)
    elif isinstance(value, list):
        for item in value:
            yield from _mapping_keys(item)


def check_folder_writable(folder: str | os.PathLike, option: str) -> None:
    """A folder the run will create or write into: its nearest existing ancestor must be a writable folder (a file
    there, or a read-only one, fails later as an OSError traceback from the logger or the checkpoint save)."""
    path = Path(folder).absolute()
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        where = "is a file" if existing == path else f"is under the file {existing}"
        raise ConfigError(option, str(folder), f"{where}, not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        where = "is" if existing == path else f"would be created in {existing}, which is"
        raise ConfigError(option, str(folder), f"{where} not writable (read-only or another user's)")
    if existing != path:  # the fit creates it: try (`access` passes for root, and on file systems that refuse later)
        try:
            os.rmdir(tempfile.mkdtemp(prefix=".lightning-ffpa-probe-", dir=existing))
        except OSError as err:
            raise ConfigError(option, str(folder), f"cannot be created in {existing} ({err.strerror})") from None
