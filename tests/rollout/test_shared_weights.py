"""Shared weights: the engine reads the policy's own frozen tensors and applies LoRA unmerged.

Compared against the merged copy and HF (greedy tokens, logprobs; fp32, CPU), counted by storage (no tensor of W0
is copied), refreshed after an optimizer step, and the policy still trains, saves and loads with its base fused.
"""

import copy
import io

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import Gemma4ForCausalLM

from lightning_ffpa.presets import build_text_config
from lightning_ffpa.rollout.engine import EngineConfig, RolloutEngine
from lightning_ffpa.rollout.lora_linear import LoraLinear
from lightning_ffpa.rollout.shared_weights import SharedWeights, WeightsPlan

CFG = dict(page_size=4, num_pages=64, max_batch_size=4, max_seq_len=64, max_prefill_tokens=64, attention="dense")
ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
CPU = torch.device("cpu")


def _policy(targets=ALL_LINEAR, seed=0, **lora):
    torch.manual_seed(seed)
    base = Gemma4ForCausalLM(build_text_config("tiny")).eval()
    train = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=targets, **lora))
    with torch.no_grad():
        for n, p in train.named_parameters():
            if "lora_B" in n:
                p.normal_(0.0, 0.1)  # B starts at zero: make every adapter change its layer
    return train


def _prompts():
    g = torch.Generator().manual_seed(5)
    return [torch.randint(2, 512, (n,), generator=g).tolist() for n in (6, 11, 3)]


def _engine(train, mode, dtype=torch.float32, fuse=True):
    sync = WeightsPlan(train, mode, dtype, CPU, fuse).build()
    return sync, RolloutEngine(sync.inference, EngineConfig(**CFG, fuse_projections=fuse))


def _hf_greedy(train, prompt, new):
    train.generation_config.eos_token_id = None
    with torch.no_grad():
        out = train.generate(input_ids=torch.tensor([prompt]), max_new_tokens=new, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _storages(tensors) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors}


@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "separate"])
def test_greedy_tokens_and_logprobs_equal_the_merged_copy_and_hf(fuse):
    train = _policy()
    shared, eng = _engine(train, "shared", fuse=fuse)
    merged, ref = _engine(train, "merged", fuse=fuse)
    assert isinstance(shared, SharedWeights) and shared.weights_path.startswith("shared: ")
    assert eng.projection_path == ("fused (8 groups)" if fuse else "separate")
    got, want = eng.generate(_prompts(), 10), ref.generate(_prompts(), 10)
    assert [s.output for s in got] == [s.output for s in want]
    torch.testing.assert_close(torch.tensor([s.logprobs for s in got]), torch.tensor([s.logprobs for s in want]),
                               rtol=0, atol=1e-5)
    if fuse:  # HF once: the separate path already equals the merged copy, which the fused one checks against HF
        for p, s in zip(_prompts(), got):
            assert s.output == _hf_greedy(train, p, 10)


def test_the_engine_holds_no_copy_of_the_base():
    train = _policy()
    sync, eng = _engine(train, "shared")
    policy_storages = _storages(train.parameters())  # after the build: it fused the policy's q/k/v and gate/up rows
    attn = sync.inference.model.layers[0].self_attn
    assert isinstance(attn.q_proj, LoraLinear) and attn.q_proj.group is attn.v_proj.group  # one W0, one A-GEMM
    group = attn.q_proj.group
    assert group.a.shape == (12, 64) and group.b.shape == (256, 12)  # 3 adapters of r=4 stacked
    base_q = train.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight
    assert base_q.data_ptr() == group.weight.data_ptr()  # the policy's Parameter is a row view of the group's W0
    # every W0 the engine reads is a policy storage; all the engine owns beyond them is adapters and buffers
    read = [g.weight for g in sync.groups] + list(sync.inference.parameters())
    assert _storages(read) <= policy_storages
    own = [t for g in sync.groups for t in (g.a, g.b)] + [t for t, _ in sync.copies]
    assert not _storages(own) & policy_storages
    adapters = sum(g.adapter_bytes for g in sync.groups)
    buffers = sum(b.numel() * b.element_size() for b in sync.inference.buffers())
    assert sync.stats["own_bytes"] == adapters
    assert sum(t.numel() * t.element_size() for t in own) == adapters + buffers
    base = sum(p.numel() * p.element_size() for n, p in train.named_parameters() if "lora_" not in n)
    assert sync.stats["aliased_bytes"] == base
    assert "read from the policy's tensors (base fused in 8 groups)" in sync.weights_path
    again = WeightsPlan(train, "shared", torch.float32, CPU).build()  # a second engine: the rows are where they are
    assert [g.weight.data_ptr() for g in again.groups] == [g.weight.data_ptr() for g in sync.groups]
    assert _storages(train.parameters()) == policy_storages
    # an in-place write to the policy's W0 reaches the engine: the same memory
    with torch.no_grad():
        base_q.mul_(2.0)
    torch.testing.assert_close(attn.q_proj.weight, base_q, rtol=0, atol=0)


