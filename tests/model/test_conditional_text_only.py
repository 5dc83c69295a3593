"""Text-only training through `Gemma4ForConditionalGeneration` (`model_class: conditional_generation`) needs no
`mm_token_type_ids` (transformers#45200: some transformers versions raised in training without them, since
AutoTokenizer never makes them). A tiny multimodal checkpoint (a vision tower, `use_bidirectional_attention:
vision` as the large Gemma4 checkpoints have) is loaded by the module's `pretrained` path and fitted on text rows;
its text attention stays causal and equals the all-text (`mm_token_type_ids` zeros) forward."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from transformers import Gemma4Config, Gemma4ForConditionalGeneration, Gemma4VisionConfig

from lightning_ffpa.data import MockDataModule
from lightning_ffpa.module import Gemma4LM
from lightning_ffpa.presets import build_text_config


@pytest.fixture(scope="module")
def multimodal_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma4_mm")
    text = build_text_config("tiny", use_bidirectional_attention="vision")
    vision = Gemma4VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                num_key_value_heads=2, head_dim=16)
    torch.manual_seed(0)
    config = Gemma4Config(text_config=text.to_dict(), vision_config=vision.to_dict(), audio_config=None)
    Gemma4ForConditionalGeneration(config).save_pretrained(path)
    return str(path)


class _Batches(pl.Callback):
    def __init__(self) -> None:
        self.keys: list[set[str]] = []
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.keys.append(set(batch))
        self.losses.append(float(outputs["loss"]))


def test_conditional_generation_fits_on_text_rows_without_mm_token_type_ids(multimodal_dir):
    torch.manual_seed(0)
    lm = Gemma4LM(pretrained=multimodal_dir, model_class="conditional_generation", dtype="float32",
                  learning_rate=1e-2, warmup_steps=0)
    seen = _Batches()
    trainer = pl.Trainer(max_steps=3, accelerator="cpu", logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, callbacks=[seen])
    trainer.fit(lm, MockDataModule(seq_length=16, num_samples=6, batch_size=2))
    assert type(lm.hf_model).__name__ == "Gemma4ForConditionalGeneration"
    assert lm.hf_model.config.text_config.use_bidirectional_attention == "vision"
    assert len(seen.losses) == 3 and all(torch.isfinite(torch.tensor(seen.losses)))
    assert not any("mm_token_type_ids" in keys or "token_type_ids" in keys for keys in seen.keys)


@torch.no_grad()
def test_text_rows_attend_causally_in_training_mode(multimodal_dir):
    lm = Gemma4LM(pretrained=multimodal_dir, model_class="conditional_generation", dtype="float32")
    lm.configure_model()
    lm.train()  # the mode in which transformers#45200 asked for mm_token_type_ids
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    changed = ids.clone()
    changed[:, 10] = (changed[:, 10] + 1) % 512
    logits = lm(ids).logits
    later = lm(changed).logits
    assert torch.equal(logits[:, :10], later[:, :10])  # no token sees a later one: no bidirectional block
    assert not torch.equal(logits[:, 10:], later[:, 10:])
    assert torch.equal(logits, lm(ids, mm_token_type_ids=torch.zeros_like(ids)).logits)  # = all-text ids
    # the fused loss reads the hidden states through the same text-only path
    batch = {"input_ids": ids, "labels": ids}
    chunked = Gemma4LM(pretrained=multimodal_dir, model_class="conditional_generation", dtype="float32",
                       loss_impl="chunked", loss_chunk_size=8)
    chunked.model = lm.model
    torch.testing.assert_close(chunked.compute_loss(batch)[0], lm.compute_loss(batch)[0], rtol=1e-5, atol=1e-5)


def test_lora_names_that_also_match_the_vision_towers_layers_are_refused_before_any_weight_loads(multimodal_dir):
    """`target_modules: [q_proj, v_proj]` (the docs' example) also matched the vision tower's
    `Gemma4ClippableLinear` q/v projections: peft failed after the weights were loaded and files were written,
    with its reason cut to one line. The check on the meta model names them; the regex it suggests fits."""
    from lightning_ffpa.errors import ConfigError
    from lightning_ffpa.validation import check_lora_targets

    def module(lora):
        return Gemma4LM(pretrained=multimodal_dir, model_class="conditional_generation", dtype="float32", lora=lora)

    with pytest.raises(ConfigError, match=r"^`model.lora.target_modules=\['q_proj', 'v_proj'\]`: also match \d+ "
                                          r"module\(s\) that LoRA cannot wrap, e.g. model.vision_tower\..*q_proj "
                                          r"\(Gemma4ClippableLinear\)"):
        check_lora_targets(module({"r": 2, "target_modules": ["q_proj", "v_proj"]}))
    check_lora_targets(module({"r": 2, "target_modules": r".*language_model.*\.(q_proj|v_proj)"}))
    check_lora_targets(module({"r": 2, "target_modules": ["q_proj", "v_proj"], "exclude_modules": ".*vision_tower.*"}))
