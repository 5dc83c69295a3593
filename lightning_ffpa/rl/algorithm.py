"""`GRPOAlgorithm`: the one object that says which GRPO a run trains, made once from the module's options and
read by the module (loss, normalisation, updates per rollout) and by the rollout Callback (reward shaping,
advantages, dynamic sampling, truncated completions).

Owns the choices and their checks (each bad value is one ConfigError naming the option, raised when the module
is constructed, before any model is built) and the per-rollout decisions made from rewards. The formulas are
`rl/grpo.py`'s; generation is the Callback's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lightning_ffpa.errors import ConfigError
from lightning_ffpa.rl import grpo
from lightning_ffpa.rl.batch import build_grpo_batch

OPTION = "model"  # the algorithm's options are GRPOModule's: `model.loss_type`


@dataclass(frozen=True)
class GRPOAlgorithm:
    """The GRPO variant of a run (field meanings: `GRPOModule`'s options of the same names)."""

    loss_type: str = "grpo"
    scale_rewards: str = "group"
    clip_eps: float = 0.2
    clip_eps_high: float | None = None
    beta: float = 0.0
    num_iterations: int = 1
    max_tokens_per_microbatch: int | None = None
    mask_truncated_completions: bool = False
    dynamic_sampling: bool = False
    refill_rounds: int = 0
    overlong_buffer: int | None = None
    overlong_penalty: float = 1.0
    max_completion_length: int | None = None  # the Callback's `sampling.max_new_tokens`, bound at setup

    def __post_init__(self) -> None:
        if self.loss_type not in grpo.LOSS_TYPES:
            raise ConfigError(f"{OPTION}.loss_type", self.loss_type, f"must be one of {', '.join(grpo.LOSS_TYPES)}")
        if self.scale_rewards not in grpo.SCALE_REWARDS:
            raise ConfigError(f"{OPTION}.scale_rewards", self.scale_rewards,
                              f"must be one of {', '.join(grpo.SCALE_REWARDS)}")
        if not isinstance(self.num_iterations, int) or self.num_iterations < 1:
            raise ConfigError(f"{OPTION}.num_iterations", self.num_iterations,
                              "must be an integer >= 1 (optimizer updates per rollout)")
        if self.max_tokens_per_microbatch is not None and self.max_tokens_per_microbatch < 1:
            raise ConfigError(f"{OPTION}.max_tokens_per_microbatch", self.max_tokens_per_microbatch,
                              "must be >= 1 token, or null for one micro-batch per step")
        if not isinstance(self.refill_rounds, int) or self.refill_rounds < 0:
            raise ConfigError(f"{OPTION}.refill_rounds", self.refill_rounds, "must be an integer >= 0")
        if self.refill_rounds and not self.dynamic_sampling:
            raise ConfigError(f"{OPTION}.refill_rounds", self.refill_rounds,
                              "redraws the groups dynamic sampling would drop; set `model.dynamic_sampling: true`")
        if self.overlong_buffer is not None and self.overlong_buffer < 1:
            raise ConfigError(f"{OPTION}.overlong_buffer", self.overlong_buffer,
                              "must be >= 1 token, or null for no overlong shaping")
        if self.overlong_penalty < 0:
            raise ConfigError(f"{OPTION}.overlong_penalty", self.overlong_penalty, "must be >= 0")
        if self.overlong_penalty != 1.0 and self.overlong_buffer is None:
            raise ConfigError(f"{OPTION}.overlong_penalty", self.overlong_penalty,
                              "scales the overlong shaping, which is off; set `model.overlong_buffer` (tokens)")

    @property
    def sequence_ratio(self) -> bool:
        """GSPO's sequence-level importance ratio."""
        return self.loss_type == "gspo"

    def bind(self, max_completion_length: int, option: str = "RolloutCallback.sampling.max_new_tokens"
             ) -> GRPOAlgorithm:
        """This algorithm with the rollout's largest completion length (dr_grpo's L_max, DAPO's overlong L_max);
        raises when the overlong buffer does not fit in it."""
        if self.overlong_buffer is not None and self.overlong_buffer > max_completion_length:
            raise ConfigError(f"{OPTION}.overlong_buffer", self.overlong_buffer,
                              f"must be <= `{option}={max_completion_length}` (the buffer ends at the longest "
                              "completion)")
        return dataclasses.replace(self, max_completion_length=max_completion_length)

    def check_sequence_fits(self, tokens: int, where: str = "") -> None:
        """Raise unless one sequence of `tokens` tokens fits the micro-batch budget."""
        budget = self.max_tokens_per_microbatch
        if budget is not None and tokens > budget:
            raise ConfigError(f"{OPTION}.max_tokens_per_microbatch", budget,
                              f"is smaller than one sequence of {tokens} tokens{where}; a micro-batch holds at "
                              "least one whole sequence")

    # ---- per rollout: rewards -> what the batch trains on ----------------------------------------------
    def shape_rewards(self, rewards: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Rewards plus DAPO's soft overlong punishment when `overlong_buffer` is set."""
        if self.overlong_buffer is None:
            return rewards
        if self.max_completion_length is None:
            raise RuntimeError("GRPOAlgorithm.bind(max_completion_length) must run before overlong shaping")
        return rewards + grpo.overlong_penalty(lengths, self.max_completion_length, self.overlong_buffer,
                                               self.overlong_penalty).to(rewards.dtype)

    def advantages(self, rewards: torch.Tensor, group_size: int) -> torch.Tensor:
        """Advantages of the whole step's rewards (every rank's, gathered: `scale_rewards=batch` is global)."""
        return grpo.group_advantages(rewards, group_size, self.scale_rewards)

    def groups_to_redraw(self, rewards: torch.Tensor, lengths: torch.Tensor, group_size: int) -> list[int]:
        """Indices of the groups dynamic sampling would drop (equal shaped rewards); none without it."""
        if not self.dynamic_sampling:
            return []
        shaped = self.shape_rewards(rewards.float(), lengths)
        return grpo.zero_std_groups(shaped, group_size).nonzero().flatten().tolist()

    def kept_groups(self, rewards: torch.Tensor, group_size: int) -> torch.Tensor:
        """(num_groups,) bool: the groups the step trains on (all, or with dynamic sampling those whose rewards
        differ)."""
        if not self.dynamic_sampling:
            return torch.ones(rewards.numel() // group_size, dtype=torch.bool)
        return ~grpo.zero_std_groups(rewards, group_size)

    def rollout_batch(self, prompt_ids: list[list[int]], seqs: Sequence[Any], rewards: torch.Tensor,
                      group_size: int, pad_token_id: int = 0,
                      gather: Callable[[torch.Tensor], torch.Tensor] | None = None,
                      rank: int = 0) -> tuple[dict[str, torch.Tensor], int]:
        """The GRPO batch of one rank's rollout, and how many of its groups dynamic sampling dropped.

        `seqs` are the engine's finished sequences (`output`, `logprobs`, `finish_reason`) for `prompt_ids`, in
        consecutive groups of `group_size`. Rewards are shaped, then, with `gather` (data parallelism: every
        rank's rewards concatenated in rank order), advantages come from the whole step's rewards, so a group
        that spans ranks and `scale_rewards=batch` see every rank's; this rank keeps its slice. A rank whose
        groups are all dropped keeps its first group with no loss token, so every rank runs the same
        forward and backward.
        """
        n = len(seqs)
        if n % group_size or rewards.numel() != n:
            raise ConfigError("RolloutCallback.num_generations", group_size,
                              f"{n} completions with {rewards.numel()} rewards are not whole groups")
        lengths = torch.tensor([len(s.output) for s in seqs])
        shaped = self.shape_rewards(rewards.float(), lengths)
        if gather is None:
            advantages = self.advantages(shaped, group_size)
        else:
            everyone = gather(shaped)
            if everyone.numel() % group_size:
                raise ConfigError("RolloutCallback.num_generations", group_size,
                                  f"the ranks' {everyone.numel()} completions are not whole groups")
            advantages = self.advantages(everyone, group_size)[rank * n:(rank + 1) * n]
        kept = self.kept_groups(shaped, group_size)
        dropped = int((~kept).sum())
        loss_rows = torch.ones(n, dtype=torch.bool)
        if self.mask_truncated_completions:
            loss_rows &= torch.tensor([s.finish_reason != "length" for s in seqs])
        if not kept.any():
            kept[0] = True
            loss_rows[:group_size] = False
        rows = [i for i in range(n) if kept[i // group_size]]
        batch = build_grpo_batch([prompt_ids[i] for i in rows], [seqs[i].output for i in rows],
                                 [seqs[i].logprobs for i in rows], shaped[rows], advantages[rows], pad_token_id,
                                 loss_rows[rows])
        return batch, dropped

    def loss_weights(self, mask: torch.Tensor, num_sequences: float, num_tokens: float, local_tokens: float,
                     world_size: int = 1) -> torch.Tensor:
        """(N, T) weight of each token of this rank's step (`grpo.loss_weights` with this loss type)."""
        tokens = local_tokens if self.loss_type == "bnpo" else num_tokens
        world = 1 if self.loss_type == "bnpo" else world_size
        return grpo.loss_weights(mask, self.loss_type, num_sequences, tokens, self.max_completion_length, world)


def microbatches(lengths: list[int], budget: int | None) -> list[list[int]]:
    """Consecutive row indices per micro-batch: rows are added while (rows x longest row) stays within `budget`
    tokens (the padded size the forward pays for); `None` = one micro-batch."""
    if budget is None or not lengths:
        return [list(range(len(lengths)))]
    out: list[list[int]] = [[]]
    longest = 0
    for i, n in enumerate(lengths):
        if out[-1] and max(longest, n) * (len(out[-1]) + 1) > budget:
            out.append([])
            longest = 0
        out[-1].append(i)
        longest = max(longest, n)
    return out
