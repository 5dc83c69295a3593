"""Per-step timing, the per-row wall budget, the varying reward and the call-time estimate of `grpo_vs_trl.py`.

Owns what both GRPO rows share and need no model for: `StepClock` (each step's wall time and phases, and
whether one more step fits the row's wall budget), `lower_half_vocab_reward` (a reward that varies within a
group at random init, logging what it gave), and `trl_call_estimate` (how many TRL steps fit one GPU call at a
measured HF generate speed). Does not own the rows themselves (`grpo_vs_trl.py`) or the row processes
(`row_process.py`).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

# Full-depth 31B on one H200 (issue 42's measurement): HF generate ~112 completion tok/s at batch 16, i.e.
# ~7 decode steps/s; it is weight-read bound, so about the same steps/s at batch 8.
HF_DECODE_STEPS_PER_S = 112 / 16
BUILD_S = 60.0  # building a random-init 31B model and its trainer, before the first step
UPDATE_FLOPS_PER_TOKEN_PARAM = 4  # LoRA: forward + input gradients; the frozen weights get no weight gradient
UPDATE_FLOPS_PER_S = 4e14  # a plausible bf16 rate for HF's eager forward/backward on an H200
STEP_MARGIN = 1.1  # the next step is assumed up to 10% slower than the last


class StepClock:
    """Per-step wall time and phases, synchronising the device at each mark; `deadline` is the row's wall
    budget as a `time.perf_counter()` value (None: no budget)."""

    def __init__(self, device: str, deadline: float | None = None) -> None:
        self.device, self.deadline, self.steps, self.cur = device, deadline, [], {}

    def now(self) -> float:
        if self.device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()

    def wrap(self, obj: Any, method: str, phase: str) -> None:
        """Time every call of `obj.method` into the current step's `phase` (an instance attribute shadows it)."""
        inner = getattr(obj, method)

        def timed(*args, **kwargs):
            t = self.now()
            try:
                return inner(*args, **kwargs)
            finally:
                self.cur[phase] = self.cur.get(phase, 0.0) + self.now() - t

        setattr(obj, method, timed)

    def begin(self) -> None:
        self.cur = {"t0": self.now()}

    def end(self, completion_tokens: int) -> None:
        c = self.cur
        wall = self.now() - c.pop("t0")
        step = {"wall_s": wall, "completion_tokens": completion_tokens, **c}
        step["update_s"] = wall - sum(v for k, v in c.items())
        self.steps.append(step)
        # the row's log keeps every step's time: a row killed later still shows what it finished
        print(f"step {len(self.steps)}: {wall:.2f} s, {completion_tokens} completion tokens", flush=True)

    def out_of_time(self) -> bool:
        """Whether one more step like the last would end past the deadline (the row then stops)."""
        if self.deadline is None or not self.steps:
            return False
        return time.perf_counter() + STEP_MARGIN * self.steps[-1]["wall_s"] > self.deadline


def lower_half_vocab_reward(vocab: int, log: list[list[float]]) -> Callable[..., list[float | None]]:
    """A TRL-signature reward: the fraction of a completion's tokens with id below vocab // 2. Sampled at
    temperature 1 from any model that spreads its mass over the vocabulary, it differs between the completions
    of a group, so the advantages are not all zero. Each call's rewards are appended to `log`."""
    from lightning_ffpa.rl.rewards import token_range_reward

    def lower_half_vocab(prompts: list[Any], completions: list[Any], completion_ids: list[list[int]],
                         **kwargs: Any) -> list[float | None]:
        rewards = token_range_reward(prompts, completions, completion_ids, low=0, high=vocab // 2)
        log.append([float("nan") if r is None else r for r in rewards])
        return rewards

    return lower_half_vocab


def reward_spread(log: list[list[float]], group: int) -> dict[str, Any]:
    """Each reward call's mean within-group std, and how many groups of all calls had zero variance (their
    advantages are all zero: no learning signal). Groups are consecutive in both rows' reward calls."""
    stds, zero, groups = [], 0, 0
    for rewards in log:
        per_group = [torch.tensor(rewards[i:i + group]).std().item() for i in range(0, len(rewards), group)]
        stds.append(statistics.mean(per_group) if per_group else 0.0)
        zero += sum(s == 0 for s in per_group)
        groups += len(per_group)
    return {"calls": len(log), "group_std_mean_per_call": stds, "groups": groups, "zero_std_groups": zero}


def trl_call_estimate(layers: int, prompts: int, group: int, prompt_len: int, completion_len: int,
                      warmup: int, row_wall_s: float, params: float = 31e9, full_layers: int = 60) -> dict[str, Any]:
    """How many TRL steps fit one row's wall budget at the full-depth HF generate speed (scaled by depth)."""
    depth = layers / full_layers
    generate_s = completion_len / HF_DECODE_STEPS_PER_S * depth
    tokens = prompts * group * (prompt_len + completion_len)
    update_s = UPDATE_FLOPS_PER_TOKEN_PARAM * params * depth * tokens / UPDATE_FLOPS_PER_S
    step_s = generate_s + update_s
    fit = max(0, int((row_wall_s - BUILD_S * depth) // step_s))
    return {"trl_step_s": round(step_s, 1), "trl_generate_s": round(generate_s, 1), "trl_update_s": round(update_s, 1),
            "steps_in_row": fit, "timed_steps_in_row": max(0, fit - warmup), "row_wall_s": round(row_wall_s),
            "basis": f"HF generate at {HF_DECODE_STEPS_PER_S:.0f} decode steps/s at full depth (~112 tok/s at "
                     f"batch 16), update at {UPDATE_FLOPS_PER_S:.0e} FLOP/s, {BUILD_S:.0f} s to build (scaled by depth)"}