def test_a_device_named_with_an_index_reads_the_policy_in_place():
    """"cuda" and a policy on "cuda:0" are one GPU: the plan compares concrete devices (it copied every weight when a
    benchmark passed `--device cuda`); here the same with "cpu:0" against tensors on "cpu"."""
    train = _policy()
    sync = WeightsPlan(train, "shared", torch.float32, torch.device("cpu:0")).build()
    base = sum(p.numel() * p.element_size() for n, p in train.named_parameters() if "lora_" not in n)
    assert sync.stats["aliased_bytes"] == base and "0.0 MiB read" not in sync.weights_path


def test_a_refresh_after_an_optimizer_step_changes_rollouts_exactly_as_the_merged_copy():
    train = _policy()
    shared, eng = _engine(train, "shared")
    merged, ref = _engine(train, "merged")
    before = [s.output for s in eng.generate(_prompts(), 8)]
    ptrs = [t.data_ptr() for g in shared.groups for t in (g.a, g.b)]
    opt = torch.optim.SGD([p for p in train.parameters() if p.requires_grad], lr=5.0)
    train.train()
    train(torch.tensor([_prompts()[1]])).logits.square().mean().backward()
    opt.step()
    train.eval()
    stale = [s.output for s in eng.generate(_prompts(), 8)]
    assert stale == before  # the engine runs what it was refreshed with
    shared.refresh()
    merged.refresh()
    assert [t.data_ptr() for g in shared.groups for t in (g.a, g.b)] == ptrs  # in place: graphs stay valid
    got, want = eng.generate(_prompts(), 8), ref.generate(_prompts(), 8)
    assert [s.output for s in got] == [s.output for s in want] != before
    torch.testing.assert_close(torch.tensor([s.logprobs for s in got]), torch.tensor([s.logprobs for s in want]),
                               rtol=0, atol=1e-5)


def test_the_policy_trains_saves_and_loads_with_its_base_fused():
    train = _policy()
    twin = copy.deepcopy(train)  # never fused: the reference
    sync, _ = _engine(train, "shared")
    layer = train.base_model.model.model.layers[0]
    q, k = layer.self_attn.q_proj.base_layer.weight, layer.self_attn.k_proj.base_layer.weight
    assert q.untyped_storage().data_ptr() == k.untyped_storage().data_ptr()  # fused on the policy's side
    ids = torch.tensor([_prompts()[0]])
    train.train()
    twin.train()
    losses, grads = [], []
    for model in (train, twin):
        loss = model(ids).logits.square().mean()
        loss.backward()
        losses.append(loss.item())
        grads.append([p.grad.clone() for p in model.parameters() if p.requires_grad])
        torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2).step()
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)
    # a checkpoint round trip: saved and loaded by value, into the fused views in place
    state = train.state_dict()
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    for name, t in twin.state_dict().items():
        torch.testing.assert_close(loaded[name], t, rtol=0, atol=0, msg=name)
    fresh = _policy(seed=1)
    fresh.load_state_dict(loaded)
    with torch.no_grad():
        q.zero_()
    train.load_state_dict(loaded)
    sync.check_aliases()  # loaded in place: the engine still reads the policy's tensors
    torch.testing.assert_close(q, fresh.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight)
    train.eval()
    fresh.eval()
    torch.testing.assert_close(train(ids).logits, fresh(ids).logits)


