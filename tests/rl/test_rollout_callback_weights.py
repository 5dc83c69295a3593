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


@pytest.mark.timeout(300)
def test_a_resumed_fsdp2_fit_hashes_the_restored_base(tmp_path, one_process):
    """FSDP2Strategy restores a checkpoint after `on_fit_start` built (and hashed) the engine: the end-of-fit hash
    is compared with the restored base's, not with the one the checkpoint replaced, and the engine (reading the
    replicated base in place) runs the restored one."""
    import torch.distributed as dist

    from lightning_ffpa.parallel import FSDP2Strategy

    def fit(steps, ckpt_path=None):
        rollout = RolloutCallback([token_range_reward], num_generations=2, sampling=SamplingParams(max_new_tokens=3),
                                  engine=EngineConfig(page_size=8, num_pages=16, max_batch_size=4, max_seq_len=16,
                                                      attention="dense"),
                                  eos_token_ids=[], verify_no_drift=True)
        ckpt = L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path, save_last=True)
        trainer = L.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                            enable_model_summary=False, callbacks=[rollout, ckpt], default_root_dir=tmp_path,
                            strategy=FSDP2Strategy(param_dtype=None, reduce_dtype=None,
                                                  save_distributed_checkpoint=False))
        try:
            trainer.fit(GRPOModule(preset="tiny", lora=LORA),
                        datamodule=PromptDataModule(num_random_prompts=4, prompt_len=4, batch_size=2),
                        ckpt_path=ckpt_path)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
        return rollout

    fit(1)
    last = tmp_path / "last.ckpt"
    saved = torch.load(last, weights_only=False)
    key = next(k for k in saved["state_dict"] if k.endswith("layers.1.mlp.up_proj.base_layer.weight"))
    saved["state_dict"][key] = saved["state_dict"][key] + 1.0  # a base the resumed process does not build itself
    torch.save(saved, last)
    rollout = fit(2, str(last))
    assert rollout.weights_path.startswith("shared: ")
    assert rollout.drift_report["base_sha256_at_end"] == rollout.drift_report["base_sha256"]
    up = rollout.sync.inference.model.layers[1].mlp.up_proj
    torch.testing.assert_close(up.weight, saved["state_dict"][key], rtol=0, atol=0)
