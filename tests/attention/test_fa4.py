"""The "fa4" sliding-window kernel on CPU: its op contract on the reference stand-in, the backend's dispatch to it
(dense and packed), the counted fallback to Flex, the plan's refusals, SAC and FLOPs."""

from types import SimpleNamespace

import pytest
import torch
import transformers
from torch.utils.flop_counter import FlopCounterMode

from lightning_ffpa import saved_ops
from lightning_ffpa.attention import backend, fa4, force_kernel, registry
from lightning_ffpa.attention.documents import PackedDocuments
from lightning_ffpa.attention.plan import resolve_plan
from lightning_ffpa.callbacks import FFPAAttention
from lightning_ffpa.errors import ConfigError
from lightning_ffpa.parallel import checkpointing, parallelize
from lightning_ffpa.presets import build_text_config
from tests.parallel._steps import count_ops

FWD = torch.ops.lightning_ffpa.fa4_fwd.default


def naive_window(q, k, v, scale, window):
    """float64 causal sliding-window attention on [B,S,H,D] (a key is seen when 0 <= q - k < window)."""
    q, k, v = (t.double() for t in (q, k, v))
    g = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(g, 2), v.repeat_interleave(g, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    gap = torch.arange(q.shape[1])[:, None] - torch.arange(k.shape[1])[None, :]
    s = s.masked_fill(~((gap >= 0) & (gap < window)), float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, -1), v)


def _qkv(b=2, s=12, hq=4, hkv=2, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, s, h, d, generator=g, requires_grad=True) for h in (hq, hkv, hkv)]


@pytest.mark.parametrize("window", [1, 4, 100])
def test_dense_op_matches_naive_forward_and_grads(window):
    q, k, v = _qkv()
    out = fa4.fa4_attention(q, k, v, 0.5, window)
    grad = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad)
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    want = naive_window(qd, kd, vd, 0.5, window)
    want_grads = torch.autograd.grad(want, (qd, kd, vd), grad.double())
    torch.testing.assert_close(out.double(), want.detach(), atol=1e-5, rtol=1e-5)
    for got, ref in zip((dq, dk, dv), want_grads):
        torch.testing.assert_close(got.double(), ref, atol=1e-5, rtol=1e-5)


def test_varlen_op_keeps_documents_apart_and_windows_them():
    q, k, v = (t.detach()[:1].reshape(12, t.shape[2], 8).requires_grad_() for t in _qkv())
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    out = fa4.fa4_varlen_attention(q, k, v, cu, 7, 0.5, 3)
    out.sum().backward()
    for s0, s1 in ((0, 5), (5, 12)):
        seg = [t.detach()[None, s0:s1] for t in (q, k, v)]
        torch.testing.assert_close(out[s0:s1].detach().double(), naive_window(*seg, 0.5, 3)[0], atol=1e-5, rtol=1e-5)
    assert q.grad is not None and torch.isfinite(q.grad).all()


def test_flops_are_counted_with_the_registry_formula():
    q, k, v = (t.detach() for t in _qkv())
    with FlopCounterMode(display=False) as counter:
        fa4.fa4_attention(q, k, v, 0.5, 4)
    assert counter.get_total_flops() == registry.get("fa4").flops(2, 12, 12, 4, 8)


def _tiny_ffpa():
    backend.register_ffpa()
    torch.manual_seed(0)
    cfg = build_text_config("tiny")
    cfg._attn_implementation = "eager"
    model = transformers.Gemma4ForCausalLM(cfg).float()
    model.set_attn_implementation("ffpa")
    return model


@pytest.fixture
def sliding():
    """Set the backend's sliding kernel for one test (back to Flex after)."""
    def use(kernel):
        backend.register_ffpa(sliding=kernel)
        backend.reset_dispatch_counts()

    yield use
    backend.register_ffpa(sliding="flex")


