"""Sampler statistics: empirical frequencies match the filtered, temperature-scaled distribution."""

import pytest
import torch

from lightning_ffpa.errors import ConfigError
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


def _expected(logits, temperature, keep):
    """The sampler's target distribution: softmax of the scaled logits over the `keep` token ids."""
    p = torch.zeros(logits.shape[-1])
    p[keep] = torch.softmax(logits[0, keep] / temperature, -1)
    return p


def test_top_p_applies_to_the_scaled_then_top_k_filtered_distribution():
    """Top-p must sort the temperature-scaled, top-k-filtered logits. Each case keeps a different set than
    top-p over the raw logits would: [0, 1] at T=1 and top_p=0.7 (see above), but at T=2 the flatter
    distribution [.36, .22, .17, .13, ...] keeps [0, 1, 2]; with top_k=3 the renormalised [.62, .23, .14]
    keeps [0, 1] at top_p=0.8, where the raw [.56, .21, .13, ...] would keep [0, 1, 2]; T=2 with top_k=2
    gives [.62, .38], which keeps [0] at top_p=0.6, where the raw logits would keep [0, 1]."""
    for params, keep in ((SamplingParams(temperature=2.0, top_p=0.7), [0, 1, 2]),
                         (SamplingParams(temperature=1.0, top_k=3, top_p=0.8), [0, 1]),
                         (SamplingParams(temperature=2.0, top_k=2, top_p=0.6), [0])):
        freq, tokens, logprobs = _freq(LOGITS, params)
        expect = _expected(LOGITS, params.temperature, keep)
        assert (freq - expect).abs().max() < 0.015, (params, freq, expect)
        # logprobs stay those of the scaled distribution before filtering (what the policy recomputes)
        torch.testing.assert_close(logprobs, torch.log_softmax(LOGITS[0] / params.temperature, -1)[tokens])


def test_greedy_and_validation():
    tokens, logprobs = sample(LOGITS, SamplingParams(temperature=0.0))
    assert tokens.item() == 0 and logprobs.item() == pytest.approx(torch.log_softmax(LOGITS, -1)[0, 0].item())
    for bad, option in ((dict(top_p=0.0), "sampling.top_p"), (dict(top_p=1.5), "sampling.top_p"),
                        (dict(temperature=-0.1), "sampling.temperature"), (dict(top_k=-1), "sampling.top_k"),
                        (dict(max_new_tokens=0), "sampling.max_new_tokens")):
        with pytest.raises(ConfigError, match=f"^`{option}="):
            SamplingParams(**bad).check()
