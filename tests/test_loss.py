"""Chunked linear cross-entropy equals the plain softcapped loss in value and gradient."""

import pytest
import torch

from lightning_ffpa.loss import linear_cross_entropy, plain_causal_lm_loss


def _inputs(n=37, h=16, v=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(v, h, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, v, (n,), generator=g)
    labels[::5] = -100
    return hidden, weight, labels


@pytest.mark.parametrize("softcap", [None, 3.0])
@pytest.mark.parametrize("chunk_size", [8, 4096])
def test_chunked_matches_plain(softcap, chunk_size):
    hidden, weight, labels = _inputs()
    ref = plain_causal_lm_loss(hidden @ weight.t(), labels, softcap)
    ref_gh, ref_gw = torch.autograd.grad(ref * 1.7, (hidden, weight))
    out = linear_cross_entropy(hidden, weight, labels, softcap=softcap, chunk_size=chunk_size)
    gh, gw = torch.autograd.grad(out * 1.7, (hidden, weight))  # non-unit upstream grad is honoured
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(gh, ref_gh)
    torch.testing.assert_close(gw, ref_gw)


def test_softcap_changes_the_loss():
    hidden, weight, labels = _inputs()
    a = linear_cross_entropy(hidden, weight, labels, softcap=None)
    b = linear_cross_entropy(hidden, weight, labels, softcap=3.0)
    assert not torch.allclose(a, b)


def test_all_ignored_gives_zero_and_no_grad_mode():
    hidden, weight, labels = _inputs()
    out = linear_cross_entropy(hidden, weight, torch.full_like(labels, -100), softcap=3.0)
    assert out.item() == 0.0
    with torch.no_grad():
        v = linear_cross_entropy(hidden, weight, labels, softcap=3.0, chunk_size=8)
    torch.testing.assert_close(v, plain_causal_lm_loss(hidden @ weight.t(), labels, 3.0).detach())


def test_bad_inputs_name_the_option():
    hidden, weight, labels = _inputs()
    with pytest.raises(ValueError, match="chunk_size=0"):
        linear_cross_entropy(hidden, weight, labels, chunk_size=0)
    with pytest.raises(ValueError, match="impl='nope'"):
        linear_cross_entropy(hidden, weight, labels, impl="nope")
    with pytest.raises(ValueError, match="shape mismatch"):
        linear_cross_entropy(hidden, weight[:, :3], labels)


def test_liger_missing_is_a_clear_error():
    pytest.importorskip("torch")
    try:
        import liger_kernel  # noqa: F401
        pytest.skip("liger-kernel installed")
    except ImportError:
        pass
    hidden, weight, labels = _inputs()
    with pytest.raises(ImportError, match="liger"):
        linear_cross_entropy(hidden, weight, labels, impl="liger")


@pytest.mark.gpu
def test_chunked_bf16_cuda_compiled_close_to_plain():
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = (torch.randn(4096, 512, device="cuda", generator=g) * 0.5).bfloat16().requires_grad_()
    weight = (torch.randn(32768, 512, device="cuda", generator=g) * 0.05).bfloat16().requires_grad_()
    labels = torch.randint(0, 32768, (4096,), device="cuda", generator=g)
    ref = plain_causal_lm_loss(hidden @ weight.t(), labels, 30.0)
    rgh, rgw = torch.autograd.grad(ref, (hidden, weight))
    out = linear_cross_entropy(hidden, weight, labels, softcap=30.0, chunk_size=1024)
    gh, gw = torch.autograd.grad(out, (hidden, weight))
    torch.testing.assert_close(out, ref, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(gh.float(), rgh.float(), atol=2e-3, rtol=5e-2)
    torch.testing.assert_close(gw.float(), rgw.float(), atol=2e-3, rtol=5e-2)


def test_chunks_do_not_overlap_in_memory():
    """Three chunks keep no more alive than one: each chunk's d-logits is freed before the next chunk's logits."""
    from _live_peak import LivePeak

    vocab, hidden = 4096, 16
    w = torch.randn(vocab, hidden, dtype=torch.bfloat16)
    peaks = []
    for rows in (32, 96):
        h = torch.randn(rows, hidden, dtype=torch.bfloat16, requires_grad=True)
        y = torch.randint(0, vocab, (rows,))
        with LivePeak(exclude=(h, w, y)) as live:
            linear_cross_entropy(h, w, y, softcap=30.0, chunk_size=32, compile=False)
        peaks.append(live.peak)
    assert peaks[1] <= peaks[0] * 1.01, peaks
