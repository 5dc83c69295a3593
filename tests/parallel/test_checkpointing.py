"""SAC counts: attention forwards run once per layer under selective AC, twice under full AC."""

from collections import Counter, defaultdict

import pytest
import torch
import transformers
from transformers import AttentionInterface

from lightning_ffpa import saved_ops
from lightning_ffpa.parallel import checkpointing, parallelize, resolve_op
from lightning_ffpa.presets import build_text_config

from ._steps import count_ops

# A counted custom attention op standing in for an FFPA kernel: users add it through
# `sac_extra_save_ops`, the same path the YAML list takes.
_CALLS = Counter()


@torch.library.custom_op("lightning_ffpa_test::attn", mutates_args=())
def _test_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    _CALLS["fwd"] += 1
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                                            enable_gqa=True).contiguous()


@_test_attn.register_fake
def _(q, k, v, scale):
    return torch.empty_like(q)


def _setup_ctx(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:3])
    ctx.scale = inputs[3]


def _backward(ctx, grad):
    q, k, v = ctx.saved_tensors
    with torch.enable_grad():
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=ctx.scale,
                                                               enable_gqa=True)
        gq, gk, gv = torch.autograd.grad(out, (q, k, v), grad)
    return gq, gk, gv, None


_test_attn.register_autograd(_backward, setup_context=_setup_ctx)


def _counting_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    out = _test_attn(query, key, value, float(scaling))  # (B, H, S, D)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register("counting_test", _counting_attention)


def _tiny(attn: str):
    torch.manual_seed(0)
    cfg = build_text_config("tiny")
    cfg._attn_implementation = attn
    return transformers.Gemma4ForCausalLM(cfg)


@pytest.mark.parametrize("mode,per_layer", [("none", 1), ("selective", 1), ("full", 2)])
def test_custom_attention_op_runs_once_under_sac(mode, per_layer):
    model = _tiny("counting_test")
    extra = ["lightning_ffpa_test.attn.default"] if mode == "selective" else []
    parallelize(model, None, activation_checkpointing=mode, sac_extra_save_ops=extra)
    _CALLS.clear()
    count_ops(model)
    assert _CALLS["fwd"] == per_layer * 4  # all 4 tiny layers use the custom op


@pytest.mark.parametrize("mode,per_layer", [("selective", 1), ("full", 2)])
def test_sdpa_forward_is_must_save(mode, per_layer):
    sdpa_ops = {op for op in checkpointing.default_save_ops() if "scaled_dot_product" in str(op)}
    model = _tiny("sdpa")
    parallelize(model, None, activation_checkpointing=mode)
    counts = count_ops(model, sdpa_ops)
    assert sum(counts.values()) == per_layer * 4


def _kernel_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """Full layers (head_dim 512) through the FFPA op contract (CPU reference op); sliding ones through SDPA."""
    from lightning_ffpa.attention import kernels

    if module.head_dim != 512:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # (B, S, H, D)
    return kernels.ffpa_attention(q, k, v, scaling, True), None


AttentionInterface.register("kernel_test", _kernel_attention)


@pytest.mark.parametrize("mode,per_layer", [("selective", 1), ("full", 2)])
def test_registered_forward_ops_are_saved(mode, per_layer):
    from lightning_ffpa.attention import kernels

    ref_fwd = torch.ops.lightning_ffpa.ref_dense_fwd.default
    # The attention package hands its forwards over when installed (register_ffpa, the Callback); this test's
    # attention function calls the kernels directly, so it hands them over itself.
    saved_ops.register(kernels.forward_ops())
    assert ref_fwd in set(kernels.forward_ops()) and ref_fwd in checkpointing.default_save_ops()
    model = _tiny("kernel_test")
    parallelize(model, None, activation_checkpointing=mode)
    with kernels.force_kernel("reference"):
        counts = count_ops(model, {ref_fwd})
    n_full = build_text_config("tiny").layer_types.count("full_attention")
    assert counts[ref_fwd] == per_layer * n_full


