"""Fused projections: one GEMM per group inside the engine, a plain `nn.Linear` outside, weights shared.

Counted with a dispatch mode (how many matmuls a forward issues) and compared against the unfused model:
the same tokens greedily, the same outputs per member, in-place weight writes (the LoRA refresh) seen by
the fused GEMM, and gradients still reaching the Parameters outside the engine.
"""

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import Gemma4ForCausalLM

from lightning_ffpa.presets import build_text_config
from lightning_ffpa.rollout.engine import EngineConfig, RolloutEngine
from lightning_ffpa.rollout.fused_linear import SlicedLinear, fuse_projections, serving
from lightning_ffpa.rollout.lora_sync import LoraSync

CFG = dict(page_size=4, num_pages=64, max_batch_size=4, max_seq_len=64, max_prefill_tokens=64, attention="dense")


class _CountMatmuls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # inference mode dispatches `linear` whole; with autograd on it arrives decomposed into mm/addmm
        if func.overloadpacket in (torch.ops.aten.linear, torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm):
            self.n += 1
        return func(*args, **(kwargs or {}))


def _model(**overrides):
    torch.manual_seed(0)
    cfg = build_text_config("tiny", num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"],
                            **overrides)
    return Gemma4ForCausalLM(cfg).eval()


def _prompts():
    g = torch.Generator().manual_seed(5)
    return [torch.randint(2, 512, (n,), generator=g).tolist() for n in (6, 11, 3)]


def _linears(model):
    return {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


def test_each_layer_fuses_qkv_and_gate_up_keeping_parameters_and_names():
    model = _model()
    names = [n for n, _ in model.named_parameters()]
    params = {n: p for n, p in model.named_parameters()}
    before = {n: p.detach().clone() for n, p in params.items()}
    groups, skipped = fuse_projections(model.model.layers)

    # sliding (q, k, v) + (gate, up); full (q, k) + (gate, up): Gemma4's full layers use the keys as values
    assert skipped == [] and [g.num_members for g in groups] == [3, 2, 2, 2]
    assert [n for n, _ in model.named_parameters()] == names  # same names: the LoRA sync maps onto them
    for n, p in model.named_parameters():
        assert p is params[n] and torch.equal(p, before[n])  # same objects, same values
    attn = model.model.layers[0].self_attn
    assert isinstance(attn.q_proj, SlicedLinear) and isinstance(attn.q_proj, torch.nn.Linear)
    buf = groups[0].weight
    assert attn.q_proj.weight.data_ptr() == buf.data_ptr()
    assert attn.v_proj.weight.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()

    again, _ = fuse_projections(model.model.layers)  # a second engine on the same model reuses the groups
    assert [id(g) for g in again] == [id(g) for g in groups]


def test_one_matmul_per_group_inside_serving_and_plain_linears_outside():
    model = _model()
    ref = copy.deepcopy(model)
    groups, _ = fuse_projections(model.model.layers)
    x = torch.randn(2, 3, model.config.hidden_size)
    attn, ref_attn = model.model.layers[0].self_attn, ref.model.layers[0].self_attn

    with _CountMatmuls() as outside:
        plain = [attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)]
    with serving(groups), _CountMatmuls() as inside:
        fused = [attn.v_proj(x), attn.q_proj(x), attn.k_proj(x)]  # any order: the first caller computes
    assert (outside.n, inside.n) == (3, 1)
    want = [ref_attn.q_proj(x), ref_attn.k_proj(x), ref_attn.v_proj(x)]
    for got, w in zip(plain, want):
        torch.testing.assert_close(got, w, rtol=0, atol=0)
    for got, w in zip([fused[1], fused[2], fused[0]], want):
        torch.testing.assert_close(got, w, rtol=1e-6, atol=1e-6)
    assert groups[0]._output is None  # every member took its columns: nothing is held


def test_a_member_called_on_a_new_input_recomputes_and_leaving_serving_drops_the_held_output(caplog):
    model = _model()
    groups, _ = fuse_projections(model.model.layers)
    mlp = model.model.layers[1].mlp
    x, y = torch.randn(1, 2, model.config.hidden_size), torch.randn(1, 2, model.config.hidden_size)
    with serving(groups):
        gate_x = mlp.gate_proj(x)
        up_y = mlp.up_proj(y)  # another input: its own GEMM, not x's columns
        assert groups[3]._output is not None  # gate of y not taken yet
    torch.testing.assert_close(gate_x, torch.nn.functional.linear(x, mlp.gate_proj.weight))
    torch.testing.assert_close(up_y, torch.nn.functional.linear(y, mlp.up_proj.weight))
    assert groups[3]._output is None and not groups[3].active
    # counted and said once: a model whose members read different inputs runs the GEMM more than once
    assert groups[3].num_split_inputs == 1
    assert [r.getMessage().split(":")[0] for r in caplog.records] == ["fused projections of layers.1.mlp"]


def test_weights_moved_after_fusing_are_refused_then_fused_again_by_a_new_engine():
    model = _model()
    engine = RolloutEngine(model, EngineConfig(**CFG))
    model.double()  # every Parameter gets a new tensor: the fused buffers would be stale
    with pytest.raises(RuntimeError, match=r"^fused projections of layers.0.self_attn: .* build the engine again"):
        engine.generate(_prompts(), 2)
    again = RolloutEngine(model, EngineConfig(**CFG))
    assert again.projection_path == "fused (4 groups)" and all(g.intact() for g in again.walker.groups)
    assert again.walker.groups[0] is not engine.walker.groups[0]