def _loss_and_grads(model, ids, **kwargs):
    model.zero_grad(set_to_none=True)
    with force_kernel("reference"):
        loss = model(input_ids=ids, labels=ids, use_cache=False, **kwargs).loss
        loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_backend_sends_sliding_layers_to_fa4_and_matches_flex(sliding):
    """Sliding layers (window 16 < 40 tokens) take the fa4 op; loss and grads equal the Flex path's."""
    model = _tiny_ffpa()
    ids = torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(1))
    sliding("flex")
    loss_flex, grads_flex = _loss_and_grads(model, ids)
    assert backend.dispatch_counts()["fa4-dense"] == 0 and backend.fallback_counts() == {"flex_cpu": 2}
    sliding("fa4")
    with fa4.cpu_stand_in():
        loss_fa4, grads_fa4 = _loss_and_grads(model, ids)
    counts = backend.dispatch_counts()
    assert counts["fa4-dense"] == 2 and counts["sdpa"] == 0 and counts["ffpa-dense"] == 2, counts
    assert backend.fallback_counts() == {}
    torch.testing.assert_close(loss_fa4, loss_flex, atol=1e-5, rtol=1e-5)
    for name, g in grads_flex.items():
        rel = ((grads_fa4[name] - g).norm() / g.norm().clamp_min(1e-12)).item()
        assert rel < 2e-4, (name, rel)


def test_packed_sliding_layers_take_fa4_varlen(sliding):
    model = _tiny_ffpa()
    ids = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(2))
    starts = torch.zeros(2, 32, dtype=torch.bool)
    starts[:, [10, 25]] = True
    docs = PackedDocuments.from_starts(starts)
    position_ids = torch.cat([torch.arange(n) for n in (10, 15, 7)]).expand(2, -1)
    sliding("flex")
    loss_flex, _ = _loss_and_grads(model, ids, documents=docs, position_ids=position_ids)
    sliding("fa4")
    with fa4.cpu_stand_in():
        loss_fa4, _ = _loss_and_grads(model, ids, documents=docs, position_ids=position_ids)
    counts = backend.dispatch_counts()
    assert counts["fa4-varlen"] == 2 and counts["ffpa-varlen"] == 2, counts
    torch.testing.assert_close(loss_fa4, loss_flex, atol=1e-5, rtol=1e-5)


def test_fa4_that_cannot_run_falls_back_to_flex_counted_and_warned(sliding):
    """`auto` on a machine without FA4 (here: CPU, no stand-in): every sliding call is counted, warned once."""
    model = _tiny_ffpa()
    ids = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(1))
    sliding("fa4")
    with pytest.warns(backend.FFPAFallbackWarning, match=r"fallback \(fa4_unavailable\).*-> flex"):
        _loss_and_grads(model, ids)
    assert backend.fallback_counts() == {"fa4_unavailable": 2, "flex_cpu": 2}
    assert backend.dispatch_counts()["fa4-dense"] == 0


