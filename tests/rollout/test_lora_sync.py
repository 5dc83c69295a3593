"""LoRA refresh: W = W0 + s*B@A in place, base hash unchanged after N refreshes, deterministic inference copy."""

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import Gemma4ForCausalLM

from lightning_ffpa.presets import build_text_config
from lightning_ffpa.rollout.lora_sync import LoraSync


def _models(dtype=torch.bfloat16):
    torch.manual_seed(0)
    cfg = build_text_config("tiny")
    base = Gemma4ForCausalLM(cfg).to(dtype)
    inference = copy.deepcopy(base)
    for p in inference.parameters():
        p.data.zero_()  # the refresh must fill everything
    train = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "o_proj"]))
    for name, p in train.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)
    return train, inference


def test_refresh_equals_merged_weights_and_keeps_pointers():
    train, inference = _models(torch.float32)
    sync = LoraSync(train, inference)
    ptrs = [p.data_ptr() for p in inference.parameters()]
    sync.refresh(full=True)
    assert [p.data_ptr() for p in inference.parameters()] == ptrs  # in place: graphs stay valid
    merged = copy.deepcopy(train).merge_and_unload()
    for (n, p), (_, q) in zip(merged.named_parameters(), inference.named_parameters()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-6, msg=n)
    ids = torch.randint(0, 512, (1, 12))
    torch.testing.assert_close(inference(ids).logits, train(ids).logits, atol=1e-4, rtol=1e-4)


def test_verify_no_drift_bf16():
    train, inference = _models()
    sync = LoraSync(train, inference)
    before = sync.base_digest()
    out = sync.verify_no_drift(num_refreshes=5)
    assert out["base_sha256"] == before


def test_verify_no_drift_catches_a_drifting_base():
    train, inference = _models()
    sync = LoraSync(train, inference)
    real = sync.refresh

    def drifting(full=False):
        real(full)
        sync.pairs[0].base.data.view(-1)[0] += 1  # what merge/unmerge rounding would do
    sync.refresh = drifting
    with pytest.raises(RuntimeError, match="drifted"):
        sync.verify_no_drift(num_refreshes=2)


def test_refresh_through_checkpoint_and_compile_wrappers():
    """The strategy wraps layers (AC, compile); their names must still map onto the plain inference copy."""
    from lightning_ffpa.parallel import parallelize

    train, inference = _models(torch.float32)
    parallelize(train.get_base_model(), None, activation_checkpointing="selective")
    assert any("_checkpoint_wrapped_module" in n for n, _ in train.named_parameters())
    sync = LoraSync(train, inference)
    sync.refresh(full=True)
    ids = torch.randint(0, 512, (1, 12))
    torch.testing.assert_close(inference(ids).logits, train(ids, use_cache=False).logits, atol=1e-4, rtol=1e-4)


def test_verify_no_drift_needs_adapters():
    torch.manual_seed(0)
    model = Gemma4ForCausalLM(build_text_config("tiny"))
    sync = LoraSync(model, copy.deepcopy(model))
    with pytest.raises(ValueError, match="needs LoRA adapters"):
        sync.verify_no_drift()


def _trained(lora: LoraConfig):
    """A tied tiny Gemma4 under `lora`, every trainable weight moved as training would."""
    torch.manual_seed(0)
    base = Gemma4ForCausalLM(build_text_config("tiny"))
    assert base.lm_head.weight is base.model.embed_tokens.weight
    inference = copy.deepcopy(base).requires_grad_(False)
    train = get_peft_model(base, lora)
    with torch.no_grad():
        for p in train.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.05)
    return train, inference


@pytest.mark.parametrize("lora", [
    LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "lm_head"]),  # LoRA on the tied head
    LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], modules_to_save=["lm_head"]),
    LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], modules_to_save=["embed_tokens"]),
], ids=["lora_head", "save_head", "save_embedding"])
def test_refresh_unties_what_training_untied(lora):
    """The inference copy must run what the policy runs: the embedding and the head each from its own source."""
    train, inference = _trained(lora)
    sync = LoraSync(train, inference)
    sync.refresh(full=True)
    assert inference.lm_head.weight is not inference.model.embed_tokens.weight
    ids = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(inference(ids).logits, train(ids).logits, atol=1e-4, rtol=1e-4)
    merged = copy.deepcopy(train).merge_and_unload()
    torch.testing.assert_close(inference.lm_head.weight, merged.lm_head.weight)


def test_refresh_keeps_a_head_tied_that_training_kept_tied():
    train, inference = _trained(LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"]))
    sync = LoraSync(train, inference)
    sync.refresh(full=True)
    assert inference.lm_head.weight is inference.model.embed_tokens.weight
    assert len({id(t) for t, _ in sync.copies}) == len(sync.copies)  # each tensor written once
