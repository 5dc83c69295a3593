"""GRPO batch layout: rows, masks, logprobs and advantages placed where the policy's loss reads them."""

import pytest
import torch

from lightning_ffpa.rl.batch import build_grpo_batch, repeat_groups
from lightning_ffpa.rl.grpo import group_advantages


def test_build_grpo_batch_layout():
    prompts = repeat_groups([[5, 6], [7]], 2)  # two prompts, G=2
    assert prompts == [[5, 6], [5, 6], [7], [7]]
    completions = [[1, 2, 3], [4], [], [8, 9]]
    logprobs = [[-0.1, -0.2, -0.3], [-0.4], [], [-0.5, -0.6]]
    rewards = torch.tensor([1.0, 0.0, 2.0, 4.0])
    b = build_grpo_batch(prompts, completions, logprobs, rewards, group_advantages(rewards, 2), pad_token_id=99)
    assert b["input_ids"].tolist() == [[5, 6, 1, 2, 3], [5, 6, 4, 99, 99], [7, 99, 99, 99, 99], [7, 8, 9, 99, 99]]
    assert b["attention_mask"].tolist() == [[1] * 5, [1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 0, 0]]
    assert b["completion_mask"].tolist() == [[0, 0, 1, 1, 1], [0, 0, 1, 0, 0], [0] * 5, [0, 1, 1, 0, 0]]
    # a completion token's logprob sits at its own position; everything else is 0
    assert b["old_logprobs"][0].tolist() == pytest.approx([0, 0, -0.1, -0.2, -0.3])
    assert b["old_logprobs"][3].tolist() == pytest.approx([0, -0.5, -0.6, 0, 0])
    assert (b["old_logprobs"] * (1 - b["completion_mask"])).abs().sum() == 0
    torch.testing.assert_close(b["advantages"], group_advantages(rewards, 2))
    assert b["advantages"][0] > 0 > b["advantages"][1] and b["advantages"][2] < 0 < b["advantages"][3]
    with pytest.raises(ValueError, match="must match"):
        build_grpo_batch(prompts, completions[:3], logprobs, rewards, group_advantages(rewards, 2))
