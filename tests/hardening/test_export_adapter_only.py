"""HF export of adapter-only checkpoints (`model.save_frozen_weights: false`, LoRA): the export rebuilds the frozen
base as a resume does (from `model.pretrained`, or the preset under the fit's seed), checks its digest, and writes
the adapter (peft) and the merged model (`--merge_lora`) with the trained policy's logits: SFT from a one-process
FSDP2 DCP folder over a `pretrained` base, GRPO from a `.ckpt` over the tiny preset. A `pretrained` folder whose
weights changed since the fit is refused in one line naming the checkpoint and `model.pretrained`."""

from __future__ import annotations

import shutil

import lightning as L
import pytest
import torch
import torch.distributed as dist
from peft import PeftModel
from transformers import Gemma4ForCausalLM

from lightning_ffpa.callbacks.rollout import RolloutCallback
from lightning_ffpa.checkpoint.frozen import FROZEN_BASE_KEY, read_frozen_record
from lightning_ffpa.data import MockDataModule
from lightning_ffpa.errors import ConfigError
from lightning_ffpa.export import export
from lightning_ffpa.module import Gemma4LM
from lightning_ffpa.parallel import FSDP2Strategy
from lightning_ffpa.presets import build_text_config
from lightning_ffpa.rl.module import GRPOModule
from lightning_ffpa.rl.prompts import PromptDataModule
from lightning_ffpa.rl.rewards import token_range_reward
from lightning_ffpa.rollout.engine import EngineConfig
from lightning_ffpa.rollout.sampler import SamplingParams

LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "o_proj", "down_proj"]}
TWO_LAYERS = {"num_hidden_layers": 2}
QUIET = dict(accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
             enable_model_summary=False)


def _ids() -> torch.Tensor:
    return torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(1))


@torch.no_grad()
def _exports_the_policy(ckpt, want: torch.Tensor, tmp_path) -> None:
    """The adapter over the exported base (peft) and the merged export give the trained policy's logits `want`."""
    adapter = export(ckpt, tmp_path / "adapter_run")
    peft = PeftModel.from_pretrained(Gemma4ForCausalLM.from_pretrained(tmp_path / "adapter_run"), adapter.adapter_dir)
    torch.testing.assert_close(peft.eval()(input_ids=_ids()).logits, want, rtol=0, atol=1e-5)
    merged = export(ckpt, tmp_path / "merged", merge_lora=True)
    assert merged.adapter_dir is None and len(merged.merged) == 3 * 2  # 3 targets x 2 layers
    hf = Gemma4ForCausalLM.from_pretrained(tmp_path / "merged").eval()
    torch.testing.assert_close(hf(input_ids=_ids()).logits, want, rtol=0, atol=1e-4)


@pytest.mark.timeout(120)
def test_sft_dcp_folder_over_a_pretrained_base_exports_and_a_changed_base_is_refused(one_process, tmp_path):
    base = tmp_path / "base"
    torch.manual_seed(0)
    Gemma4ForCausalLM(build_text_config("tiny", **TWO_LAYERS)).save_pretrained(base)
    L.seed_everything(0)
    strategy = FSDP2Strategy(param_dtype="fp32", reduce_dtype="fp32", activation_checkpointing="none",
                             save_distributed_checkpoint=True)
    trainer = L.Trainer(devices=1, strategy=strategy, limit_val_batches=0, default_root_dir=tmp_path, **QUIET)
    lm = Gemma4LM(pretrained=str(base), dtype="float32", lora=LORA, save_frozen_weights=False, learning_rate=1e-2,
                  warmup_steps=0)
    trainer.fit(lm, MockDataModule(vocab_size=512, seq_length=16, num_samples=4, batch_size=2, seed=5))
    ckpt = tmp_path / "dcp"
    trainer.save_checkpoint(ckpt)
    with torch.no_grad():
        want = lm.model.eval()(input_ids=_ids()).logits.detach().clone()  # the sharded policy (one rank)
    dist.destroy_process_group()
    assert ckpt.is_dir() and read_frozen_record(ckpt)["tensors"]
    with torch.no_grad():  # the adapters trained: the base alone gives other logits
        assert not torch.allclose(Gemma4ForCausalLM.from_pretrained(base)(input_ids=_ids()).logits, want, atol=1e-3)
    _exports_the_policy(ckpt, want, tmp_path)

    torch.manual_seed(1)  # another model saved where the fit read its base (a moved hub revision, an overwrite)
    shutil.rmtree(base)
    Gemma4ForCausalLM(build_text_config("tiny", **TWO_LAYERS)).save_pretrained(base)
    with pytest.raises(ConfigError) as err:
        export(ckpt, tmp_path / "other", merge_lora=True)
    message = str(err.value)
    assert message.startswith(f"`ckpt={str(ckpt)!r}`") and f"`model.pretrained={str(base)!r}`" in message, message
    assert "`model.save_frozen_weights=false`" in message and "frozen weights differ" in message
    assert "\n" not in message and not (tmp_path / "other").exists()


