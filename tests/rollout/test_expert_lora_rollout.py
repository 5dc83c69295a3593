"""LoRA on the MoE expert stacks (`model.lora.target_parameters`) in rollouts. Shared mode reads the policy's
stacks in place and adds each expert's adapter unmerged in the grouped GEMMs, from buffers of its own written at each
refresh; merged mode writes W0 + s*B_e@A_e into stacks it owns. Either way its greedy tokens equal HF's generate on
the peft policy, before and after an optimizer step, and the base never changes."""

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import Gemma4ForCausalLM

from lightning_ffpa.presets import build_text_config
from lightning_ffpa.rollout.engine import EngineConfig, RolloutEngine
from lightning_ffpa.rollout.shared_weights import WeightsPlan

CFG = dict(page_size=4, num_pages=64, max_batch_size=4, max_seq_len=64, max_prefill_tokens=64, attention="dense")
EXPERTS = ["experts.gate_up_proj", "experts.down_proj"]


def _policy():
    torch.manual_seed(0)
    base = Gemma4ForCausalLM(build_text_config("tiny-moe")).eval()
    train = get_peft_model(base, LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"], target_parameters=EXPERTS))
    with torch.no_grad():
        for n, p in train.named_parameters():
            if "lora_B" in n:
                p.normal_(0.0, 0.5)  # B starts at zero: make every adapter change its experts
    return train


def _prompts():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(2, 500, (n,), generator=g).tolist() for n in (5, 9, 3)]


def _hf_greedy(train, new):
    train.generation_config.eos_token_id = None
    out = []
    with torch.no_grad():
        for p in _prompts():
            ids = train.generate(input_ids=torch.tensor([p]), max_new_tokens=new, do_sample=False, pad_token_id=0)
            out.append(ids[0, len(p):].tolist())
    return out


@pytest.mark.parametrize("mode", ["shared", "merged"])
def test_expert_lora_rollouts_follow_the_policy_through_a_refresh(mode):
    train = _policy()
    plan = WeightsPlan(train, mode, torch.float32, torch.device("cpu"))
    stacks = [k for k in plan.sources if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    assert len(stacks) == 2 * 4 and all(isinstance(plan.sources[k], tuple) for k in stacks)  # 4 layers, 2 each
    sync = plan.build()
    eng = RolloutEngine(sync.inference, EngineConfig(**CFG))
    digest = sync.base_digest()
    before = [s.output for s in eng.generate(_prompts(), 6)]
    assert before == _hf_greedy(train, 6)
    if mode == "shared":  # the stacks are the policy's tensors; the engine owns A and B (and the q_proj adapters)
        assert "expert LoRA A and B buffers" in sync.weights_path and "merged" not in sync.weights_path
        engine_stacks = {n: p for n, p in sync.inference.named_parameters() if n.endswith(tuple(EXPERTS))}
        policy = {p.data_ptr() for n, p in train.named_parameters() if n.endswith(("gate_up_proj", "down_proj"))}
        assert len(engine_stacks) == 8 and {p.data_ptr() for p in engine_stacks.values()} == policy
        assert plan.own_bytes < sum(p.numel() * 4 for p in engine_stacks.values()) / 2  # tiny: rank 2 padded to 8
    opt = torch.optim.SGD([p for n, p in train.named_parameters() if "experts" in n and p.requires_grad], lr=20.0)
    train.train()
    train(torch.tensor([_prompts()[1]])).logits.square().mean().backward()
    opt.step()
    train.eval()
    want = _hf_greedy(train, 6)
    assert want != before  # the step moved the experts' adapters enough to change greedy tokens
    sync.refresh()
    assert [s.output for s in eng.generate(_prompts(), 6)] == want
    assert sync.base_digest() == digest  # the experts' W0 only ever read
