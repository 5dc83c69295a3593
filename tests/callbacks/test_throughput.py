"""TokenThroughput helpers: real-token counting, peak table, analytic FLOPs against a hand count."""

import pytest
import torch
import transformers

from lightning_ffpa.callbacks.throughput import (
    BF16_PEAK_FLOPS,
    _keys_per_query,
    count_real_tokens,
    train_flops_per_batch,
)
from lightning_ffpa.presets import build_text_config


def test_count_real_tokens():
    labels = torch.tensor([[1, 2, -100], [-100, -100, 5]])
    assert count_real_tokens({"labels": labels, "input_ids": labels}) == 3
    assert count_real_tokens({"attention_mask": torch.tensor([[1, 1, 0]])}) == 2
    assert count_real_tokens({"input_ids": torch.zeros(2, 5)}) == 10
    with pytest.raises(TypeError, match="count_real_tokens"):
        count_real_tokens("text")


def test_keys_per_query():
    assert _keys_per_query(4, None, True) == pytest.approx((1 + 2 + 3 + 4) / 4)
    assert _keys_per_query(4, 2, True) == pytest.approx((1 + 2 + 2 + 2) / 4)
    assert _keys_per_query(4, None, False) == 4


def test_flops_match_a_hand_count():
    cfg = build_text_config("tiny")
    model = transformers.Gemma4ForCausalLM(cfg)
    b, s = 2, 64
    linear = sum(p.numel() for layer in model.model.layers for p in layer.parameters() if p.dim() == 2)
    attn = 0
    for layer in model.model.layers:
        a = layer.self_attn
        heads = a.q_proj.out_features // a.head_dim
        attn += 4 * b * heads * s * _keys_per_query(s, a.sliding_window, True) * a.head_dim
    expected = 3 * (2 * (linear + model.lm_head.weight.numel()) * b * s + attn)
    assert train_flops_per_batch(model, b, s) == pytest.approx(expected)
    assert BF16_PEAK_FLOPS["H200"] == 989e12


def test_flops_of_a_wrapped_multimodal_moe_equal_its_text_model():
    """Gemma4ForConditionalGeneration keeps its layers (and `top_k_experts`) in the text part; with each layer
    wrapped for activation checkpointing the count must still find them and count top_k of the experts."""
    from lightning_ffpa.parallel import parallelize

    text = build_text_config("tiny-moe")
    causal = transformers.Gemma4ForCausalLM(text)
    multimodal = transformers.Gemma4ForConditionalGeneration(
        transformers.Gemma4Config(text_config=text.to_dict(), vision_config=None, audio_config=None))
    parallelize(multimodal, None, activation_checkpointing="selective")
    assert text.top_k_experts < text.num_experts
    assert train_flops_per_batch(multimodal, 2, 32) == pytest.approx(train_flops_per_batch(causal, 2, 32))


def test_a_context_parallel_rank_counts_its_share_of_the_batch():
    """CP peers are handed the same full batch and each does 1/cp of it: counting it whole on every rank
    multiplied samples, tokens and FLOPs by cp."""
    from lightning_ffpa.callbacks.throughput import TokenThroughput

    monitor = TokenThroughput()
    batch = {"input_ids": torch.zeros(4, 16, dtype=torch.long), "labels": torch.zeros(4, 16, dtype=torch.long)}
    whole = (monitor.batch_size_fn(batch), monitor.length_fn(batch))
    monitor._cp = 2
    assert (monitor.batch_size_fn(batch), monitor.length_fn(batch)) == (whole[0] / 2, whole[1] / 2) == (2, 32)