def test_plan_refuses_an_explicit_fa4_that_cannot_run():
    cpu = torch.device("cpu")
    with pytest.raises(ConfigError, match=r"^`FFPAAttention.sliding='fa4'`: flash-attn-4 cannot run here"):
        resolve_plan("ffpa", 1, FFPAAttention(sliding="fa4"), cpu, 256)
    with fa4.cpu_stand_in():
        assert resolve_plan("ffpa", 1, FFPAAttention(sliding="fa4"), cpu, 256).sliding_kernel == "fa4"
        with pytest.raises(ConfigError, match="head_dim=512 is outside FA4's 8-256"):
            resolve_plan("ffpa", 1, FFPAAttention(sliding="fa4"), cpu, 512)
        ring = resolve_plan("sdpa", 2, FFPAAttention(sliding="fa4"), cpu, 256)  # the ring's sliding layers
        assert ring.ring_sliding_backend == "fa4" and ring.describe() == "ring CP=2, sliding=fa4"
        assert resolve_plan("sdpa", 2, FFPAAttention(), cpu, 256).ring_sliding_backend == "auto"  # the default
        assert resolve_plan("sdpa", 2, FFPAAttention(sliding="flex"), cpu, 256).ring_sliding_backend is None
        for explicit in ("fa4", "flex"):  # `flex` beside sdpa ran nothing of its own, exit 0
            with pytest.raises(ConfigError, match=rf"^`FFPAAttention.sliding='{explicit}'`: applies to the 'ffpa' "
                                                  r"backend .*attn_implementation='sdpa'"):
                resolve_plan("sdpa", 1, FFPAAttention(attn_implementation="sdpa", sliding=explicit), cpu, 256)
        assert resolve_plan("sdpa", 1, FFPAAttention(attn_implementation="sdpa"), cpu, 256).sliding == "auto"
    # HF raised it from `on_fit_start`, after the model was built: a traceback, exit 1
    with pytest.raises(ConfigError, match=r"^`FFPAAttention.attn_implementation='bogus'`: is unknown; choose one of"):
        resolve_plan("sdpa", 1, SimpleNamespace(attn_implementation="bogus", sliding="auto"), cpu, 256)
    # a Callback built in Python (the drop-in way) fails where it is built, not when the fit starts
    with pytest.raises(ConfigError, match=r"^`FFPAAttention.attn_implementation='bogus'`: is unknown; choose one of"):
        FFPAAttention(attn_implementation="bogus")
    plan = resolve_plan("ffpa", 1, FFPAAttention(sliding="auto"), cpu, 512)  # auto: never an error, Flex counted
    assert plan.sliding_kernel == "fa4" and plan.describe() == "attn_implementation=ffpa"  # the default, unnamed
    assert resolve_plan("ffpa", 1, FFPAAttention(sliding="flex"), cpu, 256).describe() == \
        "attn_implementation=ffpa, sliding=flex"
    with pytest.raises(ConfigError, match=r"^`FFPAAttention.sliding='fast'`: must be one of"):
        FFPAAttention(sliding="fast")


@pytest.mark.parametrize("mode,per_layer", [("selective", 1), ("full", 2)])
def test_sac_saves_the_fa4_forward(sliding, mode, per_layer):
    sliding("fa4")
    assert FWD in saved_ops.registered() and FWD in checkpointing.default_save_ops()
    model = _tiny_ffpa()
    parallelize(model, None, activation_checkpointing=mode)
    with fa4.cpu_stand_in(), force_kernel("reference"):
        counts = count_ops(model, {FWD})
    n_sliding = build_text_config("tiny").layer_types.count("sliding_attention")
    assert counts[FWD] == per_layer * n_sliding


def test_preflight_refuses_fa4_on_this_machine_naming_the_option():
    import lightning as L

    from lightning_ffpa.module import Gemma4LM
    from lightning_ffpa.validation import check_parallel_layout

    trainer = L.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False,
                        callbacks=[FFPAAttention(sliding="fa4")])
    with pytest.raises(ConfigError, match=r"^`FFPAAttention.sliding='fa4'`: flash-attn-4 cannot run here"):
        check_parallel_layout(trainer, Gemma4LM(preset="tiny", attn_implementation="ffpa"))
    with fa4.cpu_stand_in():  # the plan reads the sliding head_dim (32) from the model: FA4 takes it
        check_parallel_layout(trainer, Gemma4LM(preset="tiny", attn_implementation="ffpa"))


def test_head_dims_follow_the_architecture():
    """FA4 has SM90 kernels for 8-256 but SM100 ones only for 8-128 and 256 (flash_attn/cute/interface.py)."""
    from lightning_ffpa._compat import fa4 as fa4_compat

    assert all(fa4_compat.head_dim_supported(d, 9) for d in (8, 160, 256))
    assert [fa4_compat.head_dim_supported(d, 10) for d in (64, 128, 160, 256)] == [True, True, False, True]
    kernel = registry.get("fa4")
    with fa4.cpu_stand_in():
        assert kernel.why_not(160, torch.bfloat16, torch.device("cpu")) == ""  # the stand-in takes the range
        assert kernel.why_not(264, torch.bfloat16, torch.device("cpu")) == "head_dim"
        assert kernel.why_not(100, torch.bfloat16, torch.device("cpu")) == "head_dim"  # not a multiple of 8


