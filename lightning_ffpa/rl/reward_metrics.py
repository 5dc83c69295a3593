"""The rollout's reward statistics, defined as TRL's GRPOTrainer logs them (`_generate_and_score_completions`).

Owns what each `rollout/` reward statistic is computed from and how it aggregates (a kind per statistic: its
values are reduced over the step and, under data parallelism, over every rank, by a torchmetrics Metric, so a
rank's statistic is the global one). Logging is the rollout Callback's; the rewards themselves are `rewards.py`'s.
"""

from __future__ import annotations

from typing import Literal

import torch
from torchmetrics import MaxMetric, MeanMetric, Metric, MinMetric
from torchmetrics.utilities import dim_zero_cat

from lightning_ffpa.rl.algorithm import GRPOAlgorithm
from lightning_ffpa.rl.grpo import zero_std_groups
from lightning_ffpa.rl.rewards import weighted_total

Kind = Literal["mean", "std", "min", "max"]
Stat = tuple[str, Kind, torch.Tensor]  # (name under `rollout/`, how it aggregates, this rank's values)


class NanStd(Metric):
    """Unbiased std of every value updated with (all ranks'), NaN left out: TRL's `nanstd`. The values are kept,
    not running sums: rewards are few per step, and sums of squares lose a large-mean reward's spread."""

    full_state_update = False

    def __init__(self) -> None:
        super().__init__()
        self.add_state("values", default=[], dist_reduce_fx="cat")

    def update(self, values: torch.Tensor) -> None:
        self.values.append(values.detach().float().flatten())

    def compute(self) -> torch.Tensor:
        # a list on one rank, one tensor after the ranks' sync
        if isinstance(self.values, list) and not self.values:
            return torch.tensor(float("nan"), device=self.device)
        x = dim_zero_cat(self.values)
        x = x[~x.isnan()]
        return x.std() if x.numel() > 1 else x.new_tensor(float("nan"))  # torch's: one value has no spread


def make_metric(kind: Kind) -> Metric:
    """The Metric that reduces a statistic of `kind`; means skip NaN (a reward function's None)."""
    if kind == "mean":
        return MeanMetric(nan_strategy="ignore")
    return {"std": NanStd, "min": MinMetric, "max": MaxMetric}[kind]()


def reward_stats(algorithm: GRPOAlgorithm, by_function: torch.Tensor, weights: torch.Tensor, names: list[str],
                 lengths: torch.Tensor, group_size: int) -> list[Stat]:
    """The reward statistics of one rollout from `rewards_by_function`'s table (NaN = None).

    `reward` is the weighted sum (None as 0); with several functions each one's nanmean and nanstd
    (`reward/<name>`, `reward/<name>_std`); with overlong shaping the shaped reward. The spread is of the
    rewards the advantages are computed from, the shaped ones (`reward_spread`)."""
    total = weighted_total(by_function, weights)
    shaped = algorithm.shape_rewards(total, lengths)
    out: list[Stat] = [("reward", "mean", total)]
    if len(names) > 1:
        for j, name in enumerate(names):
            out += [(f"reward/{name}", "mean", by_function[:, j]), (f"reward/{name}_std", "std", by_function[:, j])]
    if algorithm.overlong_buffer is not None:
        out.append(("shaped_reward", "mean", shaped))
    return out + reward_spread(shaped, group_size, algorithm.scale_rewards)


def reward_spread(shaped: torch.Tensor, group_size: int, scale_rewards: str) -> list[Stat]:
    """`reward_std`, the std advantages are divided by as TRL logs it (the step's std under `batch`, else the
    mean of the groups' stds), and `frac_reward_zero_std`, the groups whose rewards tie (no advantage)."""
    if scale_rewards == "batch":
        std: Stat = ("reward_std", "std", shaped)
    else:
        std = ("reward_std", "mean", shaped.view(-1, group_size).std(1))
    return [std, ("frac_reward_zero_std", "mean", zero_std_groups(shaped, group_size).float())]
