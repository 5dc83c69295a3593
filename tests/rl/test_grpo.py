"""GRPO advantages and loss against a hand-computed example; reward-path resolution errors."""

import math

import pytest
import torch

from lightning_ffpa.rl.grpo import group_advantages, grpo_loss
from lightning_ffpa.rl.rewards import resolve_reward_funcs, token_range_reward


def test_group_advantages_by_hand():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    adv = group_advantages(r, 4)
    std = math.sqrt(1 / 3)  # unbiased std of [1, 0, 0, 1]
    expect = [0.5 / (std + 1e-4), -0.5 / (std + 1e-4)] * 1
    assert adv[:2].tolist() == pytest.approx(expect)
    assert adv[4:].abs().max() == 0  # identical rewards: zero advantage
    with pytest.raises(ValueError, match="num_generations"):
        group_advantages(r, 3)


def test_grpo_loss_by_hand():
    old = torch.zeros(2, 3)
    logp = torch.tensor([[math.log(1.5), math.log(0.9), 0.0], [math.log(0.5), 0.0, 0.0]])
    adv = torch.tensor([1.0, -2.0])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    loss, stats = grpo_loss(logp, old, adv, mask, clip_eps=0.2)
    # seq 0: tokens ratio 1.5 (clipped to 1.2) and 0.9 -> -(1.2 + 0.9)/2
    # seq 1: ratio 0.5 with A=-2: min(-1.0, 0.8*-2=-1.6) = -1.6; ratios 1, 1: -2 each -> -(-1.6-2-2)/3
    expect = (-(1.2 + 0.9) / 2 + (1.6 + 2 + 2) / 3) / 2
    assert loss.item() == pytest.approx(expect, rel=1e-6)
    assert stats["clip_fraction"].item() == pytest.approx(2 / 5)  # token 0 of each sequence is clipped
    loss_kl, stats_kl = grpo_loss(logp, old, adv, mask, beta=0.1, ref_logprobs=torch.zeros(2, 3))
    d = -logp
    kl = (torch.exp(d) - d - 1) * mask
    expect_kl = expect + 0.1 * ((kl.sum(1) / mask.sum(1)).mean().item())
    assert loss_kl.item() == pytest.approx(expect_kl, rel=1e-6)


def test_reward_resolution():
    (fn,) = resolve_reward_funcs(["lightning_ffpa.rl.rewards:token_range_reward"])
    assert fn is token_range_reward
    assert resolve_reward_funcs(["lightning_ffpa.rl.rewards.length_reward"])[0]([], ["a"], [[1, 2]]) == [2.0]
    with pytest.raises(ValueError, match="`reward_funcs` entry 'nope.mod:f'"):
        resolve_reward_funcs(["nope.mod:f"])


def test_policy_logprobs_recompute_cleanly_under_activation_checkpointing():
    """A KV cache would grow in the recompute: the checkpointed policy must match the plain one."""
    import copy

    import transformers

    from lightning_ffpa.parallel import parallelize
    from lightning_ffpa.presets import build_text_config
    from lightning_ffpa.rl.module import token_logprobs

    torch.manual_seed(0)
    plain = transformers.Gemma4ForCausalLM(build_text_config("tiny"))
    ckpt = parallelize(copy.deepcopy(plain), None, activation_checkpointing="full")
    batch = {"input_ids": torch.randint(0, 512, (2, 24)), "attention_mask": torch.ones(2, 24, dtype=torch.long)}
    for m in (plain, ckpt):
        token_logprobs(m, batch).sum().backward()
    for (name, p), q in zip(plain.named_parameters(), ckpt.parameters()):
        torch.testing.assert_close(q.grad, p.grad, atol=1e-5, rtol=1e-4, msg=name)
