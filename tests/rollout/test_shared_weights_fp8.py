"""Shared weights over a float8 frozen base (`model.lora.base_dtype: fp8`): the engine reads the policy's float8
W0 and its scales in place (no copy, rows fused as a bf16 base's are), and its rollouts are those of the merged copy
(which dequantises W0) and of the policy itself (greedy tokens, logprobs; fp32, CPU: the dequantise path)."""

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import Gemma4ForCausalLM

from lightning_ffpa import fp8_base
from lightning_ffpa.fp8_base import FP8_DTYPE, quantize_lora_bases
from lightning_ffpa.presets import build_text_config
from lightning_ffpa.rollout.engine import EngineConfig, RolloutEngine
from lightning_ffpa.rollout.lora_linear import LoraLinear
from lightning_ffpa.rollout.shared_weights import SharedWeights, WeightsPlan

CFG = dict(page_size=4, num_pages=64, max_batch_size=4, max_seq_len=64, max_prefill_tokens=64, attention="dense")
ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
CPU = torch.device("cpu")


def _policy(targets=ALL_LINEAR):
    torch.manual_seed(0)
    base = Gemma4ForCausalLM(build_text_config("tiny")).eval()
    train = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    with torch.no_grad():
        for n, p in train.named_parameters():
            if "lora_B" in n:
                p.normal_(0.0, 0.1)
    quantize_lora_bases(train)
    return train


def _prompts():
    g = torch.Generator().manual_seed(5)
    return [torch.randint(2, 512, (n,), generator=g).tolist() for n in (6, 11, 3)]


def _engine(train, mode, fuse=True):
    sync = WeightsPlan(train, mode, torch.float32, CPU, fuse).build()
    return sync, RolloutEngine(sync.inference, EngineConfig(**CFG, fuse_projections=fuse))


@pytest.mark.parametrize("targets", [ALL_LINEAR, ["q_proj", "v_proj", "down_proj"]], ids=["all", "some"])
def test_rollouts_over_the_float8_base_equal_the_merged_copy_and_the_policy(targets):
    train = _policy(targets)
    before = fp8_base.path_counts().get("dequantize", 0)
    shared, eng = _engine(train, "shared")
    merged, ref = _engine(train, "merged")
    assert isinstance(shared, SharedWeights) and shared.weights_path.startswith("shared: ")
    got, want = eng.generate(_prompts(), 10), ref.generate(_prompts(), 10)
    assert fp8_base.path_counts()["dequantize"] > before  # the engine's base matmuls ran the float8 path, counted
    assert [s.output for s in got] == [s.output for s in want]
    torch.testing.assert_close(torch.tensor([s.logprobs for s in got]), torch.tensor([s.logprobs for s in want]),
                               rtol=0, atol=1e-5)
    ids = torch.tensor([_prompts()[1]])
    with torch.no_grad():  # one forward of the engine's model against the policy (its float8 base, its adapters)
        torch.testing.assert_close(shared.inference(ids).logits, train(ids).logits, rtol=1e-5, atol=1e-5)


def test_the_engine_reads_the_policys_float8_bytes_and_scales_in_place():
    train = _policy()
    fp8 = [p for p in train.parameters() if p.dtype == FP8_DTYPE]
    sync, _ = _engine(train, "shared")
    attn = sync.inference.model.layers[0].self_attn
    assert isinstance(attn.q_proj, LoraLinear) and attn.q_proj.group is attn.k_proj.group  # fused as a bf16 base
    group = attn.q_proj.group
    assert group.weight.dtype == FP8_DTYPE and group.scale.dtype == torch.float32
    assert group.a.dtype == group.b.dtype == torch.float32  # the adapters in the engine's dtype
    q = train.base_model.model.model.layers[0].self_attn.q_proj.base_layer
    assert q.weight.data_ptr() == group.weight.data_ptr() and q.weight_scale.data_ptr() == group.scale.data_ptr()
    policy = {p.untyped_storage().data_ptr() for p in train.parameters()}
    assert {g.weight.untyped_storage().data_ptr() for g in sync.groups} <= policy
    assert {g.scale.untyped_storage().data_ptr() for g in sync.groups} <= policy
    read = sum(p.numel() for p in fp8)
    assert sync.stats["aliased_bytes"] >= read and "float8" not in sync.weights_path  # nothing copied for dtype
    assert sync.verify_no_drift(num_refreshes=2)["base_sha256"] == sync.base_digest()


def test_aliased_bytes_count_the_float8_base_at_one_byte_and_its_scales():
    """The bytes the engine reads from the policy: every frozen tensor at its stored size (the float8 W0 at one byte
    an element) and the rowwise scales read with it (left out before: the plan summed the bases alone)."""
    train = _policy()
    frozen = [p for p in train.parameters() if not p.requires_grad]  # deduplicated: a tied weight once
    assert any(p.dtype == FP8_DTYPE for p in frozen)
    sync, _ = _engine(train, "shared")
    assert sync.stats["aliased_bytes"] == sum(p.numel() * p.element_size() for p in frozen)
