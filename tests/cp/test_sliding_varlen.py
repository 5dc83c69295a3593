"""The ring's sliding layers through a varlen kernel ("fa4"): the local call as packed documents equals the masked
local call (fp32 math), outputs and gradients, on every rank's layout, with documents and padding, for a halo
(window - 1 <= chunk) and an all-gather (window - 1 > chunk). FA4 runs through its CPU reference kernels
(`fa4.cpu_stand_in()`), so this exercises the real index building and dispatch; a 2-rank fit is in
tests/parallel (`sliding: fa4` at CP=2)."""

import pytest
import torch

from lightning_ffpa.attention import fa4
from lightning_ffpa.cp import sliding
from lightning_ffpa.cp.layout import RingLayout


def _documents(b: int, s: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    docs = torch.full((b, s), -1, dtype=torch.long)
    for row in range(b):
        pos, doc = 0, 0
        end = s - int(torch.randint(0, 5, (1,), generator=g))  # trailing padding
        while pos < end:
            n = int(torch.randint(1, 12, (1,), generator=g))
            docs[row, pos:min(pos + n, end)] = doc
            pos, doc = pos + n, doc + 1
    return docs


@pytest.mark.parametrize("window", [1, 4, 7, 13], ids=lambda w: f"window{w}")
@pytest.mark.parametrize("cp", [2, 3])
def test_varlen_local_call_equals_the_masked_one(cp, window):
    b, c, hq, hk, d = 2, 6, 4, 2, 8
    docs = _documents(b, 2 * cp * c, seed=cp * 100 + window)
    h = window - 1
    allgather = h > c
    for rank in range(cp):
        layout = RingLayout(docs, rank, cp)
        length = cp * 2 * c if allgather else 2 * (h + c) if h else 2 * c
        g = torch.Generator().manual_seed(rank)
        q = torch.randn(b, 2 * c, hq, d, generator=g, requires_grad=True)
        k = torch.randn(b, length, hk, d, generator=g, requires_grad=True)
        v = torch.randn(b, length, hk, d, generator=g, requires_grad=True)
        masks = sliding._mask_tensors(layout, h, allgather, q.device)
        want = sliding.local_attention(q, k, v, masks, window, 0.3, "sdpa", layout)
        index = sliding._varlen_index(layout, h, masks["k_pos"], allgather)
        with fa4.cpu_stand_in():
            got = sliding._varlen_attention(q, k, v, index, window, 0.3, "fa4")
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        dy = torch.randn_like(want)
        grads_want = torch.autograd.grad(want, (q, k, v), dy)
        grads_got = torch.autograd.grad(got, (q, k, v), dy)
        for a, w_ in zip(grads_got, grads_want):
            torch.testing.assert_close(a, w_, atol=1e-5, rtol=1e-5)
        # every local query of a document is some sequence's query, and no key is read twice by one sequence
        real = index["q_idx"][index["q_idx"] >= 0]
        assert real.numel() == int((layout.local_document_ids() >= 0).sum()) == real.unique().numel()


def test_a_layout_of_padding_only_gives_zeros_and_no_sequence():
    layout = RingLayout(torch.full((1, 16), -1, dtype=torch.long), 1, 2)
    masks = sliding._mask_tensors(layout, 3, False, torch.device("cpu"))
    index = sliding._varlen_index(layout, 3, masks["k_pos"], False)
    assert index["max_len"] == 0 and index["cu"].tolist() == [0]
    q = torch.randn(1, 8, 2, 4)
    k = torch.randn(1, 14, 1, 4)
    with fa4.cpu_stand_in():
        assert not sliding._varlen_attention(q, k, k, index, 4, 0.5, "fa4").any()
