"""GPU (bf16): the "fa4" sliding-window ops (flash-attn-4) against Flex at a small shape, outputs and gradients.

Run on an H100/H200 with `pytest -m gpu tests/attention/test_fa4_gpu.py` (needs flash-attn-4; skipped without it).
Truth is fp32 math on the same inputs; FA4 must be as close to it as the product's Flex path is (its error floor),
dense and packed, and the dispatch must show the fa4 paths with no fallback.
"""

import pytest
import torch

from lightning_ffpa.attention import backend, fa4, masks, registry
from lightning_ffpa.attention.flex import flex_forward
from lightning_ffpa.attention.reference import _ref_fwd_math

pytestmark = pytest.mark.gpu

B, S, HQ, HKV, D, WINDOW = 2, 1024, 8, 4, 256, 256


@pytest.fixture(autouse=True)
def _needs_fa4():
    why = registry.get("fa4").why_not(D, torch.bfloat16, torch.device("cuda"))
    if why:
        pytest.skip(f"fa4 cannot run here: {why}; {fa4.unavailable_detail()}")


def _inputs(seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    mk = lambda h: torch.randn(B, S, h, D, generator=g, device="cuda", dtype=torch.bfloat16)  # noqa: E731
    return mk(HQ), mk(HKV), mk(HKV), mk(HQ)


def _grads(fn, q, k, v, do):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v)
    out.backward(do)
    return out.detach().float(), [t.grad.float() for t in (q, k, v)]


def _flex(q, k, v):
    bm = masks.build_block_mask(masks.generate_sliding_window(WINDOW), B, S, S, q.device)
    return flex_forward(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), bm, D ** -0.5).transpose(1, 2)


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def test_dense_fa4_matches_flex_outputs_and_grads():
    q, k, v, do = _inputs()
    truth_q, truth_k, truth_v = (t.detach().float().requires_grad_() for t in (q, k, v))
    truth, _ = _ref_fwd_math(truth_q, truth_k, truth_v, D ** -0.5, True, WINDOW)
    truth.backward(do.float())
    truth_grads = [t.grad for t in (truth_q, truth_k, truth_v)]
    out_fa4, g_fa4 = _grads(lambda q, k, v: fa4.fa4_attention(q, k, v, D ** -0.5, WINDOW), q, k, v, do)
    out_flex, g_flex = _grads(_flex, q, k, v, do)
    assert _rel(out_fa4, out_flex) < 1e-2
    assert _rel(out_fa4, truth.detach()) <= 2 * _rel(out_flex, truth.detach()) + 1e-3
    for a, b, t in zip(g_fa4, g_flex, truth_grads):
        assert _rel(a, b) < 2e-2
        assert _rel(a, t) <= 2 * _rel(b, t) + 1e-3


def test_varlen_fa4_matches_each_document_alone():
    q, k, v, do = _inputs(1)
    flat = [t[0] for t in (q, k, v, do)]  # one row as two documents: [0, 400) and [400, S)
    cu = torch.tensor([0, 400, S], dtype=torch.int32, device="cuda")
    out, grads = _grads(lambda q, k, v: fa4.fa4_varlen_attention(q, k, v, cu, S - 400, D ** -0.5, WINDOW),
                        *flat[:3], flat[3])
    for s0, s1 in ((0, 400), (400, S)):
        alone, _ = _grads(lambda q, k, v: fa4.fa4_attention(q, k, v, D ** -0.5, WINDOW),
                          *(t[None, s0:s1] for t in flat[:3]), flat[3][None, s0:s1])
        assert _rel(out[s0:s1], alone[0]) < 1e-2
    assert all(torch.isfinite(g).all() for g in grads)


def test_backend_routes_sliding_layers_to_fa4_on_the_gpu():
    from lightning_ffpa.module import Gemma4LM

    backend.register_ffpa(sliding="fa4")
    try:
        module = Gemma4LM(preset="tiny", dtype="bfloat16", attn_implementation="ffpa")
        module.configure_model()
        module.cuda()
        ids = torch.randint(0, 500, (2, 64), device="cuda")
        backend.reset_dispatch_counts()
        module.model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        assert backend.dispatch_counts()["fa4-dense"] == 2 and "fa4_unavailable" not in backend.fallback_counts()
    finally:
        backend.register_ffpa(sliding="flex")
