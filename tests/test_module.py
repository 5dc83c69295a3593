"""Gemma4LM: tiny model forward/backward, pretrained loading, LoRA, and bad-input errors."""

import pytest
import torch
from transformers import Gemma4ForCausalLM

from lightning_ffpa.module import Gemma4LM
from lightning_ffpa.presets import build_text_config


def _batch(vocab=512, b=2, s=48, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (b, s), generator=g)
    return {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}


def test_tiny_has_both_layer_types_head_dim_512_and_k_eq_v():
    lm = Gemma4LM(preset="tiny", dtype="float32")
    lm.configure_model()
    attns = [layer.self_attn for layer in lm.hf_model.model.layers]
    assert {a.head_dim for a in attns if a.sliding_window is None} == {512}
    assert any(a.sliding_window for a in attns)
    assert all(a.v_proj is None for a in attns if a.sliding_window is None)  # k_eq_v on full layers


@pytest.mark.parametrize("preset", ["tiny", "tiny-moe"])
def test_forward_backward_finite(preset):
    lm = Gemma4LM(preset=preset, dtype="float32")
    lm.configure_model()
    loss, n = lm.compute_loss(_batch())
    loss.backward()
    assert torch.isfinite(loss) and n == 2 * 47
    grads = [p.grad for p in lm.model.parameters() if p.requires_grad]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)


def test_loss_ignores_minus_100_and_matches_hf():
    lm = Gemma4LM(preset="tiny", dtype="float32", attn_implementation="eager")
    lm.configure_model()
    batch = _batch()
    batch["labels"][:, :10] = -100
    ours, n = lm.compute_loss(batch)
    hf = lm.model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
    torch.testing.assert_close(ours, hf, rtol=1e-5, atol=1e-5)
    assert n == 2 * 47 - 2 * 9


def test_pretrained_loads_local_checkpoint(tmp_path):
    torch.manual_seed(0)
    ref = Gemma4ForCausalLM(build_text_config("tiny"))
    ref.save_pretrained(tmp_path / "tiny")
    lm = Gemma4LM(pretrained=str(tmp_path / "tiny"), dtype="float32", attn_implementation="eager")
    lm.configure_model()
    batch = _batch()
    ref.config._attn_implementation = "eager"
    want = ref(input_ids=batch["input_ids"]).logits
    got = lm.model(input_ids=batch["input_ids"]).logits
    torch.testing.assert_close(got, want)


def test_conditional_generation_class_builds():
    lm = Gemma4LM(preset="tiny", model_class="conditional_generation", dtype="float32")
    lm.configure_model()
    loss, _ = lm.compute_loss(_batch())
    assert torch.isfinite(loss)


def test_lora_trains_only_adapters():
    lm = Gemma4LM(preset="tiny", dtype="float32", lora={"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "o_proj"]})
    lm.configure_model()
    trainable = [n for n, p in lm.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)


@pytest.mark.parametrize(
    "kwargs, option",
    [
        ({"attn_implementation": "flash_magic"}, "model.attn_implementation"),
        ({"pretrained": "/nonexistent/gemma4"}, "model.pretrained"),
        ({"preset": "gemma4-999b"}, "model.preset"),
        ({"max_seq_length": 10**7}, "model.max_seq_length"),
    ],
)
def test_bad_input_names_the_option(kwargs, option):
    with pytest.raises((ValueError, FileNotFoundError), match=option.replace(".", r"\.")):
        Gemma4LM(**kwargs)


def test_lora_targets_matching_nothing():
    lm = Gemma4LM(preset="tiny", lora={"r": 4, "target_modules": ["no_such_proj"]})
    with pytest.raises(ValueError, match=r"model\.lora\.target_modules"):
        lm.configure_model()


def test_build_adamw_groups_and_fused_choice():
    import transformers

    from lightning_ffpa.module import build_adamw
    from lightning_ffpa.presets import build_text_config

    model = transformers.Gemma4ForCausalLM(build_text_config("tiny"))
    opt = build_adamw(model, lr=1e-3, weight_decay=0.1)
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.ndim >= 2 for p in decay["params"]) and no_decay["params"]
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))
    assert opt.defaults["fused"] is None  # CPU parameters: torch's default implementation


@pytest.mark.gpu
def test_build_adamw_is_fused_on_cuda_and_steps():
    import transformers

    from lightning_ffpa.module import build_adamw
    from lightning_ffpa.presets import build_text_config

    model = transformers.Gemma4ForCausalLM(build_text_config("tiny")).cuda()
    opt = build_adamw(model, lr=1e-3)
    assert opt.defaults["fused"] is True
    ids = torch.randint(0, 512, (2, 64), device="cuda")
    before = model.lm_head.weight.detach().clone()
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    opt.step()
    assert not torch.equal(before, model.lm_head.weight)
