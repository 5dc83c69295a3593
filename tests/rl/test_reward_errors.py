"""A reward function's bad result or exception is one line naming the function and the option (exit 2 through the
console), not a silent 0 (NaN went through `nan_to_num`) or a traceback; its exception stays chained for --debug."""

from __future__ import annotations

import math

import pytest

from lightning_ffpa.errors import InputError
from lightning_ffpa.rl.rewards import total_reward

IDS = [[1, 2], [3]]
OPTION = "`RolloutCallback.reward_funcs[1]`: reward function "  # the failing one is second


def nan_reward(prompts, completions, completion_ids, **kw):
    return [1.0, math.nan]


def none_reward(prompts, completions, completion_ids, **kw):
    return [None, 2.0]


def failing_reward(prompts, completions, completion_ids, **kw):
    raise KeyError("answer")


def short_reward(prompts, completions, completion_ids, **kw):
    return [1.0]


def text_reward(prompts, completions, completion_ids, **kw):
    return ["good", "bad"]


def digit_string_reward(prompts, completions, completion_ids, **kw):
    return ["1", "0"]  # float() took these: trained on without a word


def scalar_reward(prompts, completions, completion_ids, **kw):
    return 1.0


@pytest.mark.parametrize("fn, why", [
    (nan_reward, "returned nan for completion 1; return a finite number, or None for 'not applicable' (counted as 0)"),
    (failing_reward, "raised KeyError: 'answer'"),
    (short_reward, "returned 1 values for 2 completions"),
    (text_reward, "returned 'good' (str) for completion 0; return a number, or None for 'not applicable'"),
    (digit_string_reward, "returned '1' (str) for completion 0; return a number, or None for 'not applicable'"),
    # was "raised TypeError: 'float' object is not iterable", as if the function itself had failed
    (scalar_reward, "returned a float; return a list of 2 numbers, one per completion"),
])
def test_a_bad_reward_function_is_one_line_naming_it(fn, why):
    with pytest.raises(InputError) as err:
        total_reward([none_reward, fn], ["p", "p"], ["a", "b"], IDS)
    text = str(err.value)
    if "raised" in why:  # the user's own code failed: where, and how to see the traceback
        assert text.startswith(f"{OPTION}{__name__}.{fn.__name__} {why} (at ")
        assert text.endswith("; `--debug` prints the traceback)")
    else:
        assert text == f"{OPTION}{__name__}.{fn.__name__} {why}"
    if fn is failing_reward:
        assert "(at test_reward_errors.py:" in text
        assert isinstance(err.value.__cause__, KeyError)  # --debug prints it


def test_none_still_counts_as_zero():
    assert total_reward([none_reward], ["p", "p"], ["a", "b"], IDS).tolist() == [0.0, 2.0]


def test_numbers_of_any_kind_are_taken():
    import numpy as np
    import torch

    def kinds(prompts, completions, completion_ids, **kw):
        return [np.float32(0.5), True]

    assert total_reward([kinds], ["p", "p"], ["a", "b"], IDS).tolist() == [0.5, 1.0]
    assert total_reward([lambda **kw: torch.tensor([1.0, 2.0])], ["p", "p"], ["a", "b"], IDS).tolist() == [1.0, 2.0]


def test_async_reward_functions_are_awaited_and_their_errors_are_one_line():
    """TRL awaits async reward functions; they were refused here (a coroutine is not a list)."""

    async def async_length(prompts, completions, completion_ids, **kw):
        return [float(len(ids)) for ids in completion_ids]

    async def async_failing(prompts, completions, completion_ids, **kw):
        raise KeyError("solution")

    assert total_reward([async_length, none_reward], ["p", "p"], ["a", "b"], IDS).tolist() == [2.0, 3.0]
    with pytest.raises(InputError, match=r"reward function .*async_failing raised KeyError: 'solution' \(at "):
        total_reward([async_failing], ["p", "p"], ["a", "b"], IDS)
