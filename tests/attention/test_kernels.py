"""The op contract on the CPU reference: forward/backward vs autograd of naive math, GQA, causal, varlen."""

import pytest
import torch

from lightning_ffpa.attention import kernels, reference


def naive(q, k, v, scale, causal):
    """float64 attention with bottom-right causal; rows that see nothing give 0 (like the kernels)."""
    q, k, v = (t.double() for t in (q, k, v))
    g = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(g, 2), v.repeat_interleave(g, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    sq, sk = q.shape[1], k.shape[1]
    if causal:
        allowed = torch.arange(sk)[None, :] <= torch.arange(sq)[:, None] + (sk - sq)
        s = s.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.nan_to_num(torch.softmax(s, -1), nan=0.0)
    return torch.einsum("bhqk,bkhd->bqhd", p, v), lse


def _inputs(b, sq, sk, hq, hkv, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g, dtype=torch.float32)  # noqa: E731
    return mk(b, sq, hq, d), mk(b, sk, hkv, d), mk(b, sk, hkv, d), mk(b, sq, hq, d)


@pytest.mark.parametrize("sq,sk,causal", [(7, 7, True), (5, 9, True), (9, 5, True), (6, 4, False)])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 1), (6, 2)])
def test_dense_matches_naive_autograd(sq, sk, causal, hq, hkv):
    q, k, v, do = _inputs(2, sq, sk, hq, hkv, 8)
    scale = 0.7
    with kernels.force_kernel("reference"):
        o, lse = kernels.dense_fwd(q, k, v, scale, causal)
        dq, dk, dv = kernels.dense_bwd(do, q, k, v, o, lse, scale, causal)
    qd, kd, vd = (t.double().requires_grad_() for t in (q, k, v))
    ref_o, ref_lse = naive(qd, kd, vd, scale, causal)
    ref_o.backward(do.double())
    assert o.shape == (2, sq, hq, 8) and lse.shape == (2, hq, sq) and lse.dtype == torch.float32
    torch.testing.assert_close(o.double(), ref_o.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse.detach(), atol=1e-5, rtol=1e-5)
    assert dk.shape == k.shape and dv.shape == v.shape
    for got, want in ((dq, qd.grad), (dk, kd.grad), (dv, vd.grad)):
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    if causal and sq > sk:  # rows with no visible key
        assert torch.all(o[:, : sq - sk] == 0) and torch.all(torch.isneginf(lse[:, :, : sq - sk]))


