"""Reward functions: resolving TRL-signature callables from import-path strings, plus toy rewards for tests.

A reward function is `f(prompts, completions, completion_ids, **kw) -> list[float | None]`
(TRL's signature); None means "not applicable to this sample" and counts as 0 after summing.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

RewardFn = Callable[..., list]


def resolve_reward_funcs(paths: list[str], option: str = "reward_funcs") -> list[RewardFn]:
    """Import each `pkg.module:func` (or `pkg.module.func`); one clear error names the option."""
    if not paths:
        raise ValueError(f"`{option}` is empty: give at least one reward function import path")
    funcs = []
    for path in paths:
        mod_name, _, attr = path.partition(":") if ":" in path else path.rpartition(".")
        try:
            fn = getattr(importlib.import_module(mod_name), attr)
        except (ImportError, AttributeError, ValueError) as err:
            raise ValueError(f"`{option}` entry {path!r} cannot be imported: {err}") from err
        if not callable(fn):
            raise ValueError(f"`{option}` entry {path!r} is not callable")
        funcs.append(fn)
    return funcs


def token_range_reward(prompts: list[Any], completions: list[str], completion_ids: list[list[int]],
                       low: int = 0, high: int = 64, **kw: Any) -> list[float | None]:
    """Toy reward: the fraction of completion tokens with id in [low, high)."""
    return [sum(low <= t < high for t in ids) / len(ids) if ids else None for ids in completion_ids]


def length_reward(prompts: list[Any], completions: list[str], completion_ids: list[list[int]],
                  **kw: Any) -> list[float | None]:
    """Toy reward: completion length in tokens."""
    return [float(len(ids)) for ids in completion_ids]
