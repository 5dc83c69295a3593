"""The rollout's reward statistics as TRL's GRPOTrainer logs them: the spread of the rewards the advantages are
computed from (shaped), the std advantages are scaled by, per-function nanmean/nanstd (None = not applicable).
A fresh trial found each one computed otherwise."""

import math

import lightning as L
import pytest
import torch

from lightning_ffpa.callbacks.rollout import RolloutCallback
from lightning_ffpa.rl.algorithm import GRPOAlgorithm
from lightning_ffpa.rl.module import GRPOModule
from lightning_ffpa.rl.prompts import PromptDataModule
from lightning_ffpa.rl.reward_metrics import NanStd, reward_stats
from lightning_ffpa.rl.rewards import rewards_by_function, weighted_total
from lightning_ffpa.rollout.engine import EngineConfig
from lightning_ffpa.rollout.sampler import SamplingParams

NAN = float("nan")


def tied_reward(prompts, completions, completion_ids, **kwargs):
    return [1.0] * len(completions)


class _Keep(L.Callback):
    """Keeps the rewards each GRPO batch trains on (the shaped ones), after the rollout filled it."""

    def __init__(self):
        self.rewards = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.rewards.append(batch["rewards"].clone())


@pytest.mark.timeout(120)
@pytest.mark.parametrize("scale", ["group", "batch"])
def test_reward_spread_is_logged_from_the_shaped_rewards_in_a_fit(scale):
    """Raw rewards tie in every group, lengths differ (EOS every 7th id), so the overlong-shaped rewards do not:
    the log said frac_reward_zero_std=1, reward_std=0 while advantages were not 0. Under `scale_rewards: batch`
    `reward_std` is the step's std, the one advantages are divided by (it was the groups' mean)."""
    torch.manual_seed(0)
    rollout = RolloutCallback([tied_reward], num_generations=4, eos_token_ids=list(range(0, 512, 7)),
                              sampling=SamplingParams(max_new_tokens=4),
                              engine=EngineConfig(page_size=8, num_pages=64, max_batch_size=16, max_seq_len=64,
                                                  attention="dense"))
    keep = _Keep()
    trainer = L.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[rollout, keep])
    trainer.fit(GRPOModule(preset="tiny", overlong_buffer=4, scale_rewards=scale),
                datamodule=PromptDataModule(num_random_prompts=8, prompt_len=4, batch_size=4))
    shaped = keep.rewards[0].view(-1, 4)
    assert shaped.std(1).sum() > 0  # the premise: shaping spread the tied rewards
    logged = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("rollout/")}
    want = shaped.flatten().std() if scale == "batch" else shaped.std(1).mean()
    assert logged["rollout/reward_std"] == pytest.approx(float(want))
    assert logged["rollout/frac_reward_zero_std"] == pytest.approx(float((shaped == shaped[:, :1]).all(1).float().mean()))


def _stats(algo, by_function, lengths, group_size=2, names=("a", "b")):
    algo = algo.bind(4)
    return {name: (kind, values) for name, kind, values in
            reward_stats(algo, by_function, torch.ones(by_function.shape[1]), list(names), lengths, group_size)}


def _value(kind_and_values):
    from lightning_ffpa.rl.reward_metrics import make_metric

    kind, values = kind_and_values
    metric = make_metric(kind)
    metric.update(values)
    return float(metric.compute())


def test_spread_uses_shaped_rewards():
    by_function = torch.tensor([[1.0], [1.0], [0.0], [0.0]])  # raw: both groups tie
    lengths = torch.tensor([1, 4, 4, 4])  # the first completion escapes the overlong penalty
    stats = _stats(GRPOAlgorithm(overlong_buffer=2), by_function, lengths, names=("a",))
    assert _value(stats["frac_reward_zero_std"]) == 0.5
    assert _value(stats["reward_std"]) == pytest.approx(math.sqrt(0.5) / 2)  # group stds sqrt(1/2) and 0
    assert _value(stats["reward"]) == 0.5  # the raw total, as before; `shaped_reward` is the shaped one
    assert _value(stats["shaped_reward"]) == pytest.approx(-0.25)


@pytest.mark.parametrize("scale", ["group", "none", "batch"])
def test_reward_std_is_the_std_advantages_are_scaled_by(scale):
    by_function = torch.tensor([[0.0], [1.0], [5.0], [5.0]])
    stats = _stats(GRPOAlgorithm(scale_rewards=scale), by_function, torch.ones(4, dtype=torch.long), names=("a",))
    rewards = by_function[:, 0]
    want = rewards.std() if scale == "batch" else rewards.view(-1, 2).std(1).mean()  # TRL's `reward_std`
    assert _value(stats["reward_std"]) == pytest.approx(float(want))


def none_half(prompts, completions, completion_ids, **kwargs):
    return [None if i % 2 else float(i) for i in range(len(completion_ids))]


def none_all(prompts, completions, completion_ids, **kwargs):
    return [None] * len(completion_ids)


def test_none_is_nan_per_function_and_zero_in_the_total():
    table = rewards_by_function([none_half, none_all], ["p"] * 4, ["c"] * 4, [[1]] * 4)
    assert torch.isnan(table[1::2]).all() and torch.isnan(table[:, 1]).all()
    assert weighted_total(table, torch.tensor([2.0, 1.0])).tolist() == [0.0, 0.0, 4.0, 0.0]  # TRL's nansum


def test_per_function_mean_and_std_skip_none():
    table = torch.tensor([[0.0, NAN], [NAN, NAN], [2.0, NAN], [NAN, NAN]])
    stats = _stats(GRPOAlgorithm(), table, torch.ones(4, dtype=torch.long))
    assert _value(stats["reward/a"]) == 1.0  # nanmean of 0 and 2 (None as 0 gave 0.5)
    assert _value(stats["reward/a_std"]) == pytest.approx(math.sqrt(2))  # unbiased, as TRL's nanstd
    assert math.isnan(_value(stats["reward/b"])) and math.isnan(_value(stats["reward/b_std"]))  # never applied
    assert _value(stats["reward"]) == 0.5  # the total counts None as 0


def test_a_reward_named_like_a_min_or_max_is_still_a_mean():
    stats = _stats(GRPOAlgorithm(), torch.tensor([[1.0, 0.0], [3.0, 0.0]]), torch.ones(2, dtype=torch.long),
                   names=("score_max", "b"))
    assert _value(stats["reward/score_max"]) == 2.0


def test_nan_std_is_exact_over_updates():
    metric = NanStd()
    metric.update(torch.tensor([1.0, NAN]))
    metric.update(torch.tensor([3.0, 5.0]))
    assert float(metric.compute()) == pytest.approx(2.0)


def test_nan_std_of_nothing_is_nan():
    with pytest.warns(UserWarning, match="before the ``update``"):
        assert math.isnan(float(NanStd().compute()))
