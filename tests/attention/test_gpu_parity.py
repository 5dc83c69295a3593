"""GPU parity (bf16): the CuTeDSL kernels vs the fp32 reference, and the "ffpa" backend vs eager/SDPA.

Run on the H200 with `pytest -m gpu tests/attention/test_gpu_parity.py`. Every test also checks the
kernel counters, so a silent fallback to the reference or SDPA fails the test.
"""

import pytest
import torch

from lightning_ffpa.attention import backend, force_kernel, kernels

pytestmark = pytest.mark.gpu


def _cuda_ready():
    if not kernels.ffpa_available():
        pytest.fail(f"FFPA CuTeDSL is not usable on this GPU: {kernels.ffpa_unavailable_reason()}")
    backend.register_ffpa()
    backend.reset_dispatch_counts()


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


def _rand(*shape, scale=1.0):
    return (torch.randn(*shape, device="cuda") * scale).bfloat16()


@pytest.mark.parametrize("sq,sk,causal", [(512, 512, True), (384, 1024, True), (256, 256, False), (640, 512, True)])
def test_dense_kernel_matches_reference(sq, sk, causal):
    _cuda_ready()
    torch.manual_seed(0)
    b, hq, hkv, d = 2, 8, 2, 512
    q, k, v = _rand(b, sq, hq, d, scale=d**-0.25), _rand(b, sk, hkv, d, scale=d**-0.25), _rand(b, sk, hkv, d)
    do = _rand(b, sq, hq, d)
    o, lse = kernels.dense_fwd(q, k, v, 1.0, causal)
    grads = kernels.dense_bwd(do, q, k, v, o, lse, 1.0, causal)
    assert kernels.kernel_counts()["cutedsl"] == 1
    with force_kernel("reference"):
        o_r, lse_r = kernels.dense_fwd(q, k, v, 1.0, causal)
        grads_r = kernels.dense_bwd(do, q, k, v, o_r, lse_r, 1.0, causal)
    assert _rel(o, o_r) < 1e-2
    finite = torch.isfinite(lse_r)
    assert torch.equal(torch.isfinite(lse), finite)
    torch.testing.assert_close(lse[finite], lse_r[finite], atol=2e-2, rtol=1e-3)
    for g, g_r in zip(grads, grads_r):
        assert g.shape == g_r.shape and _rel(g, g_r) < 2e-2


def test_varlen_kernel_matches_reference_with_empty_segments():
    _cuda_ready()
    torch.manual_seed(0)
    lens_q, lens_k = [300, 0, 517, 64], [300, 128, 517, 0]
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    hq, hkv, d = 8, 2, 512
    q, k, v = _rand(sum(lens_q), hq, d, scale=d**-0.25), _rand(sum(lens_k), hkv, d, scale=d**-0.25), _rand(
        sum(lens_k), hkv, d)
    do = _rand(sum(lens_q), hq, d)
    args = (cu_q, cu_k, max(lens_q), max(lens_k), 1.0, True)
    o, lse = kernels.varlen_fwd(q, k, v, *args)
    grads = kernels.varlen_bwd(do, q, k, v, o, lse, *args)
    assert kernels.kernel_counts()["cutedsl"] == 1
    with force_kernel("reference"):
        o_r, lse_r = kernels.varlen_fwd(q, k, v, *args)
        grads_r = kernels.varlen_bwd(do, q, k, v, o_r, lse_r, *args)
    assert _rel(o, o_r) < 1e-2
    assert torch.all(o[-64:] == 0) and torch.all(torch.isneginf(lse[:, -64:]))  # segment with no keys
    for g, g_r in zip(grads, grads_r):
        assert _rel(g, g_r) < 2e-2


def _tiny_model():
    from transformers import Gemma4ForCausalLM

    from lightning_ffpa.presets import build_text_config

    torch.manual_seed(0)
    cfg = build_text_config("tiny")
    cfg._attn_implementation = "eager"
    return Gemma4ForCausalLM(cfg).bfloat16().cuda()  # built on CPU: HF's init, not stale GPU memory


