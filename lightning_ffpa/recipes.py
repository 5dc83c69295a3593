"""Recipes: the shipped YAML configs, found by name, listed, and copied out for editing.

Owns: where the packaged configs live (`lightning_ffpa/configs`, a link to the repository's top-level
`configs/`, so the wheel ships the same files the docs name), resolving a bare `--config NAME` to one of
them, and the `lightning-ffpa recipes` and `lightning-ffpa cp NAME DEST` commands.
Does not own what a config contains (the classes it names check their own options).
"""

from __future__ import annotations

import os
import shutil
from importlib.resources import files
from pathlib import Path

from lightning_ffpa.errors import ArgumentParser, ConfigError
from lightning_ffpa.yaml_files import check_config_file

SUFFIXES = (".yaml", ".yml")
# The tool's `--help` head and its help-only subcommands (handled before LightningCLI, which owns fit/validate/
# test/predict): here, beside the commands, so the Lightning-free `cli` and the LightningCLI share them.
COMMANDS = {"recipes": "List the packaged recipes (names `--config` takes).",
            "cp": "Copy a packaged recipe out for editing: cp NAME DEST."}
DESCRIPTION = ("Train Hugging Face Gemma4 with Lightning from YAML configs. `--config` takes a file or a "
               "packaged recipe name (`lightning-ffpa recipes` lists them; `lightning-ffpa cp NAME DEST` copies "
               "one out for editing). Exit code 0 on success, 2 on a bad input (one `error:` line; add --debug "
               "for the traceback), 3 when NonFiniteGuard stops a diverged fit, 143 on SIGTERM and "
               "130 on Ctrl-C (each with a line naming the checkpoint to resume from).")


def recipe_dir() -> Path:
    """The folder of packaged recipes (inside the installed package)."""
    return Path(str(files("lightning_ffpa") / "configs"))


def names() -> list[str]:
    """Recipe names: the YAML file names without their suffix."""
    return sorted(p.stem for p in recipe_dir().iterdir() if p.suffix in SUFFIXES)


def find(name: str) -> Path | None:
    """The packaged recipe called `name` (with or without `.yaml`), or None."""
    stem = name[: -len(Path(name).suffix)] if Path(name).suffix in SUFFIXES else name
    if not stem or "/" in stem or os.sep in stem:
        return None
    path = recipe_dir() / f"{stem}.yaml"
    return path if path.is_file() else None


def summary(path: Path) -> str:
    """A recipe's header comment: its opening `#` lines up to the first indented (command) line."""
    words = []
    for line in path.read_text().splitlines():
        body = line[1:].removeprefix(" ") if line.startswith("#") else None
        if body is None or not body.strip() or body[0].isspace():
            break
        words.append(body.strip())
    return " ".join(words)


def _resolve(value: str) -> str:
    if value.lstrip().startswith(("{", "[")) or "\n" in value:
        return value  # an inline YAML/JSON config: jsonargparse reads it
    if os.path.isdir(value):
        raise ConfigError("--config", value, "is a folder; give a YAML file or a recipe name")
    if os.path.exists(value):
        check_config_file(value, "--config")
        return value
    found = find(value)
    if found is not None:
        return str(found)
    raise ConfigError("--config", value, f"is neither a file nor a packaged recipe ({', '.join(names())}); "
                                         "`lightning-ffpa recipes` lists them")


def resolve_config_args(argv: list[str]) -> list[str]:
    """`argv` with each `--config NAME` / `-c NAME` / `--config=NAME` naming a recipe replaced by its path."""
    out, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("--config", "-c") and i + 1 < len(argv):
            out += [arg, _resolve(argv[i + 1])]
            i += 2
            continue
        if arg.startswith("--config="):
            arg = "--config=" + _resolve(arg.removeprefix("--config="))
        out.append(arg)
        i += 1
    return out


def copy(name: str, dest: str | os.PathLike, force: bool = False) -> Path:
    """Copy recipe `name` to `dest` (a file, or an existing folder); refuses to overwrite unless `force`."""
    src = find(name)
    if src is None:
        raise ConfigError("recipe", name, f"is not a packaged recipe; choose one of {names()}")
    target = Path(dest)
    if str(dest).endswith(("/", os.sep)) and not target.is_dir():  # Path drops the slash: "newdir/" is a folder
        raise ConfigError("dest", str(dest), "names a folder (a trailing slash) that does not exist")
    if target.is_dir():
        target = target / src.name
    if target.exists() and not force:
        raise ConfigError("dest", str(target), "exists; pass --force to overwrite it")
    if not target.parent.is_dir():
        raise ConfigError("dest", str(target), "its folder does not exist")
    shutil.copyfile(src, target)
    return target


def command(argv: list[str]) -> int:
    """`lightning-ffpa recipes` (list) and `lightning-ffpa cp NAME DEST [--force]` (copy one out)."""
    if argv[0] == "recipes" or argv[1:2] == ["--list"]:
        ArgumentParser(prog="lightning-ffpa recipes", description="List the packaged recipes.").parse_args(
            [a for a in argv[1:] if a != "--list"])
        width = max(map(len, names()))
        for name in names():
            print(f"{name:<{width}}  {summary(recipe_dir() / f'{name}.yaml')}")
        return 0
    parser = ArgumentParser(prog="lightning-ffpa cp", description="Copy a packaged recipe out for editing, "
                            "then run it with `lightning-ffpa fit --config DEST`.")
    parser.add_argument("recipe", help="recipe name (see `lightning-ffpa recipes`)")
    parser.add_argument("dest", help="file to write, or an existing folder")
    parser.add_argument("--force", action="store_true", help="overwrite DEST if it exists")
    args = parser.parse_args(argv[1:])
    print(copy(args.recipe, args.dest, force=args.force))
    return 0
