"""A local `model.pretrained` folder's weight files, checked from their headers before any weight is read.

Owns two checks that transformers makes only while loading, after the fit has started and written its files:
every shard the index lists is there, and the token embedding's shape is the one `config.json` describes (a
config beside another model's weights). Reading a safetensors header costs a few kilobytes per shard.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lightning_ffpa.errors import ConfigError

__all__ = ["check_weight_files"]

OPTION = "model.pretrained"


def check_weight_files(folder: Path, text_config: Any, value: str) -> None:
    """Refuse, naming `model.pretrained`, a folder whose index lists a missing shard or whose token embedding
    does not have the config's (vocab_size, hidden_size)."""
    index = next(folder.glob("*.safetensors.index.json"), None)
    if index is not None:
        try:
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError) as err:
            raise ConfigError(OPTION, value, f"has an unreadable {index.name} ({type(err).__name__}: {err})") from err
        missing = [f for f in files if not (folder / f).is_file()]
        if missing:
            raise ConfigError(OPTION, value, f"is missing {len(missing)} of the {len(files)} weight files its "
                              f"{index.name} lists, e.g. {missing[0]}")
        shards = [folder / f for f in files]
    else:
        shards = sorted(folder.glob("*.safetensors"))
    want = [getattr(text_config, "vocab_size", None), getattr(text_config, "hidden_size", None)]
    name, shape = _embedding_shape(shards)
    if shape is not None and None not in want and shape != want:
        raise ConfigError(OPTION, value, f"holds weights that do not fit its config.json: {name} is {shape}, the "
                          f"config's (vocab_size, hidden_size) is {want}")


def _embedding_shape(shards: list[Path]) -> tuple[str | None, list[int] | None]:
    """The text model's token embedding (`...embed_tokens.weight`) name and shape, from the shards' headers."""
    from safetensors import safe_open

    for shard in shards:
        with safe_open(str(shard), framework="pt") as f:
            for key in f.keys():
                if key.endswith("embed_tokens.weight") and "vision" not in key and "audio" not in key:
                    return key, list(f.get_slice(key).get_shape())
    return None, None
