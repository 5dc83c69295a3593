"""Reading the user's YAML config files strictly: a duplicate key, an empty or binary file, or a section that
names a missing file is one line naming the file, where jsonargparse lets the later key win silently, says only
"Unexpected config:", or drops the reason.

Owns `check_config_file` (run on every `--config` file before jsonargparse reads it, and on the section files
it names) and `refuse_duplicate_keys` (jsonargparse's YAML loader wrapped, for the YAML it reads itself:
section files given on the command line, inline values). Does not own what the options mean (the classes the
config names check their own) or finding packaged recipes (`lightning_ffpa.recipes`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from lightning_ffpa.errors import ConfigError

__all__ = ["DuplicateKeyError", "check_config_file", "check_unique_keys", "refuse_duplicate_keys"]

SECTION_SUFFIXES = (".yaml", ".yml", ".json")


class DuplicateKeyError(yaml.constructor.ConstructorError):
    """A mapping that repeats a key (YAML allows it; the later value would silently win)."""


def check_unique_keys(text: str) -> None:
    """Raise DuplicateKeyError for the first mapping in `text` that repeats a key (merge keys `<<` excepted)."""
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError:
        return  # not YAML at all: the loader that reads it reports that
    stack = [(node, "")]
    while stack:
        node, where = stack.pop()
        if isinstance(node, yaml.MappingNode):
            seen: dict[str, int] = {}
            for key, value in node.value:
                name = key.value if isinstance(key, yaml.ScalarNode) else None
                if name is not None and name != "<<":
                    if name in seen:
                        inside = f" in `{where}`" if where else ""
                        raise DuplicateKeyError(
                            None, None, f"the key `{name}` appears twice{inside} (lines {seen[name]} and "
                            f"{key.start_mark.line + 1}); the later value would silently win", key.start_mark)
                    seen[name] = key.start_mark.line + 1
                stack.append((value, f"{where}.{name}" if where and name else name or where))
        elif isinstance(node, yaml.SequenceNode):
            stack.extend((item, where) for item in node.value)


def refuse_duplicate_keys(loader: Callable[[str], Any]) -> Callable[[str], Any]:
    """`loader` (jsonargparse's YAML loader) that first refuses a repeated key."""

    def load(text: str) -> Any:
        check_unique_keys(text)
        return loader(text)

    return load


def check_config_file(path: str | os.PathLike, option: str = "--config") -> None:
    """A config file jsonargparse will read: text, valid YAML, no repeated key, a non-empty mapping, and every
    top-level section that names a file (`trainer: trainer.yaml`) naming one that exists (checked the same way)."""
    shown = str(path)
    try:
        text = Path(path).read_bytes().decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(option, shown, f"is not a text (UTF-8) YAML file: byte {err.object[err.start]:#04x} at "
                                         f"offset {err.start}") from None
    try:
        check_unique_keys(text)
        loaded = yaml.safe_load(text)
    except yaml.YAMLError as err:
        where = getattr(err, "problem_mark", None)
        line = f" (line {where.line + 1})" if where is not None else ""
        if isinstance(err, DuplicateKeyError):
            raise ConfigError(option, shown, str(err.problem)) from None
        raise ConfigError(option, shown, f"is not valid YAML{line}: {getattr(err, 'problem', err)}") from err
    if loaded is None:
        raise ConfigError(option, shown, "is empty: it sets no option")
    if not isinstance(loaded, dict):
        raise ConfigError(option, shown, f"holds a YAML {type(loaded).__name__}, not a mapping of options "
                                         "(`trainer:`, `model:`, ...)")
    folder = Path(path).parent
    for key, value in loaded.items():
        if isinstance(value, str) and value.endswith(SECTION_SUFFIXES):
            found = next((p for p in (folder / value, Path(value)) if p.is_file()), None)
            if found is None:
                raise ConfigError(option, shown, f"section `{key}` names the file {value!r}, which does not exist "
                                                 f"(looked in {folder.absolute()} and the current folder)")
            check_config_file(found, str(key))