def test_a_policy_tensor_moved_after_the_build_is_refused_at_refresh():
    train = _policy()
    sync, _ = _engine(train, "shared")
    sync.refresh()
    norm = train.base_model.model.model.norm.weight
    norm.data = norm.data.clone()  # what `.to()` or `load_state_dict(assign=True)` does
    with pytest.raises(RuntimeError, match=r"policy's model.norm.weight is no longer the tensor .* build the engine"):
        sync.refresh()


def test_verify_no_drift_passes_and_catches_a_planted_write_to_w0():
    train = _policy()
    sync, _ = _engine(train, "shared")
    assert sync.verify_no_drift(num_refreshes=3)["base_sha256"] == sync.base_digest()
    real = sync.refresh
    w0 = train.base_model.model.model.layers[1].mlp.up_proj.base_layer.weight

    def planted(full=False):
        real(full)
        with torch.no_grad():
            w0.view(-1)[0] += 1  # an in-place write to W0 somewhere in the loop
    sync.refresh = planted
    with pytest.raises(RuntimeError, match="drifted"):
        sync.verify_no_drift(num_refreshes=2)


def test_what_cannot_alias_is_owned_counted_and_named():
    """A trained head (modules_to_save) and an engine in another dtype: those tensors are the engine's own, the
    tokens still those of the merged copy, and the path names each reason with its bytes."""
    train = _policy(targets=["q_proj", "v_proj"], modules_to_save=["lm_head"])
    shared, eng = _engine(train, "shared")
    merged, ref = _engine(train, "merged")
    inf = shared.inference
    assert inf.lm_head.weight is not inf.model.embed_tokens.weight  # untied, as training untied them
    assert inf.model.embed_tokens.weight is train.base_model.model.model.embed_tokens.weight
    head = inf.lm_head.weight
    assert "copied (trained by the policy)" in shared.weights_path and head.untyped_storage().data_ptr() not in \
        _storages(train.parameters())
    assert [s.output for s in eng.generate(_prompts(), 8)] == [s.output for s in ref.generate(_prompts(), 8)]

    half = WeightsPlan(_policy(), "shared", torch.bfloat16, CPU)
    assert half.aliased_bytes == 0 and "torch.float32 where the engine runs torch.bfloat16" in half.describe()
    sync = half.build()
    assert {p.dtype for p in sync.inference.parameters()} == {torch.bfloat16}


def test_a_plan_without_a_device_cannot_be_built():
    with pytest.raises(ValueError, match="without a device"):
        WeightsPlan(_policy(), "shared", torch.float32, None).build()


def test_merged_copy_takes_the_policys_buffers():
    """Persistent buffers (Gemma4's `layer_scalar`, loaded from a checkpoint) come from the policy in both modes:
    a fresh model's would be ones."""
    train = _policy()
    with torch.no_grad():
        train.base_model.model.model.layers[2].layer_scalar.fill_(0.5)
    ids = torch.tensor([_prompts()[0]])
    with torch.no_grad():
        want = train(ids).logits
        for mode in ("shared", "merged"):
            sync = WeightsPlan(train, mode, torch.float32, CPU).build()
            torch.testing.assert_close(sync.inference(ids).logits, want, rtol=1e-4, atol=1e-4, msg=mode)


def test_shared_decode_step_traces_as_one_graph(monkeypatch):
    """What `compile_decode` compiles on CUDA, over unmerged LoRA groups: dynamo (eager backend, CPU) takes the
    step whole, with no graph break in the groups' serving state, and the tokens do not change."""
    import torch._dynamo.testing

    train = _policy()
    sync = WeightsPlan(train, "shared", torch.float32, CPU).build()
    cfg = EngineConfig(page_size=16, num_pages=16, max_batch_size=4, max_seq_len=64, attention="dense")
    prompts = _prompts()[:2]
    plain = [s.output for s in RolloutEngine(sync.inference, cfg).generate(prompts, 5)]
    eng = RolloutEngine(sync.inference, cfg)
    torch._dynamo.reset()
    counts = torch._dynamo.testing.CompileCounter()
    monkeypatch.setattr(eng, "_step", torch.compile(eng._decode_step, backend=counts, dynamic=False))
    assert [s.output for s in eng.generate(prompts, 5)] == plain
    assert counts.frame_count == 1
