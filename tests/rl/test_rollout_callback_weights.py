"""`RolloutCallback(weights=...)` in a fit: the shared engine's start-up path, the merged option, and the W0 hash
taken before the first rollout and after the last (a planted in-place write to the base is caught)."""

import lightning as L
import pytest
import torch

from lightning_ffpa.callbacks.rollout import RolloutCallback
from lightning_ffpa.rl.module import GRPOModule
from lightning_ffpa.rl.prompts import PromptDataModule
from lightning_ffpa.rl.rewards import token_range_reward
from lightning_ffpa.rollout.engine import EngineConfig
from lightning_ffpa.rollout.lora_sync import LoraSync
from lightning_ffpa.rollout.sampler import SamplingParams
from lightning_ffpa.rollout.shared_weights import SharedWeights

LORA = {"r": 2, "lora_alpha": 4, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "up_proj"]}


class _WriteToW0(L.Callback):
    """After the first step, an in-place write into a frozen base weight (what a buggy merge/unmerge would do)."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == 0:
            with torch.no_grad():
                pl_module.model.base_model.model.model.layers[1].mlp.up_proj.base_layer.weight.view(-1)[3] += 1.0


def _fit(weights="shared", verify=False, extra=(), steps=2):
    rollout = RolloutCallback([token_range_reward], num_generations=2, sampling=SamplingParams(max_new_tokens=3),
                              engine=EngineConfig(page_size=8, num_pages=16, max_batch_size=4, max_seq_len=16,
                                                  attention="dense"),
                              eos_token_ids=[], verify_no_drift=verify, weights=weights)
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[rollout, *extra])
    module = GRPOModule(preset="tiny", lora=LORA)
    trainer.fit(module, datamodule=PromptDataModule(num_random_prompts=4, prompt_len=4, batch_size=2))
    return rollout


@pytest.mark.parametrize("weights", ["shared", "merged"])
def test_both_weights_options_fit_and_say_which_ran(weights):
    rollout = _fit(weights, verify=True)
    assert isinstance(rollout.sync, SharedWeights if weights == "shared" else LoraSync)
    assert rollout.weights_path.startswith({"shared": "shared: ", "merged": "merged copy: "}[weights])
    report = rollout.drift_report
    assert report["base_sha256_at_end"] == report["base_sha256"]


def test_a_planted_write_to_w0_during_the_fit_is_caught_at_its_end():
    with pytest.raises(RuntimeError, match=r"base weights drifted over \d+ refreshes of this fit"):
        _fit(verify=True, extra=[_WriteToW0()])
