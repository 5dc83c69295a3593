"""GSPO clips whole sequences, so its `train/clip_fraction` is a fraction of sequences, as TRL's clip ratio at
the sequence importance-sampling level (it was token-weighted), and exact over micro-batches."""

import math

import pytest
import torch

from lightning_ffpa.rl.grpo import grpo_loss
from tests.rl.test_microbatches import _batch, _module


def test_gspo_clip_fraction_counts_sequences():
    """GSPO clips whole sequences: a clipped 4-token sequence and an unclipped 1-token one are half the
    sequences (TRL's sequence-level clip ratio), not 4/5 of the tokens."""
    logp = torch.tensor([[math.log(2.0)] * 4, [0.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0]])
    _, stats = grpo_loss(logp, torch.zeros(2, 4), torch.tensor([1.0, 1.0]), mask, loss_type="gspo")
    assert stats["clip_fraction"].item() == pytest.approx(0.5)
    _, stats = grpo_loss(logp, torch.zeros(2, 4), torch.tensor([1.0, 1.0]), mask, loss_type="grpo")
    assert stats["clip_fraction"].item() == pytest.approx(0.8)  # token level: 4 of 5 tokens


def test_gspo_clip_fraction_is_exact_over_microbatches():
    batch = _batch()
    kw = dict(loss_type="gspo", old_logprobs="engine", sampler_is_cap=None, clip_eps=0.05)
    fractions = []
    for budget in (None, 24):
        module = _module(max_tokens_per_microbatch=budget, **kw)
        step = module.prepare_step(batch)
        module.backward_pass(batch, step)
        fractions.append(step.sums["clipped"] / step.sums["clip_total"])
    assert len(step.parts) >= 3
    module = _module(**kw)
    with torch.no_grad():
        logp, _ = module.token_logprobs(batch)
    mask = batch["completion_mask"][:, 1:]
    _, stats = grpo_loss(logp, batch["old_logprobs"][:, 1:], batch["advantages"], mask, clip_eps=0.05,
                         loss_type="gspo")
    assert 0 < float(stats["clip_fraction"]) < 1
    assert fractions[0] == pytest.approx(float(stats["clip_fraction"])) == pytest.approx(fractions[1])
    assert float(stats["clip_fraction"]) * 6 == pytest.approx(round(float(stats["clip_fraction"]) * 6))  # of 6 rows