def test_ffpa_reference_op_runs_once_per_full_layer():
    from lightning_ffpa import attention
    from lightning_ffpa.attention.kernels import forward_ops

    attention.register_ffpa()
    ref_ops = {op for op in forward_ops() if "lightning_ffpa" in str(op)}
    n_full = build_text_config("tiny").layer_types.count("full_attention")
    for mode, per_layer in (("selective", 1), ("full", 2)):
        model = _tiny("ffpa")
        parallelize(model, None, activation_checkpointing=mode)
        with attention.force_kernel("reference"):  # the backend's own dispatch, on the CPU reference op
            counts = count_ops(model, ref_ops)
        assert sum(counts.values()) == per_layer * n_full, (mode, counts)


def test_policy_answers_the_same_in_forward_and_recompute(monkeypatch):
    calls = []
    real = checkpointing.sac_policy

    def recording(meta, save_ops, mm_ops, save_mm, ctx, op, *args, **kwargs):
        decision = real(meta, save_ops, mm_ops, save_mm, ctx, op, *args, **kwargs)
        calls.append((ctx.is_recompute, str(op), decision))
        return decision

    monkeypatch.setattr(checkpointing, "sac_policy", recording)
    model = _tiny("sdpa")
    parallelize(model, None, activation_checkpointing="selective")
    count_ops(model)
    fwd = [(op, d) for rec, op, d in calls if not rec]
    rec = [(op, d) for rec, op, d in calls if rec]
    if rec:  # torch 2.11 asks again while recomputing; torch 2.13 replays without asking
        assert fwd == rec
    # Replay the recorded op sequence as a recompute pass (interleaved with a fresh forward, as
    # happens across layers) against one layer's state: the answers must match the forward's.
    ops = {str(op): op for op in checkpointing.default_save_ops() | checkpointing._mm_ops()}
    ops_in_layer = [op for op, _ in fwd[: len(fwd) // 4]]  # first layer invocation of 4
    meta = defaultdict(int)

    class Ctx:
        def __init__(self, is_recompute):
            self.is_recompute = is_recompute

    def answers(is_recompute):
        return [real(meta, frozenset(checkpointing.default_save_ops()), frozenset(checkpointing._mm_ops()),
                     "every_other", Ctx(is_recompute), ops.get(name, name)) for name in ops_in_layer]

    assert answers(False) == answers(True)
    saved_mm = [d for op, d in fwd if op == "aten.mm.default"]
    assert 0 < saved_mm.count(checkpointing.CheckpointPolicy.MUST_SAVE) < len(saved_mm)  # every other


def test_unknown_op_name_is_a_clear_error():
    with pytest.raises(ValueError, match="sac_extra_save_ops.*not_an_op"):
        checkpointing.sac_context_fn(["aten.not_an_op.default"])
    with pytest.raises(ValueError, match="namespace"):
        resolve_op("mm")
    assert resolve_op("aten.mm") is torch.ops.aten.mm.default
    with pytest.raises(ValueError, match="activation_checkpointing='some'"):
        parallelize(_tiny("sdpa"), None, activation_checkpointing="some")


def _record_policy(monkeypatch):
    """Record (is_recompute, op, K or None, saved) for every policy call."""
    calls = []
    real = checkpointing.sac_policy

    def recording(meta, save_ops, mm_ops, save_mm, ctx, op, *args, **kwargs):
        decision = real(meta, save_ops, mm_ops, save_mm, ctx, op, *args, **kwargs)
        k = checkpointing.mm_reduction_dim(op, args) if op in mm_ops else None
        calls.append((ctx.is_recompute, str(op), k, decision == checkpointing.CheckpointPolicy.MUST_SAVE))
        return decision

    monkeypatch.setattr(checkpointing, "sac_policy", recording)
    return calls


def test_high_k_saves_exactly_the_matmuls_wider_than_the_layer(monkeypatch):
    cfg = build_text_config("tiny")
    calls = _record_policy(monkeypatch)
    model = _tiny("sdpa")
    parallelize(model, None, activation_checkpointing="selective", sac_save_mm="high_k")
    count_ops(model)
    mm = [(k, saved) for rec, op, k, saved in calls if not rec and k is not None]
    assert mm and all(saved == (k > cfg.hidden_size) for k, saved in mm), mm
    # Per layer: o_proj (K = heads * head_dim) and down_proj (K = intermediate) are saved, q/k/v/gate/up not.
    assert sum(saved for _, saved in mm) == 2 * cfg.num_hidden_layers
    assert {k for k, saved in mm if not saved} == {cfg.hidden_size}
    fwd = [c[1:] for c in calls if not c[0]]
    rec = [c[1:] for c in calls if c[0]]
    if rec:  # torch 2.11 asks again while recomputing: the answers must repeat layer by layer
        assert rec == fwd


@pytest.mark.parametrize("rule", checkpointing.SAVE_MM_RULES)
def test_every_rule_gives_the_eager_gradients(rule):
    ref = _tiny("sdpa")
    model = _tiny("sdpa")
    parallelize(model, None, activation_checkpointing="selective", sac_save_mm=rule)
    count_ops(ref)
    count_ops(model)
    for (name, p), q in zip(ref.named_parameters(), model.parameters()):
        torch.testing.assert_close(q.grad, p.grad, msg=name)


def test_layer_width_and_bad_rule():
    model = _tiny("sdpa")
    assert checkpointing.layer_width(model.model.layers[0]) == build_text_config("tiny").hidden_size
    with pytest.raises(ValueError, match="sac_save_mm='most'"):
        checkpointing.sac_context_fn(save_mm="most")
    with pytest.raises(RuntimeError, match="without a layer width"):
        checkpointing.sac_context_fn(save_mm="high_k")()
    assert checkpointing.sac_context_fn(save_mm="high_k", width=64).width == 64


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_a_user_forward_with_hf_default_use_cache_trains_under_ac(mode):
    """Most training steps call `model(input_ids=..., labels=...)`, leaving HF's `use_cache=True`: the recompute
    would append to the KV cache again and fail torch's metadata check, unless parallelize turns it off."""
    model = _tiny("sdpa")
    assert model.config.use_cache
    parallelize(model, None, activation_checkpointing=mode)
    assert not model.config.use_cache
    ids = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(1))
    model(input_ids=ids, labels=ids).loss.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_high_k_reads_the_residual_width_and_saves_the_scaled_mm_of_a_float8_lora_base():
    """A float8 LoRA base is no nn.Linear: the width must still be the hidden size (not the adapters' r, which
    outnumber the rest without the bases), and its `torch._scaled_mm` is a matmul the rule saves when K > width
    (o_proj, down_proj), as it saves their bf16 mm."""
    from types import SimpleNamespace

    from lightning_ffpa.fp8_base import quantize_lora_bases
    from lightning_ffpa.lora import apply_lora, unwrap_peft

    model = unwrap_peft(apply_lora(_tiny("sdpa"), {"r": 4, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj",
                                                               "gate_proj", "up_proj", "down_proj"]}))
    quantize_lora_bases(model)
    hidden = build_text_config("tiny").hidden_size
    assert checkpointing.layer_width(model.model.layers[0]) == hidden
    wide = torch.empty(8, 4 * hidden, device="meta")
    answer = checkpointing.sac_policy({"forward_mm": 0}, frozenset(), frozenset(checkpointing._mm_ops()), "high_k",
                                      SimpleNamespace(is_recompute=False), torch.ops.aten._scaled_mm.default,
                                      wide, torch.empty(4 * hidden, 8, device="meta"), width=hidden)
    assert answer == checkpointing.CheckpointPolicy.MUST_SAVE