def _loss_and_grads(model, impl, batch):
    model.set_attn_implementation(impl)
    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    return loss.detach().float(), {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("padded", [False, True], ids=["dense", "padded-varlen"])
def test_tiny_gemma4_bf16_matches_eager(padded):
    """bf16 parity: ffpa's error vs eager must be no worse than HF's own SDPA's error vs eager."""
    _cuda_ready()
    model = _tiny_model()
    ids = torch.randint(0, 512, (2, 256), device="cuda")
    mask = torch.ones_like(ids)
    if padded:
        mask[1, 200:] = 0
    batch = dict(input_ids=ids, attention_mask=mask if padded else None, labels=ids.masked_fill(mask == 0, -100))
    loss_e, grads_e = _loss_and_grads(model, "eager", batch)
    loss_s, grads_s = _loss_and_grads(model, "sdpa", batch)
    backend.reset_dispatch_counts()
    loss_f, grads_f = _loss_and_grads(model, "ffpa", batch)
    counts = backend.dispatch_counts()
    assert counts["ffpa-varlen" if padded else "ffpa-dense"] == 2 and counts["flex"] == 2, counts
    assert kernels.kernel_counts() == {"cutedsl": 2, "reference": 0}, "the CuTeDSL kernel did not run"
    assert torch.isfinite(loss_f)
    assert abs(loss_f - loss_e) <= 2 * abs(loss_s - loss_e) + 1e-2
    for name in grads_e:
        assert _rel(grads_f[name], grads_e[name]) <= 2 * _rel(grads_s[name], grads_e[name]) + 1e-2, name


def test_31b_shaped_full_attention_layer_matches_eager():
    """One Gemma4-31B full-attention layer (32 q heads, 4 kv heads, D=512, k_eq_v), bf16, S=2048."""
    from transformers.models.gemma4.modeling_gemma4 import Gemma4TextAttention, Gemma4TextRotaryEmbedding

    from lightning_ffpa.presets import build_text_config

    _cuda_ready()
    torch.manual_seed(0)
    cfg = build_text_config("gemma4-31b", num_hidden_layers=6)
    layer_idx = cfg.layer_types.index("full_attention")
    attn = Gemma4TextAttention(cfg, layer_idx).bfloat16().cuda()  # built on CPU: real init
    assert attn.head_dim == 512 and attn.num_key_value_groups == 8
    seq = 2048
    hidden = torch.randn(1, seq, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
    pos = torch.arange(seq, device="cuda")[None]
    rope = Gemma4TextRotaryEmbedding(cfg).cuda()(hidden, pos, "full_attention")
    grad_out = torch.randn(1, seq, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
    # eager needs the causal mask HF would build; sdpa and ffpa treat mask None as causal.
    causal = torch.full((seq, seq), torch.finfo(torch.bfloat16).min, device="cuda").triu(1).bfloat16()[None, None]
    masks = {"eager": causal, "sdpa": None, "ffpa": None}

    def run(impl):
        cfg._attn_implementation = impl
        attn.zero_grad(set_to_none=True)
        x = hidden.clone().requires_grad_()
        out, _ = attn(x, rope, masks[impl], {})
        out.backward(grad_out)
        return out.float(), x.grad.float(), {n: p.grad.float() for n, p in attn.named_parameters()}

    out_e, dx_e, g_e = run("eager")
    out_s, dx_s, g_s = run("sdpa")
    backend.reset_dispatch_counts()
    out_f, dx_f, g_f = run("ffpa")
    assert backend.dispatch_counts()["ffpa-dense"] == 1 and kernels.kernel_counts()["cutedsl"] == 1
    assert _rel(out_f, out_e) <= 2 * _rel(out_s, out_e) + 1e-2
    assert _rel(dx_f, dx_e) <= 2 * _rel(dx_s, dx_e) + 1e-2
    for name in g_e:
        assert _rel(g_f[name], g_e[name]) <= 2 * _rel(g_s[name], g_e[name]) + 1e-2, name


def _copy_kernels(fn) -> list[str]:
    from torch.profiler import ProfilerActivity, profile

    fn()  # JIT outside the profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
            and ("copy" in e.name.lower() or "memcpy" in e.name.lower())]


def test_backend_path_adds_no_copy_kernels():
    """HF's transposed views in, [B,S,H*D] out, fwd+bwd: no copy kernels beyond the bare kernel calls."""
    _cuda_ready()
    seq, hq, hkv, d = 1024, 32, 4, 512
    leaves = [torch.randn(1, seq, h * d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
              for h in (hq, hkv, hkv)]
    q, k, v = (x.view(1, seq, -1, d).transpose(1, 2) for x in leaves)
    grad = torch.randn(1, seq, hq * d, device="cuda", dtype=torch.bfloat16)

    class Attn(torch.nn.Module):
        is_causal = True

    def ours():
        out, _ = backend.ffpa_attention_forward(Attn(), q, k, v, None, scaling=1.0)
        torch.autograd.grad(out.reshape(1, seq, -1), leaves, grad)

    qc, kc, vc = (x.detach().view(1, seq, -1, d) for x in leaves)

    def bare():
        o, lse = kernels.dense_fwd(qc, kc, vc, 1.0, True)
        kernels.dense_bwd(grad.view(1, seq, hq, d), qc, kc, vc, o, lse, 1.0, True)

    ours_copies, bare_copies = _copy_kernels(ours), _copy_kernels(bare)
    assert backend.dispatch_counts()["ffpa-dense"] == 2
    assert len(ours_copies) == len(bare_copies), (ours_copies, bare_copies)


def test_flop_counter_counts_the_cutedsl_ops():
    from torch.utils.flop_counter import FlopCounterMode

    _cuda_ready()
    kernels.register_flop_formulas()
    b, s, hq, hkv, d = 1, 512, 8, 2, 512
    q = _rand(b, s, hq, d).requires_grad_()
    k, v = _rand(b, s, hkv, d), _rand(b, s, hkv, d)
    with FlopCounterMode(display=False) as counter:
        kernels.ffpa_attention(q, k, v, 1.0, True).sum().backward()
    assert kernels.kernel_counts()["cutedsl"] == 1
    assert counter.get_total_flops() == 3 * 4 * b * hq * s * s * d


def test_flex_runs_at_head_dim_512_with_our_options():
    """Default flex options need ~256 KB of shared memory at D=512; ours must compile and match."""
    from lightning_ffpa.attention import flex, masks

    torch.manual_seed(0)
    b, s, hq, hkv, d = 1, 1024, 8, 2, 512
    q = _rand(b, hq, s, d, scale=d**-0.25).requires_grad_()
    k = _rand(b, hkv, s, d, scale=d**-0.25).requires_grad_()
    v = _rand(b, hkv, s, d).requires_grad_()
    block_mask = masks.build_block_mask(masks.generate_causal(), b, s, s, "cuda")
    out = flex.flex_forward(q, k, v, block_mask, 1.0)
    out.backward(torch.ones_like(out))
    with force_kernel("reference"):
        ref = kernels.ffpa_attention(*(t.detach().transpose(1, 2) for t in (q, k, v)), 1.0, True)
    assert _rel(out.transpose(1, 2), ref) < 1e-2
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


def test_dense_backward_repeats_bitwise():
    """`trainer.deterministic: true` promises equal gradients on equal inputs. At the 31B full-layer shape
    (32 query / 4 KV heads, causal, 4k) the backward runs twice; its dQ, dK and dV must match bit for bit
    (a kernel that accumulates across CTAs with atomics would not)."""
    _cuda_ready()
    torch.manual_seed(0)
    b, s, hq, hkv, d = 1, 4096, 32, 4, 512
    q, k, v = _rand(b, s, hq, d, scale=d**-0.25), _rand(b, s, hkv, d, scale=d**-0.25), _rand(b, s, hkv, d)
    do = _rand(b, s, hq, d)
    o, lse = kernels.dense_fwd(q, k, v, 1.0, True)
    assert kernels.kernel_counts()["cutedsl"] == 1  # forward calls: the backward follows its forward's kernel
    runs = [kernels.dense_bwd(do, q, k, v, o, lse, 1.0, True) for _ in range(3)]
    for again in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], again))
