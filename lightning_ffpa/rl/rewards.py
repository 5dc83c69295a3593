"""Reward functions: the TRL signature check, summing several functions into one reward per completion, and
toy rewards for tests and demos.

A reward function is `f(prompts, completions, completion_ids, **kwargs) -> list[float | None]`
(TRL's signature); None means "not applicable to this sample": NaN in the table of each function's rewards
(left out of that function's logged mean and std, TRL's nanmean), 0 in the weighted sum (TRL's nansum). As in TRL, a
prompt given as a chat (a list of {role, content}) makes its completions chats too: `[{"role": "assistant",
"content": text}]` (`trl_completions`); a text prompt's completions are text. Functions
arrive as callables: from YAML, jsonargparse imports a dotted path (`my_project.rewards.my_reward`).
Does not own prompts, generation or advantages.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import inspect
import numbers
import traceback
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from lightning_ffpa.errors import ConfigError, InputError, one_line

RewardFn = Callable[..., list]
OPTION = "RolloutCallback.reward_funcs"  # as a Python user builds it, and as YAML's class_path names it
REQUIRED = ("prompts", "completions", "completion_ids")


def _name(fn: Callable) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def check_reward_funcs(funcs: Sequence[Any], option: str = "reward_funcs") -> list[RewardFn]:
    """Each entry must be callable with TRL's keywords `prompts, completions, completion_ids, **kwargs`."""
    if not funcs:
        raise ConfigError(option, list(funcs), "give at least one reward function (a dotted import path in YAML)")
    for i, fn in enumerate(funcs):
        if not callable(fn):
            raise ConfigError(f"{option}[{i}]", fn, "is not callable (give a dotted path to a function)")
        try:
            params = inspect.signature(fn).parameters.values()
        except (TypeError, ValueError) as err:  # a builtin without a signature cannot be checked
            raise ConfigError(f"{option}[{i}]", _name(fn), "has no inspectable signature; wrap it in a Python "
                              "function taking `prompts, completions, completion_ids, **kwargs`") from err
        names = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        var_kw = any(p.kind is p.VAR_KEYWORD for p in params)
        missing = [n for n in REQUIRED if n not in names and not var_kw] + ([] if var_kw else ["**kwargs"])
        if missing:
            raise ConfigError(f"{option}[{i}]", _name(fn),
                              f"must accept `prompts, completions, completion_ids, **kwargs` (TRL's reward "
                              f"signature); missing {', '.join(missing)}")
    return list(funcs)


def reward_names(funcs: Sequence[Callable]) -> list[str]:
    """The reward functions' short names, as their metrics are logged (`rollout/reward/<name>` and its `_std`); a
    name two share gets its position (`partial_0`, `partial_1`)."""
    names = [getattr(fn, "__name__", None) or type(fn).__name__ for fn in funcs]
    return [f"{n}_{i}" if names.count(n) > 1 else n for i, n in enumerate(names)]


def trl_completions(prompts: Sequence[Any], texts: Iterable[str]) -> list[Any]:
    """Completions as TRL passes them to reward functions: a one-message assistant chat where the prompt is a
    chat (TRL's conversational format), the text itself where the prompt is text."""
    return [[{"role": "assistant", "content": t}] if isinstance(p, list) else t for p, t in zip(prompts, texts)]


def total_reward(funcs: Sequence[RewardFn], prompts: list[Any], completions: list[str],
                 completion_ids: list[list[int]], **kwargs: Any) -> torch.Tensor:
    """Sum of every function's rewards, one float per completion (None counts as 0)."""
    table = rewards_by_function(funcs, prompts, completions, completion_ids, **kwargs)
    return weighted_total(table, torch.ones(table.shape[1]))