def test_dense_accepts_transposed_views_and_autograd_wrapper():
    q, k, v, do = _inputs(2, 6, 6, 4, 2, 8)
    # HF hands [B,H,S,D] views of [B,S,H,D] storage; the wrapper takes them transposed back.
    qt, kt, vt = (t.transpose(1, 2).contiguous().transpose(1, 2).requires_grad_() for t in (q, k, v))
    with kernels.force_kernel("reference"):
        o = kernels.ffpa_attention(qt, kt, vt, 0.5, True)
    o.backward(do)
    qd, kd, vd = (t.double().requires_grad_() for t in (q, k, v))
    ref_o, _ = naive(qd, kd, vd, 0.5, True)
    ref_o.backward(do.double())
    torch.testing.assert_close(o.double(), ref_o.detach(), atol=1e-5, rtol=1e-5)
    for got, want in ((qt.grad, qd.grad), (kt.grad, kd.grad), (vt.grad, vd.grad)):
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def test_varlen_matches_per_segment_dense_with_zero_length_segments():
    lens_q, lens_k = [3, 0, 5, 2], [4, 3, 5, 0]  # a zero-length q segment and a zero-length k segment
    hq, hkv, d, scale = 4, 2, 8, 0.6
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(sum(lens_q), hq, d, generator=g).requires_grad_()
    k = torch.randn(sum(lens_k), hkv, d, generator=g).requires_grad_()
    v = torch.randn(sum(lens_k), hkv, d, generator=g).requires_grad_()
    do = torch.randn(sum(lens_q), hq, d, generator=g)
    with kernels.force_kernel("reference"):
        o, lse = kernels.ffpa_varlen_attention(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), scale, True,
                                               return_lse=True)
    o.backward(do)
    assert o.shape == (sum(lens_q), hq, d) and lse.shape == (hq, sum(lens_q))
    for i in range(len(lens_q)):
        q0, q1, k0, k1 = cu_q[i].item(), cu_q[i + 1].item(), cu_k[i].item(), cu_k[i + 1].item()
        if q1 == q0:
            continue
        if k1 == k0:  # no keys: zero output, -inf lse, zero grad
            assert torch.all(o[q0:q1] == 0) and torch.all(torch.isneginf(lse[:, q0:q1]))
            assert torch.all(q.grad[q0:q1] == 0)
            continue
        qs, ks, vs = (t.detach()[None, a:b].double().requires_grad_() for t, a, b in
                      ((q, q0, q1), (k, k0, k1), (v, k0, k1)))
        ref_o, ref_lse = naive(qs, ks, vs, scale, True)
        ref_o.backward(do[None, q0:q1].double())
        torch.testing.assert_close(o[q0:q1].double(), ref_o[0].detach(), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse[:, q0:q1].double(), ref_lse[0].detach(), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(q.grad[q0:q1].double(), qs.grad[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(k.grad[k0:k1].double(), ks.grad[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v.grad[k0:k1].double(), vs.grad[0], atol=1e-5, rtol=1e-5)


def test_dense_bwd_uses_given_lse_and_out():
    """The ring merges blocks: backward must use the o/lse it is given, not recompute its own."""
    q, k, v, do = _inputs(1, 4, 8, 2, 1, 8)
    with kernels.force_kernel("reference"):
        o1, lse1 = kernels.dense_fwd(q, k[:, :4], v[:, :4], 1.0, False)
        o2, lse2 = kernels.dense_fwd(q, k[:, 4:], v[:, 4:], 1.0, True)
        lse = torch.logaddexp(lse1, lse2)
        w1, w2 = (torch.exp(x - lse).transpose(1, 2)[..., None] for x in (lse1, lse2))
        o = w1 * o1 + w2 * o2
        g1 = kernels.dense_bwd(do, q, k[:, :4], v[:, :4], o, lse, 1.0, False)
        g2 = kernels.dense_bwd(do, q, k[:, 4:], v[:, 4:], o, lse, 1.0, True)
    qd, kd, vd = (t.double().requires_grad_() for t in (q, k, v))
    ref_o, _ = naive(qd, kd, vd, 1.0, True)  # bottom-right causal over all 8 keys == the two blocks
    ref_o.backward(do.double())
    torch.testing.assert_close(o.double(), ref_o.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close((g1[0] + g2[0]).double(), qd.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat([g1[1], g2[1]], 1).double(), kd.grad, atol=1e-5, rtol=1e-5)


def test_ops_are_custom_ops_with_fake_impls_and_flop_formulas():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.flop_counter import FlopCounterMode

    ops = kernels.forward_ops()
    assert torch.ops.lightning_ffpa.ref_dense_fwd.default in ops
    assert torch.ops.lightning_ffpa.ref_varlen_fwd.default in ops
    with FakeTensorMode():
        q, k = torch.empty(2, 16, 4, 8), torch.empty(2, 16, 2, 8)
        o, lse = torch.ops.lightning_ffpa.ref_dense_fwd(q, k, k, 1.0, True)
        assert o.shape == (2, 16, 4, 8) and lse.shape == (2, 4, 16)
    kernels.register_flop_formulas()
    kernels.register_flop_formulas()  # idempotent
    q, k, v, _ = _inputs(2, 16, 16, 4, 2, 8)
    q.requires_grad_()
    with kernels.force_kernel("reference"), FlopCounterMode(display=False) as fc:
        kernels.ffpa_attention(q, k, v, 1.0, True).sum().backward()
    assert fc.get_total_flops() == 3 * 4 * 2 * 4 * 16 * 16 * 8


def test_force_kernel_rejects_unknown_and_cutedsl_on_cpu():
    with pytest.raises(ValueError, match="force_kernel"):
        with kernels.force_kernel("triton"):
            pass
    q, k, v, _ = _inputs(1, 4, 4, 2, 2, 8)
    with kernels.force_kernel("cutedsl"), pytest.raises(RuntimeError, match="cutedsl"):
        kernels.dense_fwd(q, k, v, 1.0, True)
    with kernels.force_kernel("reference"):
        assert kernels.active_kernel() == "reference"


def test_sac_must_save_skips_the_reference_forward_on_recompute(monkeypatch):
    """SAC names the forward op as one OpOverload: MUST_SAVE runs it once, plain checkpointing twice."""
    import functools

    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

    calls = []
    math = reference._ref_fwd_math
    monkeypatch.setattr(reference, "_ref_fwd_math", lambda *a: calls.append(1) or math(*a))

    forward_ops = kernels.forward_ops()

    def policy(ctx, op, *args, **kwargs):
        must = op in forward_ops
        return CheckpointPolicy.MUST_SAVE if must else CheckpointPolicy.PREFER_RECOMPUTE

    def block(x, w):
        q = (x @ w).view(1, 8, 2, 16)
        return kernels.ffpa_attention(q, q[:, :, :1], q[:, :, :1], 1.0, True).sum()

    x, w = torch.randn(8, 32, requires_grad=True), torch.randn(32, 32, requires_grad=True)
    with kernels.force_kernel("reference"):
        checkpoint(block, x, w, use_reentrant=False).backward()
        plain, calls[:] = len(calls), []
        sac = functools.partial(create_selective_checkpoint_contexts, policy)
        checkpoint(block, x, w, use_reentrant=False, context_fn=sac).backward()
    assert (plain, len(calls)) == (2, 1)


def test_flex_options_fit_large_head_dims():
    from lightning_ffpa.attention import flex

    assert flex.kernel_options(256) == {"BACKEND": "TRITON"}  # torch's default tiles fit; never the decode kernel
    for dtype in (torch.bfloat16, torch.float32):
        opts = flex.kernel_options(512, dtype)
        assert opts["fwd_num_stages"] == 1 and opts["bwd_num_stages"] == 1
        assert all(v <= 64 for k, v in opts.items() if "BLOCK" in k)
        # torch's flex backward needs BLOCK_N1 % BLOCK_M1 == 0 and BLOCK_M2 % BLOCK_N2 == 0
        assert opts["bwd_BLOCK_N1"] % opts["bwd_BLOCK_M1"] == 0 and opts["bwd_BLOCK_M2"] % opts["bwd_BLOCK_N2"] == 0
    for opts in flex.LARGE_HEAD_DIM_CANDIDATES:
        assert opts["bwd_BLOCK_N1"] % opts["bwd_BLOCK_M1"] == 0 and opts["bwd_BLOCK_M2"] % opts["bwd_BLOCK_N2"] == 0
