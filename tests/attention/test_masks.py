"""Mask factories: one `generate_causal` (bottom-right shift, optional sliding window) for training and rollouts."""

import torch

from lightning_ffpa.attention import masks


def _dense(mod, q_len, kv_len):
    return masks.dense_mask(mod, 1, q_len, kv_len, "cpu")[0, 0]


def test_causal_and_sliding_match_their_index_rule_with_and_without_shift():
    for q_len, kv_len, window in [(6, 6, None), (6, 6, 3), (4, 9, None), (4, 9, 2)]:
        q = torch.arange(q_len)[:, None] + (kv_len - q_len)
        kv = torch.arange(kv_len)[None, :]
        want = (kv <= q) & ((q - kv < window) if window else True)
        assert torch.equal(_dense(masks.generate_causal(q_len, kv_len, window=window), q_len, kv_len), want)
    assert torch.equal(_dense(masks.generate_sliding_window(3), 7, 7), _dense(masks.generate_causal(window=3), 7, 7))
    assert masks.generate_sliding_window(3).__name__ == "sliding_window_3"
    assert masks.generate_causal(4, 9).__name__ == "causal_shift5"
