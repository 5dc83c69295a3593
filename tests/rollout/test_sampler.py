"""Sampler statistics: empirical frequencies match the filtered, temperature-scaled distribution."""

import pytest
import torch

from lightning_ffpa.rollout.sampler import SamplingParams, sample


def _freq(logits, params, n=20000):
    g = torch.Generator().manual_seed(0)
    tokens, logprobs = sample(logits.expand(n, -1).contiguous(), params, g)
    return torch.bincount(tokens, minlength=logits.shape[-1]).float() / n, tokens, logprobs


LOGITS = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])


def test_temperature_frequencies_and_logprobs():
    params = SamplingParams(temperature=0.7)
    freq, tokens, logprobs = _freq(LOGITS, params)
    expect = torch.softmax(LOGITS[0] / 0.7, -1)
    assert (freq - expect).abs().max() < 0.015
    torch.testing.assert_close(logprobs, torch.log(expect)[tokens])


def test_top_k_and_top_p_filter():
    freq, _, _ = _freq(LOGITS, SamplingParams(temperature=1.0, top_k=2))
    p = torch.softmax(LOGITS[0, :2], -1)
    assert freq[2:].sum() == 0 and (freq[:2] - p).abs().max() < 0.015
    probs = torch.softmax(LOGITS[0], -1)  # [0.56, 0.21, 0.13, ...]: top_p=0.7 keeps the first two
    freq, _, _ = _freq(LOGITS, SamplingParams(temperature=1.0, top_p=0.7))
    assert freq[2:].sum() == 0 and (freq[:2] - probs[:2] / probs[:2].sum()).abs().max() < 0.015


def test_greedy_and_validation():
    tokens, logprobs = sample(LOGITS, SamplingParams(temperature=0.0))
    assert tokens.item() == 0 and logprobs.item() == pytest.approx(torch.log_softmax(LOGITS, -1)[0, 0].item())
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