def weighted_total(by_function: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """(completions,) weighted sum of `rewards_by_function`'s table, None (NaN there) counting as 0 (TRL's
    nansum)."""
    return by_function.nan_to_num(0.0) @ weights.to(by_function.dtype)


@dataclasses.dataclass(frozen=True)
class RewardState:
    """What TRL passes reward functions as `trainer_state` (for shaping by progress): the optimizer step about to
    run, the epoch, and the run's `max_steps` (-1: set by epochs)."""

    global_step: int
    epoch: int
    max_steps: int


def rewards_by_function(funcs: Sequence[RewardFn], prompts: list[Any], completions: list[str],
                        completion_ids: list[list[int]], **kwargs: Any) -> torch.Tensor:
    """(completions, functions): each function's reward of each completion, NaN where it returned None (not
    applicable: `weighted_total` counts it as 0). Async functions (TRL takes them too) run concurrently, after the
    plain ones."""
    outs = []
    for j, fn in enumerate(funcs):
        try:  # the user's code: its exception is one line (the traceback stays chained for --debug)
            outs.append(fn(prompts=prompts, completions=completions, completion_ids=completion_ids, **kwargs))
        except Exception as err:
            raise _raised(fn, j, err) from err
    pending = [j for j, out in enumerate(outs) if inspect.isawaitable(out)]
    for j, result in zip(pending, _await_all([outs[j] for j in pending])):
        if isinstance(result, BaseException):
            raise _raised(funcs[j], j, result) from result
        outs[j] = result
    table = torch.zeros(len(completion_ids), len(funcs))
    for j, (fn, out) in enumerate(zip(funcs, outs)):
        where = f"`{OPTION}[{j}]`: reward function {_name(fn)}"
        r = _values(out, where, len(completion_ids))
        values = torch.tensor([0.0 if x is None else float(x) for x in r])  # None checked apart, below
        if len(r) != len(completion_ids):
            raise InputError(f"{where} returned {len(r)} values for {len(completion_ids)} completions")
        if not torch.isfinite(values).all():  # a NaN returned would read as None (or poison the advantages)
            i = int((~torch.isfinite(values)).nonzero()[0])
            raise InputError(f"{where} returned {r[i]} for completion {i}; return a finite number, or None for "
                             "'not applicable' (counted as 0)")
        # None: not applicable (TRL's NaN), kept apart from a 0 the function gave
        table[:, j] = values.masked_fill(torch.tensor([x is None for x in r], dtype=torch.bool), float("nan"))
    return table


def _raised(fn: Callable, j: int, err: BaseException) -> InputError:
    """One line for a reward function's exception: what it raised, and where in the user's code."""
    frame = traceback.extract_tb(err.__traceback__)[-1]  # where in the user's code (or what it called)
    return InputError(f"`{OPTION}[{j}]`: reward function {_name(fn)} raised {type(err).__name__}: {one_line(err)} (at "
                      f"{Path(frame.filename).name}:{frame.lineno}; `--debug` prints the traceback)")


def _await_all(awaitables: list[Any]) -> list[Any]:
    """The async reward functions' results (or exceptions), gathered concurrently; in a thread of its own where
    this thread already runs an event loop (a notebook)."""
    if not awaitables:
        return []

    async def gather() -> list[Any]:
        return await asyncio.gather(*awaitables, return_exceptions=True)

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(gather())
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, gather()).result()


def _values(out: Any, where: str, n: int) -> list[Any]:
    """A reward function's return as a list of numbers or None; anything else is one line naming what came."""
    if isinstance(out, torch.Tensor) or type(out).__module__ == "numpy":
        out = out.tolist()
    if not isinstance(out, (list, tuple)):
        raise InputError(f"{where} returned a {type(out).__name__}; return a list of {n} numbers, one per completion")
    for i, x in enumerate(out):
        if x is not None and not isinstance(x, numbers.Real):  # a string of digits would pass float() silently
            raise InputError(f"{where} returned {x!r} ({type(x).__name__}) for completion {i}; return a number, "
                             "or None for 'not applicable'")
    return list(out)


def token_range_reward(prompts: list[Any], completions: list[str], completion_ids: list[list[int]],
                       low: int = 0, high: int = 64, **kw: Any) -> list[float | None]:
    """Toy reward: the fraction of completion tokens with id in [low, high)."""
    return [sum(low <= t < high for t in ids) / len(ids) if ids else None for ids in completion_ids]


def length_reward(prompts: list[Any], completions: list[str], completion_ids: list[list[int]],
                  **kw: Any) -> list[float | None]:
    """Toy reward: completion length in tokens."""
    return [float(len(ids)) for ids in completion_ids]


def even_token_reward(prompts: list[Any], completions: list[str], completion_ids: list[list[int]],
                      **kw: Any) -> list[float | None]:
    """Toy reward: the fraction of completion tokens with an even id. Random weights sample about half even ids
    with spread between completions, so every group has reward variance (a benchmark's advantages are not 0)."""
    return [sum(t % 2 == 0 for t in ids) / len(ids) if ids else None for ids in completion_ids]
