"""GPU: a tiny GRPO fit with the product's CUDA defaults: FSDP2Strategy (bf16 compute, compiled SAC
layers), LoRA, and a rollout Callback whose engine compiles flex and the decode step and replays graphs."""

import lightning as L
import pytest
import torch

from lightning_ffpa.callbacks.rollout import RolloutCallback
from lightning_ffpa.parallel import FSDP2Strategy
from lightning_ffpa.rl.module import GRPOModule
from lightning_ffpa.rl.prompts import PromptDataModule
from lightning_ffpa.rl.rewards import token_range_reward
from lightning_ffpa.rollout.engine import EngineConfig
from lightning_ffpa.rollout.sampler import SamplingParams

pytestmark = pytest.mark.gpu


class _Rewards(L.Callback):
    def __init__(self):
        self.history = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.history.append((batch["rewards"].mean().item(), float(outputs["loss"])))


@pytest.mark.timeout(600)
def test_tiny_grpo_fit_on_cuda_with_fsdp2_lora_and_compiled_graphed_rollouts(tmp_path):
    torch.manual_seed(0)
    rollout = RolloutCallback([token_range_reward], num_generations=8, sampling=SamplingParams(max_new_tokens=16),
                              engine=EngineConfig(page_size=16, num_pages=64, max_batch_size=16, max_seq_len=32),
                              eos_token_ids=[], verify_no_drift=True)
    rewards = _Rewards()
    trainer = L.Trainer(max_steps=4, accelerator="gpu", devices=1, strategy=FSDP2Strategy(), logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=tmp_path, callbacks=[rollout, rewards])
    module = GRPOModule(preset="tiny", learning_rate=1e-3, temperature=1.0,
                        lora={"r": 4, "lora_alpha": 16, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]})
    trainer.fit(module, datamodule=PromptDataModule(num_random_prompts=16, prompt_len=4, batch_size=2))
    eng = rollout.engine
    assert eng.decode_path == "compiled" and eng.attention_path == "flex_compiled"
    assert eng.stats["graph_replays"] > 0 and eng.stats["eager_decodes"] == 0
    assert {p.dtype for p in rollout.sync.inference.parameters()} == {torch.bfloat16}
    assert rollout.drift_report is not None
    assert trainer.callback_metrics["rollout/eager_decodes"] == 0
    assert len(rewards.history) == 4
    assert all(torch.isfinite(torch.tensor(pair)).all() for pair in rewards.history), rewards.history