@pytest.mark.timeout(120)
def test_fsdp2_fit_over_the_preset_exports_its_base_drawn_on_meta(one_process, tmp_path):
    """FSDP2Strategy draws a preset's random base after building on meta, adapters among the base weights, which is
    another order than a one-process build's: the export tries both orders (it once refused such a checkpoint, the
    shipped 26B-A4B recipe's, as "drawn on GPU")."""
    L.seed_everything(6)
    strategy = FSDP2Strategy(param_dtype="fp32", reduce_dtype="fp32", activation_checkpointing="none",
                             save_distributed_checkpoint=False)
    trainer = L.Trainer(devices=1, strategy=strategy, limit_val_batches=0, default_root_dir=tmp_path, **QUIET)
    lm = Gemma4LM(preset="tiny", config_overrides=TWO_LAYERS, dtype="float32", lora=LORA, save_frozen_weights=False,
                  learning_rate=1e-2, warmup_steps=0)
    trainer.fit(lm, MockDataModule(vocab_size=512, seq_length=16, num_samples=4, batch_size=2, seed=5))
    ckpt = tmp_path / "fsdp2.ckpt"
    trainer.save_checkpoint(ckpt)
    with torch.no_grad():
        want = lm.model.eval()(input_ids=_ids()).logits.detach().clone()
    dist.destroy_process_group()
    _exports_the_policy(ckpt, want, tmp_path)


@pytest.mark.timeout(120)
def test_grpo_ckpt_over_the_preset_exports_under_the_fits_seed(tmp_path):
    L.seed_everything(3)  # the preset base is drawn under it; the export draws it again under the recorded seed
    rollout = RolloutCallback([token_range_reward], num_generations=4, sampling=SamplingParams(max_new_tokens=4),
                              engine=EngineConfig(page_size=8, num_pages=32, max_batch_size=8, max_seq_len=16,
                                                  attention="dense"),
                              eos_token_ids=[])
    trainer = L.Trainer(callbacks=[rollout], **QUIET)
    module = GRPOModule(preset="tiny", config_overrides=TWO_LAYERS, lora=LORA, save_frozen_weights=False,
                        learning_rate=2e-2, clip_eps=0.2)
    trainer.fit(module, datamodule=PromptDataModule(num_random_prompts=4, prompt_len=4, batch_size=2))
    ckpt = tmp_path / "grpo.ckpt"
    trainer.save_checkpoint(ckpt)
    saved = torch.load(ckpt, map_location="cpu", weights_only=True)
    assert saved[FROZEN_BASE_KEY]["seed"] == 3 and not any(".base_layer." in k for k in saved["state_dict"])
    L.seed_everything(4)  # the export does not depend on the seed of the process it runs in
    with torch.no_grad():
        want = module.model.eval()(input_ids=_ids()).logits
    _exports_the_policy(ckpt, want, tmp_path)
    assert torch.initial_seed() == 4  # and leaves it as it was
