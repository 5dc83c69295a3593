"""Mask factories: one `generate_causal` (bottom-right shift, optional sliding window) for training and rollouts."""

import pytest
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


def _block_mask_fields(bm):
    return [getattr(bm, k) for k in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
                                     "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")]


def _same_block_structure(ours, torchs):
    """Equal sparse structure: the counts, and the indices each count covers (the rest of a row is unused)."""
    assert ours.seq_lengths == torchs.seq_lengths and ours.BLOCK_SIZE == torchs.BLOCK_SIZE
    fields = list(zip(_block_mask_fields(ours), _block_mask_fields(torchs)))
    for (num, num_t), (idx, idx_t) in zip(fields[0::2], fields[1::2]):
        assert torch.equal(num, num_t)
        used = torch.arange(idx.shape[-1], device=idx.device) < num[..., None]
        assert torch.equal(torch.where(used, idx, -1), torch.where(used, idx_t, -1))


def test_build_block_mask_equals_torchs_create_block_mask(monkeypatch):
    """The eager, row-chunked builder gives torch's block structure for the masks the product builds: causal,
    sliding, shifted, padded, packed documents, lengths off the block size, and chunks of a few query blocks."""
    from torch.nn.attention.flex_attention import create_block_mask

    gen = torch.Generator().manual_seed(0)
    docs = torch.cat([torch.full((n,), i) for i, n in enumerate([100, 37, 250, 125])])[None].repeat(2, 1)
    padding = torch.rand(2, 512, generator=gen) > 0.1
    cases = [
        (masks.generate_causal(), 1, 512, 512, 128),
        (masks.generate_sliding_window(100), 1, 512, 512, 128),
        (masks.generate_causal(300, 700, window=150), 1, 300, 700, 128),
        (masks.combine(masks.generate_causal(), masks.generate_padding(padding)), 2, 512, 512, 128),
        (masks.combine(masks.generate_sliding_window(64), masks.generate_document(docs)), 2, 512, 512, 64),
        (masks.with_offsets(masks.generate_causal(), 3, 5), 1, 200, 333, 32),
    ]
    monkeypatch.setattr(masks, "_CHUNK_ELEMENTS", 3 * 128 * 128)  # several chunks of query rows
    for mod, batch, q_len, kv_len, block in cases:
        ours = masks.build_block_mask(mod, batch, q_len, kv_len, "cpu", block_size=block)
        torchs = create_block_mask(mod, batch, None, q_len, kv_len, device="cpu", BLOCK_SIZE=block)
        _same_block_structure(ours, torchs)
        assert ours.mask_mod is mod


@pytest.mark.gpu
def test_build_block_mask_equals_torchs_on_cuda_at_16k():
    """On the GPU, at a Gemma4 sliding layer's training shape with packed documents: torch's structure."""
    from torch.nn.attention.flex_attention import create_block_mask

    docs = torch.cat([torch.full((n,), i) for i, n in enumerate([5000, 3000, 8384])])[None].cuda()
    for mod in (masks.generate_sliding_window(1024),
                masks.combine(masks.generate_sliding_window(1024), masks.generate_document(docs))):
        ours = masks.build_block_mask(mod, 1, 16384, 16384, "cuda")
        _same_block_structure(ours, create_block_mask(mod, 1, None, 16384, 16384, device="cuda"))