def test_an_all_ones_attention_mask_still_sends_sliding_layers_to_fa4(sliding):
    """A data loader passes `attention_mask` of ones (nothing padded): the sliding layers' mask is still a plain
    window, so FA4 takes them as without a mask (before, any mask tensor sent every sliding call to Flex)."""
    model = _tiny_ffpa()
    ids = torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(1))
    sliding("fa4")
    with fa4.cpu_stand_in():
        loss, _ = _loss_and_grads(model, ids, attention_mask=torch.ones_like(ids))
        counts = backend.dispatch_counts()
        assert counts["fa4-dense"] == 2 and counts["flex"] == 0, counts
        loss_none, _ = _loss_and_grads(model, ids)
    torch.testing.assert_close(loss, loss_none)
    holes = torch.ones_like(ids)
    holes[1, 10:15] = 0  # padding between tokens: the window over absolute positions stays on Flex, counted
    sliding("fa4")
    with fa4.cpu_stand_in():
        _loss_and_grads(model, ids, attention_mask=holes)
    assert backend.dispatch_counts()["fa4-dense"] == backend.dispatch_counts()["fa4-varlen"] == 0
    assert backend.fallback_counts()["fa4_mask"] == 2  # every sliding call counted, not silent


@pytest.mark.parametrize("side", ["right", "left"])
def test_padded_rows_take_fa4_varlen_on_the_sliding_layers_and_match_flex(sliding, side):
    """A batch with padded rows (a GRPO update's completions): the sliding layers unpad and run FA4's varlen form
    with the window; loss and grads over the kept tokens equal Flex's window-and-padding mask."""
    model = _tiny_ffpa()
    ids = torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, -13:] = 0 if side == "right" else 1
    if side == "left":
        mask[1, :13] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[1, 13] = -100 if side == "left" else labels[1, 13]  # its logit sits on a padded position: not scored

    def run():
        model.zero_grad(set_to_none=True)
        with force_kernel("reference"):
            loss = model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss
            loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    sliding("flex")
    loss_flex, grads_flex = run()
    sliding("fa4")
    with fa4.cpu_stand_in():
        loss_fa4, grads_fa4 = run()
    counts = backend.dispatch_counts()
    assert counts["fa4-varlen"] == 2 and counts["fa4-dense"] == counts["flex"] == 0, counts
    assert "fa4_mask" not in backend.fallback_counts()
    torch.testing.assert_close(loss_fa4, loss_flex, atol=1e-5, rtol=1e-5)
    for name, g in grads_flex.items():
        rel = ((grads_fa4[name] - g).norm() / g.norm().clamp_min(1e-12)).item()
        assert rel < 2e-4, (name, rel)


@pytest.mark.parametrize("deterministic", [False, True])
def test_the_backward_is_deterministic_when_torch_is_asked_to_be(monkeypatch, deterministic):
    """`trainer.deterministic: true` (torch.use_deterministic_algorithms) reaches FA4's backward as its
    `deterministic` flag; its default fast path otherwise (dQ accumulated with atomics)."""
    from lightning_ffpa._compat import fa4 as fa4_compat

    seen = {}

    def fake_bwd(q, k, v, o, do, lse, *args, **kwargs):
        seen.update(kwargs)
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)

    monkeypatch.setattr(fa4_compat, "_load", lambda: (None, SimpleNamespace(_flash_attn_bwd=fake_bwd), ""))
    q = torch.zeros(1, 4, 2, 8)
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(deterministic)
    try:
        fa4_compat.backward(q, q, q, q, q, torch.zeros(1, 2, 4), 1.0, 3)
    finally:
        torch.use_deterministic_algorithms(before)
    assert seen["deterministic"] is deterministic
