"""`model.lora.target_parameters` (LoRA on the 3-D MoE expert stacks, peft's parameter LoRA) on the tiny-moe
preset: only the adapters train and their gradients reach the expert adapters; names that match nothing, and
options peft's parameter LoRA lacks, are one-line ConfigErrors naming the option; the rollout refresh refuses
expert adapters instead of leaving them out. The export round trip is tests/hardening/test_export_experts.py."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import Gemma4ForCausalLM

from lightning_ffpa.callbacks.rollout import RolloutCallback
from lightning_ffpa.errors import ConfigError
from lightning_ffpa.lora import lora_hparam, merged_weight
from lightning_ffpa.module import Gemma4LM
from lightning_ffpa.presets import build_text_config
from lightning_ffpa.rl.module import GRPOModule
from lightning_ffpa.rl.prompts import PromptDataModule
from lightning_ffpa.rl.rewards import token_range_reward
from lightning_ffpa.rollout.lora_sync import LoraSync
from lightning_ffpa.rollout.sampler import SamplingParams
from lightning_ffpa.validation import check_lora_targets

EXPERTS = ["experts.gate_up_proj", "experts.down_proj"]


def test_expert_adapters_alone_train_and_get_gradients():
    torch.manual_seed(0)
    lm = Gemma4LM(preset="tiny-moe", dtype="float32", lora={"r": 2, "lora_alpha": 4, "target_parameters": EXPERTS})
    lm.configure_model()
    trainable = {n: p for n, p in lm.model.named_parameters() if p.requires_grad}
    assert len(trainable) == 2 * 2 * 4 and all(".experts." in n and ".lora_" in n for n in trainable)  # A, B x 2 x 4
    for n, p in trainable.items():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.02)  # B = 0 at init would leave A without a gradient
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(1))
    lm.model(input_ids=ids, labels=ids).loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in trainable.values())


@torch.no_grad()
def test_merged_expert_stack_equals_peft_delta():
    torch.manual_seed(0)
    model = get_peft_model(Gemma4ForCausalLM(build_text_config("tiny-moe")),
                           LoraConfig(r=3, lora_alpha=5, target_modules=[], target_parameters=EXPERTS))
    outer = model.base_model.model.model.layers[0].experts
    for wrapper in (outer, outer.base_layer):  # nested: one peft ParamWrapper per stack
        wrapper.lora_B["default"].weight.normal_()
        base = wrapper.get_param().detach().clone()
        got = merged_weight(base, wrapper.lora_A["default"].weight, wrapper.lora_B["default"].weight,
                            wrapper.scaling["default"])
        torch.testing.assert_close(got - base, wrapper.get_delta_weight("default"), rtol=0, atol=1e-6)


@pytest.mark.parametrize("lora, option, why", [
    ({"r": 4, "target_parameters": "experts.down_proj"}, "model.lora.target_parameters", "non-empty list"),
    ({"r": 4, "target_parameters": EXPERTS, "lora_dropout": 0.1}, "model.lora.lora_dropout", "must be 0"),
    ({"r": 4, "target_parameters": EXPERTS, "use_dora": True}, "model.lora.use_dora", "no DoRA"),
])
def test_options_peft_parameter_lora_lacks_are_config_errors(lora, option, why):
    with pytest.raises(ConfigError, match=f"^`{option.replace('.', '[.]')}=.*{why}"):
        lora_hparam(lora)


@pytest.mark.parametrize("preset, lora, option, match", [
    ("tiny-moe", {"target_parameters": ["experts.up_proj"]}, "target_parameters", "experts.gate_up_proj"),
    ("tiny", {"target_parameters": ["experts.down_proj"]}, "target_parameters", "not a MoE model"),
    # one of two names matching nothing: peft itself trains without it, and only warns
    ("tiny-moe", {"target_modules": ["q_proj", "nope_proj"], "target_parameters": EXPERTS}, "target_modules",
     "nope_proj"),
    ("tiny", {"target_modules": ["q_proj", "nope_proj"]}, "target_modules", "nope_proj"),
])
def test_targets_matching_nothing_are_one_line_config_errors(preset, lora, option, match):
    lm = Gemma4LM(preset=preset, lora={"r": 2, **lora})
    for check in (check_lora_targets, lambda m: m.configure_model()):  # the pre-flight, and the build itself
        with pytest.raises(ConfigError, match=rf"^`model\.lora\.{option}=") as err:
            check(lm)
        assert "\n" not in str(err.value) and match in str(err.value)


def test_rollout_accepts_expert_lora_and_the_refresh_covers_the_stacks():
    """The rollout engine serves expert adapters (it refused them before): the pre-flight passes, and the merged
    copy's refresh writes each adapted 3-D stack (tests/rollout/test_expert_lora_rollout.py checks the tokens)."""
    lora = {"r": 2, "lora_alpha": 4, "target_modules": ["q_proj"], "target_parameters": EXPERTS}
    rollout = RolloutCallback([token_range_reward], num_generations=2, sampling=SamplingParams(max_new_tokens=2),
                              eos_token_ids=[])
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False)
    rollout.check_before_fit(trainer, GRPOModule(preset="tiny-moe", lora=lora),
                             PromptDataModule(num_random_prompts=4, prompt_len=4))
    cfg = build_text_config("tiny-moe")
    train = get_peft_model(Gemma4ForCausalLM(cfg), LoraConfig(r=2, target_modules=["q_proj"], target_parameters=EXPERTS))
    sync = LoraSync(train, Gemma4ForCausalLM(cfg))
    assert sum(p.target.dim() == 3 for p in sync.pairs) == 2 * cfg.num_hidden_layers  # gate_up and down per layer