def test_a_deep_copy_of_a_fused_model_is_fused_again_and_serves_its_own_weights():
    model = _model()
    RolloutEngine(model, EngineConfig(**CFG))
    twin = copy.deepcopy(model)  # Parameters deep-copy by clone: no longer views of the copied buffers
    with torch.no_grad():
        twin.model.layers[0].mlp.up_proj.weight.mul_(3.0)  # (q/k/v are normed after projection)
    got = RolloutEngine(twin, EngineConfig(**CFG)).generate(_prompts(), 6)
    ref = _model()
    with torch.no_grad():
        ref.model.layers[0].mlp.up_proj.weight.mul_(3.0)
    want = RolloutEngine(ref, EngineConfig(**CFG, fuse_projections=False)).generate(_prompts(), 6)
    assert [s.output for s in got] == [s.output for s in want]


def test_in_place_weight_writes_reach_the_fused_gemm_and_gradients_reach_the_parameters():
    model = _model()
    groups, _ = fuse_projections(model.model.layers)
    attn = model.model.layers[0].self_attn
    x = torch.randn(1, 2, model.config.hidden_size)
    with torch.no_grad():
        attn.k_proj.weight.mul_(2.0)  # what the LoRA refresh and an optimizer step do
    with serving(groups):
        _, k = attn.q_proj(x), attn.k_proj(x)  # q computes the group GEMM; k takes its columns
    torch.testing.assert_close(k, torch.nn.functional.linear(x, attn.k_proj.weight))

    model.train()
    model.zero_grad()
    model(torch.tensor([[3, 4, 5]])).logits.sum().backward()  # outside serving: training as before
    assert all(p.grad is not None and p.grad.abs().sum() > 0
               for n, p in model.named_parameters() if n.endswith(("q_proj.weight", "up_proj.weight")))


def test_engine_fused_and_unfused_give_the_same_tokens_and_report_the_path():
    model = _model()
    ref = copy.deepcopy(model)
    unfused = RolloutEngine(ref, EngineConfig(**CFG, fuse_projections=False))
    fused = RolloutEngine(model, EngineConfig(**CFG))
    assert unfused.projection_path == "separate" and fused.projection_path == "fused (4 groups)"
    want = unfused.generate(_prompts(), 8)
    got = fused.generate(_prompts(), 8)
    assert [s.output for s in got] == [s.output for s in want]
    torch.testing.assert_close(torch.tensor([s.logprobs for s in got]), torch.tensor([s.logprobs for s in want]),
                               rtol=0, atol=1e-5)
    with _CountMatmuls() as n_fused, torch.inference_mode():
        fused.generate(_prompts()[:1], 2)
    with _CountMatmuls() as n_unfused, torch.inference_mode():
        unfused.generate(_prompts()[:1], 2)
    # 2 forwards (prefill, one decode step) x 4 groups, each saving (members - 1) matmuls: 2 x (2+1+1+1) = 10
    assert n_unfused.n - n_fused.n == 10
    assert all(g._output is None for g in fused.walker.groups)


def test_lora_refresh_into_a_fused_inference_copy_matches_the_merged_model():
    train = get_peft_model(_model(), LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj", "up_proj"]))
    inference = _model()
    engine = RolloutEngine(inference, EngineConfig(**CFG))
    sync = LoraSync(train, inference)
    with torch.no_grad():
        for n, p in train.named_parameters():
            if "lora_B" in n:
                p.normal_(0.0, 0.05)  # B starts at zero: make the adapters change the weights
    sync.refresh(full=True)
    sync.verify_no_drift()
    merged = train.merge_and_unload()
    want = RolloutEngine(merged, EngineConfig(**CFG, fuse_projections=False)).generate(_prompts(), 6)
    got = engine.generate(_prompts(), 6)
    assert [s.output for s in got] == [s.output for s in want]


def test_adapter_layers_stay_separate_and_the_path_says_why():
    model = get_peft_model(_model(), LoraConfig(r=2, target_modules=["q_proj"]))
    groups, skipped = fuse_projections(model.base_model.model.model.layers)
    assert [g.num_members for g in groups] == [2, 2]  # the MLPs; attention has a LoRA q_proj
    assert len(skipped) == 2 and all("not plain nn.Linear" in s for s in skipped)
    eng = RolloutEngine(model.base_model.model, EngineConfig(**CFG))
    assert eng.projection_path.startswith("fused (2 groups); 2 separate, first: layers.0.self_attn: not plain")


@pytest.mark.parametrize("bias", [True, False])
def test_bias_is_fused_with_the_weight(bias):
    torch.manual_seed(0)
    layers = torch.nn.ModuleList([torch.nn.Module()])
    layers[0].mlp = torch.nn.Module()
    layers[0].mlp.gate_proj, layers[0].mlp.up_proj = torch.nn.Linear(8, 5, bias=bias), torch.nn.Linear(8, 7, bias=bias)
    ref = copy.deepcopy(layers)
    groups, _ = fuse_projections(layers)
    x = torch.randn(4, 8)
    with serving(groups):
        got = (layers[0].mlp.gate_proj(x), layers[0].mlp.up_proj(x))
    torch.testing.assert_close(got, (ref[0].mlp.gate_proj(x), ref[0].mlp.up_proj(x)))
