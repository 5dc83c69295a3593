"""HF export of a GRPO checkpoint: the export rebuilds the module class the checkpoint names (GRPOModule, not
Gemma4LM), and the LoRA adapter (peft) and the merged model (`from_pretrained`) give the trained policy's logits;
a class path that cannot be imported or does not build an HF model is refused in one line."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from peft import PeftModel
from transformers import Gemma4ForCausalLM

from lightning_ffpa.callbacks.rollout import RolloutCallback
from lightning_ffpa.errors import CheckpointError
from lightning_ffpa.export import export, model_config, module_class_path
from lightning_ffpa.hf_module import MODULE_CLASS_KEY
from lightning_ffpa.rl.module import GRPOModule
from lightning_ffpa.rl.prompts import PromptDataModule
from lightning_ffpa.rl.rewards import token_range_reward
from lightning_ffpa.rollout.engine import EngineConfig
from lightning_ffpa.rollout.sampler import SamplingParams

LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "o_proj", "down_proj"]}
GRPO = "lightning_ffpa.rl.module.GRPOModule"


@pytest.fixture(scope="module")
def grpo_run(tmp_path_factory):
    """Two GRPO steps with LoRA on the tiny preset; the policy in memory and its `.ckpt`."""
    torch.manual_seed(0)
    rollout = RolloutCallback([token_range_reward], num_generations=4, sampling=SamplingParams(max_new_tokens=4),
                              engine=EngineConfig(page_size=8, num_pages=32, max_batch_size=8, max_seq_len=16,
                                                  attention="dense"),
                              eos_token_ids=[])
    trainer = L.Trainer(max_steps=2, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[rollout])
    module = GRPOModule(preset="tiny", lora=LORA, learning_rate=2e-2, clip_eps=0.2)
    trainer.fit(module, datamodule=PromptDataModule(num_random_prompts=4, prompt_len=4, batch_size=2))
    path = tmp_path_factory.mktemp("grpo") / "grpo.ckpt"
    trainer.save_checkpoint(path)
    return module.eval(), path


def _named_as(ckpt, dst, how: str):
    """The checkpoint with its class named as LightningCLI saves it, as the module saves it, or not at all."""
    state = torch.load(ckpt, map_location="cpu", weights_only=False)
    assert state[MODULE_CLASS_KEY] == GRPO
    if how != "module_class":
        del state[MODULE_CLASS_KEY]
    if how == "cli":
        state["hyper_parameters"] = {"_class_path": GRPO, **state["hyper_parameters"],
                                     "_instantiator": "lightning.pytorch.cli.instantiate_module"}
    torch.save(state, dst)
    return dst


@torch.no_grad()
@pytest.mark.parametrize("how", ["module_class", "cli", "unnamed"])
def test_grpo_checkpoint_exports_adapter_and_merged_with_the_policys_logits(grpo_run, tmp_path, how):
    policy, ckpt = grpo_run
    ckpt = _named_as(ckpt, tmp_path / "named.ckpt", how)
    ids = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(1))
    want = policy.model(input_ids=ids).logits
    assert any(p.abs().sum() > 0 for n, p in policy.model.named_parameters() if "lora_B" in n)  # trained

    adapter = export(ckpt, tmp_path / "adapter_run")
    base = Gemma4ForCausalLM.from_pretrained(tmp_path / "adapter_run")
    peft = PeftModel.from_pretrained(base, adapter.adapter_dir).eval()
    torch.testing.assert_close(peft(input_ids=ids).logits, want, rtol=0, atol=1e-5)

    merged = export(ckpt, tmp_path / "merged", merge_lora=True)
    assert merged.adapter_dir is None and len(merged.merged) == 3 * 4  # 3 targets x 4 layers
    hf = Gemma4ForCausalLM.from_pretrained(tmp_path / "merged").eval()
    torch.testing.assert_close(hf(input_ids=ids).logits, want, rtol=0, atol=1e-4)


@pytest.mark.parametrize("path, match", [
    ("lightning_ffpa.no_such_module.Policy", "cannot import 'lightning_ffpa.no_such_module.Policy'"),
    ("lightning.pytorch.LightningModule", "not an HFModule"),
])
def test_export_refuses_a_module_class_it_cannot_rebuild(path, match):
    meta = {"hyper_parameters": {"_class_path": path, "preset": "tiny"}}
    with pytest.raises(CheckpointError, match=match) as err:
        model_config(meta)
    assert "\n" not in str(err.value) and "--config" in str(err.value)


def test_an_unnamed_class_is_inferred_only_when_one_module_fits():
    assert module_class_path({"hyper_parameters": {"preset": "tiny", "clip_eps": 0.2}}) == GRPO
    assert module_class_path({"hyper_parameters": {"preset": "tiny", "weight_decay": 0.1}}) == \
        "lightning_ffpa.module.Gemma4LM"
    with pytest.raises(CheckpointError, match="fit 0 of"):
        module_class_path({"hyper_parameters": {"preset": "tiny", "clip_eps": 0.2, "weight_decay": 0.1}})
