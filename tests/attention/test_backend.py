"""The "ffpa" HF backend on CPU: registration, mask function, the routing/fallback matrix, varlen vs dense."""

import warnings

import pytest
import torch
from torch import nn
from torch.nn.attention.flex_attention import BlockMask
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, causal_mask_function
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from lightning_ffpa.attention import backend, force_kernel, kernels, masks
from lightning_ffpa.attention.backend import FFPAFallbackWarning, ffpa_attention_forward, ffpa_mask
from lightning_ffpa.attention.documents import PackedDocuments


@pytest.fixture(autouse=True)
def _clean():
    backend.register_ffpa()
    backend.reset_dispatch_counts()
    yield
    backend.reset_dispatch_counts()


class Attn(nn.Module):
    is_causal = True


def qkv(b=2, s=12, hq=4, hkv=2, d=512, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    # HF hands [B,H,S,D] transposed views of [B,S,H,D] projections.
    mk = lambda h: (torch.randn(b, s, h, d, generator=g) * d**-0.25).to(dtype).transpose(1, 2)  # noqa: E731
    return mk(hq), mk(hkv), mk(hkv)


def naive(q, k, v, mask, scale, softcap=None):
    """Reference on [B,H,S,D] with a bool mask [B|1,1,S,S]; rows with no visible key give 0."""
    g = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    s = q.double() @ k.transpose(-1, -2) * scale
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    s = s.masked_fill(~mask, float("-inf"))
    p = torch.nan_to_num(torch.softmax(s, -1), nan=0.0)
    return (p @ v).transpose(1, 2)


def causal(s):
    return torch.ones(s, s, dtype=torch.bool).tril()[None, None]


def test_registration_is_idempotent():
    backend.register_ffpa()
    backend.register_ffpa()
    assert ALL_ATTENTION_FUNCTIONS["ffpa"] is ffpa_attention_forward
    assert ALL_MASK_ATTENTION_FUNCTIONS["ffpa"] is ffpa_mask


def test_mask_function_shapes():
    pad = torch.tensor([[True] * 6, [True] * 4 + [False] * 2])
    kw = dict(batch_size=2, q_length=6, kv_length=6, mask_function=causal_mask_function)
    assert ffpa_mask(**kw) is None
    assert ffpa_mask(**kw, attention_mask=torch.ones(2, 6, dtype=torch.bool)) is None
    assert torch.equal(ffpa_mask(**kw, attention_mask=pad), pad)
    sliding = ffpa_mask(**{**kw, "mask_function": masks.generate_sliding_window(3)}, local_size=3, attention_mask=pad)
    assert isinstance(sliding, BlockMask)
    dense = masks.dense_from_block_mask(sliding, torch.device("cpu"))
    want = masks.dense_from_block_mask(masks.build_block_mask(
        masks.combine(masks.generate_sliding_window(3), masks.generate_padding(pad)), 2, 6, 6, "cpu"), "cpu")
    assert torch.equal(dense, want) and not dense[1, 0, 5, 2] and dense[0, 0, 5, 3] and not dense[0, 0, 5, 2]
    custom = ffpa_mask(**kw, allow_is_causal_skip=False)  # or/and masks, packing: not plain causal
    assert isinstance(custom, BlockMask)


def _route(q, k, v, mask=None, **kw):
    kw.setdefault("scaling", 1.0)
    out, weights = ffpa_attention_forward(Attn(), q, k, v, mask, **kw)
    assert weights is None and out.shape == (q.shape[0], q.shape[2], q.shape[1], q.shape[3])
    return out


def test_routing_matrix_paths_outputs_and_one_warning_per_reason():
    q, k, v = qkv()
    pad = torch.tensor([[True] * 12, [True] * 9 + [False] * 3])
    full = causal(12) & pad[:, None, None, :]
    block = masks.build_block_mask(masks.combine(masks.generate_sliding_window(4)), 2, 12, 12, "cpu")
    slide = masks.dense_from_block_mask(block, torch.device("cpu"))
    q64, k64, v64 = qkv(d=64)
    cases = [  # (kernel forced, inputs, kwargs, expected path, expected reason, reference mask, softcap)
        ("reference", (q, k, v, None), {}, "ffpa-dense", None, causal(12), None),
        ("reference", (q, k, v, pad), {}, "ffpa-varlen", None, full, None),
        ("reference", (q, k, v, block), {}, "flex", None, slide, None),
        ("reference", (q, k, v, block), {"softcap": 5.0}, "eager", "softcap", slide, 5.0),
        ("reference", (q, k, v, None), {"softcap": 5.0}, "eager", "softcap", causal(12), 5.0),
        ("reference", (q64, k64, v64, None), {}, "sdpa", "head_dim", causal(12), None),
        ("reference", (q64, k64, v64, pad), {}, "sdpa", "head_dim", full, None),
        ("reference", (q, k, v, None), {"scaling": None}, "sdpa", "no_scale", causal(12), None),
        ("reference", (q, k, v, full), {}, "sdpa", "4d_mask", full, None),
        (None, (q, k, v, None), {}, "sdpa", "kernel_unavailable", causal(12), None),  # no device: said first
        (None, tuple(t.bfloat16() for t in (q, k, v)) + (None,), {}, "sdpa", "kernel_unavailable", causal(12), None),
    ]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for forced, (q_, k_, v_, m), kw, path, reason, ref_mask, softcap in cases:
            for _ in range(2):  # a second identical call must not warn again
                before = backend.dispatch_counts()[path]
                with force_kernel(forced), torch.no_grad():
                    out = _route(q_, k_, v_, m, **kw)
                assert backend.dispatch_counts()[path] == before + 1, (path, reason)
            scale = kw.get("scaling", 1.0) or q_.shape[-1] ** -0.5
            want = naive(q_.float(), k_.float(), v_.float(), ref_mask, scale, softcap)
            # Compare the rows that see a key and are real tokens (padded query rows are unspecified).
            rows = ref_mask.any(-1)[:, 0] & (pad if ref_mask is full else True)
            rows = rows[:, :, None].expand(q_.shape[0], -1, q_.shape[1])  # (B, S, H)
            tol = 2e-2 if q_.dtype == torch.bfloat16 else 1e-4
            torch.testing.assert_close(out.double()[rows], want[rows], atol=tol, rtol=tol, msg=f'{path} {reason}')
    per_reason = {}
    for w in caught:
        if issubclass(w.category, FFPAFallbackWarning):
            r = str(w.message).split("(")[1].split(")")[0]
            per_reason[r] = per_reason.get(r, 0) + 1
    assert per_reason == {"softcap": 1, "head_dim": 1, "no_scale": 1, "4d_mask": 1, "kernel_unavailable": 1}
    assert backend.fallback_counts()["head_dim"] == 4
    assert kernels.kernel_counts()["reference"] == 4 and kernels.kernel_counts()["cutedsl"] == 0


def test_the_dtype_reason_is_given_only_where_the_kernel_could_run(monkeypatch):
    """fp32 on CPU was reported as `dtype`, as if bf16 would take FFPA; there the device is the reason. Where
    the kernel can run (simulated), fp32 is the reason."""
    from types import SimpleNamespace

    q, k, v = qkv()
    assert backend._fallback_reason(None, q, 0.0, 1.0, None, None) == "kernel_unavailable"
    monkeypatch.setattr(backend.registry, "get", lambda name: SimpleNamespace(unavailable=lambda device: ""))
    assert backend._fallback_reason(None, q, 0.0, 1.0, None, None) == "dtype"


def test_dropout_in_training_falls_back():
    q, k, v = qkv()
    with force_kernel("reference"), pytest.warns(FFPAFallbackWarning, match="dropout"):
        _route(q, k, v, None, dropout=0.1)
    assert backend.dispatch_counts()["sdpa"] == 1 and backend.fallback_counts() == {"dropout": 1}


def test_output_attentions_says_no_weights_are_returned():
    q, k, v = qkv()
    backend._warn_no_weights.cache_clear()
    with force_kernel("reference"), pytest.warns(UserWarning, match="output_attentions=True. returns none"):
        out, weights = ffpa_attention_forward(Attn(), q, k, v, None, scaling=512**-0.5, output_attentions=True)
    assert weights is None and backend.dispatch_counts()["ffpa-dense"] == 1  # the output itself is unchanged


def test_refusals_and_what_counts_as_packed():
    q, k, v = qkv()
    reset = torch.arange(6).repeat(2)[None].expand(2, -1)  # two documents per row
    with force_kernel("reference"):
        # Flash-style boundaries without position resets or `documents=` cannot be honoured here.
        with pytest.raises(RuntimeError, match="not from kwargs.*cu_seq_lens_q"):
            _route(q, k, v, None, cu_seq_lens_q=torch.tensor([0, 6, 12], dtype=torch.int32))
        _route(q, k, v, None, position_ids=reset)  # resets: packed, FFPA varlen over the documents
        assert backend.dispatch_counts()["ffpa-varlen"] == 1
        # A padding mask means HF did not treat position_ids as packing (left-padded generation).
        _route(q, k, v, torch.ones(2, 12, dtype=torch.bool), position_ids=reset)
        _route(q, k, v, None, position_ids=torch.arange(12)[None])
        assert backend.dispatch_counts()["ffpa-varlen"] == 2 and backend.dispatch_counts()["ffpa-dense"] == 1
        # A query sharded over a CP mesh (a DTensor) is the ring's job: refused, with the route named.
        with pytest.raises(RuntimeError, match="context parallelism.*context_parallel_size > 1"):
            _route(q.as_subclass(DTensor), k, v, None)


class DTensor(torch.Tensor):
    """Stands in for torch's DTensor: the backend recognises a CP-sharded query by its type's name."""


@pytest.mark.parametrize("window", [None, 4])
def test_packed_documents_equal_each_document_alone(window):
    """`documents=`: full calls -> varlen over the segments, sliding calls -> window AND document mask."""
    lens = [5, 4, 3]  # row 0: docs 5 + 4 + pad 3; row 1: doc 3 + pad 9 (a padding run is its own segment)
    q, k, v = qkv(b=2, hq=4, hkv=2)
    for t in (q, k, v):
        t.requires_grad_()
    doc_ids = torch.tensor([[0] * 5 + [1] * 4 + [-1] * 3, [0] * 3 + [-1] * 9])
    docs = PackedDocuments.from_document_ids(doc_ids)
    with force_kernel("reference"):
        out = _route(q, k, v, None, documents=docs, sliding_window=window)
        out.sum().backward()
        path = "ffpa-varlen" if window is None else "sdpa"  # CPU flex has no backward: dense sdpa, counted
        assert backend.dispatch_counts()[path] == 1
        for row, start, n in [(0, 0, lens[0]), (0, 5, lens[1]), (1, 0, lens[2])]:
            sl = slice(start, start + n)
            qi, ki, vi = (t.detach()[row:row + 1, :, sl].requires_grad_() for t in (q, k, v))
            i = torch.arange(n)
            mask = causal(n) if window is None else causal(n) & (i[:, None] - i[None, :] < window)
            want = naive(qi, ki, vi, mask, 1.0)
            want.sum().backward()
            torch.testing.assert_close(out[row, sl].double(), want[0], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(q.grad[row][:, sl], qi.grad[0], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(k.grad[row][:, sl], ki.grad[0], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("side", ["right", "left"])
def test_padded_batch_through_varlen_equals_per_sequence_dense(side):
    lens = [12, 7, 3]
    q, k, v = qkv(b=3, hq=4, hkv=1)
    for t in (q, k, v):
        t.requires_grad_()
    pad = torch.zeros(3, 12, dtype=torch.bool)
    for i, n in enumerate(lens):
        pad[i, :n] = True
    pad = pad if side == "right" else pad.flip(-1)
    with force_kernel("reference"):
        out = _route(q, k, v, pad)
        out.sum().backward()
        assert backend.dispatch_counts()["ffpa-varlen"] == 1
        for i in range(3):
            idx = pad[i].nonzero().squeeze(-1)
            qi, ki, vi = (t.detach()[i:i + 1, :, idx].requires_grad_() for t in (q, k, v))
            oi = _route(qi, ki, vi, None)
            oi.sum().backward()
            torch.testing.assert_close(out[i, idx], oi[0], atol=1e-5, rtol=1e-5)
            assert torch.all(out[i, ~pad[i]] == 0)
            torch.testing.assert_close(q.grad[i][:, idx], qi.grad[0], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(k.grad[i][:, idx], ki.grad[0], atol=1e-5, rtol=1e-5)
    assert backend.dispatch_counts()["ffpa-dense"] == 3


def test_packed_check_is_per_tensor_not_per_address():
    """A new position_ids tensor must be checked again even if it reuses the old one's memory."""
    q, k, v = qkv(s=6)
    counts = backend.dispatch_counts
    with force_kernel("reference"):
        _route(q, k, v, None, position_ids=torch.arange(6)[None])
        storage = torch.arange(6)[None]
        _route(q, k, v, None, position_ids=storage)
        assert counts()["ffpa-dense"] == 2 and counts()["ffpa-varlen"] == 0
        storage.copy_(torch.tensor([[0, 1, 2, 0, 1, 2]]))  # same memory, new content, new version
        _route(q, k, v, None, position_ids=storage)
        assert counts()["ffpa-varlen"] == 1
        fresh = torch.tensor([[0, 1, 2, 3, 4, 5]])
        _route(q, k, v, None, position_ids=fresh)
        assert counts()["ffpa-dense"] == 3


def test_packed_documents_refuse_a_model_mask_overlay():
    """HF marks or/and overlays (e.g. bidirectional image tokens) with use_vmap: documents must not replace them."""
    q, k, v = qkv(b=1, s=6)
    overlay = ffpa_mask(batch_size=1, q_length=6, kv_length=6, mask_function=causal_mask_function,
                        allow_is_causal_skip=False, use_vmap=True)
    docs = PackedDocuments.from_document_ids(torch.tensor([[0, 0, 0, 1, 1, 1]]))
    with force_kernel("reference"), pytest.raises(NotImplementedError, match="overlay"):
        _route(q, k, v, overlay, documents=docs)


def test_forced_cutedsl_refuses_a_call_it_cannot_take():
    """`force_kernel("cutedsl")` is the loud mode: an fp32 or CPU call raises instead of running SDPA."""
    q, k, v = qkv()
    with force_kernel("cutedsl"), pytest.raises(RuntimeError, match=r"force_kernel\('cutedsl'\) but FFPA cannot"):
        ffpa_attention_forward(Attn(), q, k, v, None, scaling=512**-0.5)
    assert backend.dispatch_counts()["sdpa"] == 0
