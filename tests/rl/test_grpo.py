"""GRPO advantages and loss against a hand-computed example; DAPO's asymmetric clip; reward signature checks."""

import math

import pytest
import torch

from lightning_ffpa.errors import ConfigError
from lightning_ffpa.rl.grpo import group_advantages, grpo_loss
from lightning_ffpa.rl.rewards import check_reward_funcs, length_reward, token_range_reward, total_reward


def test_group_advantages_by_hand():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    adv = group_advantages(r, 4)
    std = math.sqrt(1 / 3)  # unbiased std of [1, 0, 0, 1]
    expect = [0.5 / (std + 1e-4), -0.5 / (std + 1e-4)] * 1
    assert adv[:2].tolist() == pytest.approx(expect)
    assert adv[4:].abs().max() == 0  # identical rewards: zero advantage
    with pytest.raises(ValueError, match="num_generations"):
        group_advantages(r, 3)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_a_tied_group_gets_exactly_zero_advantage(scale):
    """A group rewarded 1/6 eight times got ~1e-4 each (the mean's rounding over std + eps), and AdamW turned that
    noise into a full step of every weight."""
    r = torch.cat([torch.full((8,), 1 / 6), torch.full((8,), 0.7), torch.linspace(0, 1, 8)])
    adv = group_advantages(r, 8, scale)
    assert torch.equal(adv[:16], torch.zeros(16)) and adv[16:].abs().min() > 0


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


def test_asymmetric_clip_bounds_dapo():
    """clip_eps bounds the ratio below (1 - clip_eps), clip_eps_high above (1 + clip_eps_high): swapping them
    changes which tokens are clipped, the loss and the gradients."""
    old = torch.zeros(2, 1)
    logp = torch.tensor([[math.log(1.25)], [math.log(0.7)]], requires_grad=True)
    adv = torch.tensor([1.0, -2.0])
    mask = torch.ones(2, 1)
    loss, stats = grpo_loss(logp, old, adv, mask, clip_eps=0.2, clip_eps_high=0.28)
    loss.backward()
    # token 0: ratio 1.25 <= 1 + 0.28 with A > 0, not clipped: -1.25.
    # token 1: ratio 0.7 < 1 - 0.2 with A < 0, clipped: -min(0.7 * -2, 0.8 * -2) = 1.6.
    assert loss.item() == pytest.approx((-1.25 + 1.6) / 2, rel=1e-6)
    assert stats["clip_fraction"].item() == pytest.approx(0.5)
    torch.testing.assert_close(logp.grad, torch.tensor([[-1.25 / 2], [0.0]]))  # a clipped token has no gradient
    # Swapped bounds clip token 0 at 1.2 and token 1 at 0.72: a different loss.
    swapped, _ = grpo_loss(logp.detach(), old, adv, mask, clip_eps=0.28, clip_eps_high=0.2)
    assert swapped.item() == pytest.approx((-1.2 + 1.44) / 2, rel=1e-6)
    symmetric, _ = grpo_loss(logp.detach(), old, adv, mask, clip_eps=0.2)  # clip_eps_high=None: symmetric
    assert symmetric.item() == pytest.approx((-1.2 + 1.6) / 2, rel=1e-6)


def _no_kwargs(prompts, completions, completion_ids):
    return [0.0] * len(completions)


def _no_ids(prompts, completions):
    return [0.0] * len(completions)


def _ids_in_kwargs(prompts, completions, **kwargs):  # TRL-valid: completion_ids arrives in kwargs
    return [0.0] * len(completions)


def _only_kwargs(**kwargs):
    return [1.0] * len(kwargs["completions"])


def test_reward_signatures_are_checked_by_name():
    valid = [token_range_reward, _only_kwargs, _ids_in_kwargs]
    assert check_reward_funcs(valid) == valid
    with pytest.raises(ConfigError, match=r"`reward_funcs\[1\]=.*_no_kwargs'`: .*missing \*\*kwargs"):
        check_reward_funcs([length_reward, _no_kwargs])
    with pytest.raises(ConfigError, match=r"_no_ids.*missing completion_ids, \*\*kwargs$"):
        check_reward_funcs([_no_ids])
    with pytest.raises(ConfigError, match="at least one"):
        check_reward_funcs([])
    with pytest.raises(ConfigError, match="not callable"):
        check_reward_funcs([3])


def test_total_reward_sums_functions_and_none_counts_zero():
    ids = [[1, 2, 100], []]
    total = total_reward([token_range_reward, length_reward], ["p", "p"], ["a", ""], ids, answer=["x", "y"])
    assert total.tolist() == pytest.approx([2 / 3 + 3.0, 0.0])


def test_policy_logprobs_recompute_cleanly_under_activation_checkpointing():
    """A KV cache would grow in the recompute: the checkpointed policy must match the plain one."""
    import copy

    import transformers

    from lightning_ffpa.parallel import parallelize
    from lightning_ffpa.presets import build_text_config
    from lightning_ffpa.rl.logprobs import full_token_logprobs as token_logprobs

    torch.manual_seed(0)
    plain = transformers.Gemma4ForCausalLM(build_text_config("tiny"))
    ckpt = parallelize(copy.deepcopy(plain), None, activation_checkpointing="full")
    batch = {"input_ids": torch.randint(0, 512, (2, 24)), "attention_mask": torch.ones(2, 24, dtype=torch.long)}
    for m in (plain, ckpt):
        token_logprobs(m, batch).sum().backward()
    for (name, p), q in zip(plain.named_parameters(), ckpt.parameters()):
        torch.testing.assert_close(q.grad, p.grad, atol=1e-5, rtol=1e-4, msg=name)


def test_sampler_weights_scale_each_token_and_carry_no_gradient():
    """On-policy (old = logp detached) the gradient is -A * w * d logp per token, averaged per sequence and
    over sequences; the weights min(exp(policy - sampler), cap) get no gradient of their own."""
    from lightning_ffpa.rl.grpo import sampler_weights

    logp = torch.log(torch.tensor([[0.5, 0.25, 0.1], [0.3, 0.2, 0.6]])).requires_grad_()
    sampler = logp.detach() - torch.log(torch.tensor([[1.0, 2.0, 4.0], [0.5, 1.0, 1.5]]))
    adv, mask = torch.tensor([1.0, -2.0]), torch.tensor([[1, 1, 1], [1, 1, 0]])
    w = sampler_weights(logp, sampler, cap=3.0)
    assert torch.allclose(w, torch.tensor([[1.0, 2.0, 3.0], [0.5, 1.0, 1.5]])) and not w.requires_grad
    loss, stats = grpo_loss(logp, logp.detach(), adv, mask, token_weights=w)
    loss.backward()
    want = -adv[:, None] * w * mask / mask.sum(1, keepdim=True) / 2
    assert torch.allclose(logp.grad, want) and stats["clip_fraction"] == 0
