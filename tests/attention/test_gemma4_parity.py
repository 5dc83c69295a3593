"""Tiny Gemma4 (full layers at head_dim 512) with attn_implementation="ffpa" on the CPU reference vs "eager"."""

import pytest
import torch
from transformers import Gemma4ForCausalLM

from lightning_ffpa.attention import backend, force_kernel
from lightning_ffpa.presets import build_text_config

SEQ = 40  # longer than the tiny sliding window (16)


@pytest.fixture(scope="module")
def model():
    backend.register_ffpa()
    torch.manual_seed(0)
    cfg = build_text_config("tiny")
    cfg._attn_implementation = "eager"
    m = Gemma4ForCausalLM(cfg).float()
    assert [a.self_attn.head_dim for a in m.model.layers] == [32, 512, 32, 512]
    return m


def _batch(padded: bool):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 512, (2, SEQ), generator=g)
    mask = torch.ones(2, SEQ, dtype=torch.long)
    if padded:
        mask[1, 29:] = 0  # right padding in the second row
    labels = ids.masked_fill(mask == 0, -100)
    return dict(input_ids=ids, attention_mask=mask if padded else None, labels=labels)


def _run(model, impl: str, batch):
    model.set_attn_implementation(impl)
    model.zero_grad(set_to_none=True)
    with force_kernel("reference"):
        loss = model(**batch).loss
        loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("padded", [False, True], ids=["dense", "padded-varlen"])
def test_loss_and_grads_match_eager(model, padded):
    batch = _batch(padded)
    loss_e, grads_e = _run(model, "eager", batch)
    backend.reset_dispatch_counts()
    loss_f, grads_f = _run(model, "ffpa", batch)
    counts = backend.dispatch_counts()
    assert counts["ffpa-varlen" if padded else "ffpa-dense"] == 2  # both full layers took FFPA (batch of 2)
    assert counts["sdpa"] == 2 and backend.fallback_counts() == {"flex_cpu": 2}  # sliding layers
    assert torch.isfinite(loss_f)
    torch.testing.assert_close(loss_f, loss_e, atol=1e-5, rtol=1e-5)
    assert grads_f.keys() == grads_e.keys()
    # Gemma4 attends with scale 1.0 on RMS-normed q/k (logits in the hundreds), so fp32 summation order
    # alone moves gradients by ~5e-5 relative; HF's own sdpa vs eager differs by the same amount.
    for name in grads_e:
        rel = ((grads_f[name] - grads_e[name]).norm() / grads_e[name].norm().clamp_min(1e-12)).item()
        assert rel < 2e-4, (name, rel)


def test_sliding_layers_keep_their_window_through_flex(model):
    batch = _batch(padded=True)
    valid = batch["attention_mask"].bool()
    with torch.no_grad(), force_kernel("reference"):
        model.set_attn_implementation("eager")
        want = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        model.set_attn_implementation("ffpa")
        backend.reset_dispatch_counts()
        got = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        assert backend.dispatch_counts()["flex"] == 2 and backend.dispatch_counts()["ffpa-varlen"] == 2
        torch.testing.assert_close(got[valid], want[valid], atol=1e-4, rtol=1e-4)
        window = model.config.sliding_window
        model.config.sliding_window = 4 * SEQ  # dropping the window must change the result
        try:
            no_window = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        finally:
            model.config.sliding_window = window
    assert torch.allclose(got[:, :window], no_window[:, :window], atol=1e-5)  # inside the window: same
    assert not torch.allclose(got[valid], no_window[valid], atol=1e-3)


def test_flops_on_meta_match_sdpa():
    """Lightning's measure_flops (meta device) costs the FFPA ops like SDPA, never as zero."""
    from lightning.fabric.utilities.throughput import measure_flops

    backend.register_ffpa()
    cfg = build_text_config("tiny")
    flops = {}
    for impl in ("sdpa", "ffpa"):
        cfg._attn_implementation = impl
        with torch.device("meta"):
            model = Gemma4ForCausalLM(cfg)
        ids = torch.randint(0, 512, (2, 64), device="meta")
        backend.reset_dispatch_counts()
        with force_kernel("reference"):
            flops[impl] = measure_flops(model, lambda m=model, x=ids: m(input_ids=x).logits, lambda y: y.sum())
    assert backend.dispatch_counts()["ffpa-dense"] == 2
    assert flops["ffpa"] == flops["sdpa"] > 0


def test_left_padded_greedy_generation_matches_eager(model):
    """Decode steps (q_len 1, bottom-right causal) and left padding through the varlen path."""
    ids = torch.randint(0, 512, (2, 20), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
    with torch.no_grad(), force_kernel("reference"):
        model.set_attn_implementation("eager")
        want = model.generate(**kw)
        model.set_attn_implementation("ffpa")
        backend.reset_dispatch_counts()
        got = model.generate(**kw)
    assert torch.equal(got, want)
    assert backend.dispatch_counts()["ffpa-varlen"] == 2 * 3 and backend.dispatch_counts()["flex"] == 2 * 3


def test_packed_position_ids_alone_split_documents_through_varlen(model):
    """A plain HF call with restarting position_ids (no `documents=`): the same split HF's own masks make."""
    ids = torch.randint(0, 512, (1, 44), generator=torch.Generator().manual_seed(2))
    position_ids = torch.cat([torch.arange(20), torch.arange(24)])[None]  # two packed documents
    model.set_attn_implementation("ffpa")
    backend.reset_dispatch_counts()
    with force_kernel("reference"), torch.no_grad():
        packed = model(input_ids=ids, position_ids=position_ids).logits[0]
        assert backend.dispatch_counts()["ffpa-varlen"] == 2  # both full layers
        for sl in (slice(0, 20), slice(20, 44)):
            alone = model(input_ids=ids[:, sl]).logits[0]
            torch.testing.assert_close(packed[sl], alone, atol=1e-4, rtol=1e-4)


def test_whole_model_compile_without_a_mask_is_counted_not_silent(model):
    """Traced, transformers masks every mask-less batch as packed: the full layers leave FFPA under a named reason
    (it was a plain `sdpa`/`flex` count with no warning); an all-ones mask keeps them on FFPA."""
    import warnings

    ids = torch.randint(0, 512, (2, SEQ), generator=torch.Generator().manual_seed(3))
    model.set_attn_implementation("ffpa")
    compiled = torch.compile(model, backend="eager", dynamic=False)
    torch.compiler.reset()
    try:
        with force_kernel("reference"), torch.no_grad(), warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            backend.reset_dispatch_counts()
            traced = compiled(input_ids=ids, use_cache=False).logits  # a training call: no cache
            assert backend.fallback_counts().get("traced_positions") == 4  # 2 full + 2 sliding layers
            assert backend.dispatch_counts()["ffpa-dense"] == 0
            assert any("called without attention_mask" in str(w.message) for w in seen)
            backend.reset_dispatch_counts()
            masked = compiled(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits
            assert backend.dispatch_counts()["ffpa-dense"] == 2 and "traced_positions" not in backend.fallback_counts()
            torch.testing.assert_close(traced, model(input_ids=ids).logits, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(masked, traced, atol=1e-4, rtol=1e-4)
    finally:
        torch.compiler.reset()
