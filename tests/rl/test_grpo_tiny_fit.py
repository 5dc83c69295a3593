"""A tiny GRPO fit on CPU through the rollout Callback: the toy reward rises."""

import lightning as L
import pytest
import torch

from lightning_ffpa.callbacks.rollout import RolloutCallback
from lightning_ffpa.errors import ConfigError
from lightning_ffpa.rl.module import GRPOModule
from lightning_ffpa.rl.prompts import PromptDataModule
from lightning_ffpa.rl.rewards import token_range_reward
from lightning_ffpa.rollout.engine import EngineConfig
from lightning_ffpa.rollout.sampler import SamplingParams


class _Rewards(L.Callback):
    def __init__(self):
        self.history, self.gaps = [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.history.append(batch["rewards"].mean().item())

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step:  # the step before's logged values
            assert "train/clip_fraction" in trainer.callback_metrics  # logged every step, not only accumulated
            self.gaps.append(trainer.callback_metrics["train/sampler_logprob_gap"].item())


@pytest.mark.timeout(120)
def test_tiny_grpo_reward_rises():
    torch.manual_seed(0)
    rollout = RolloutCallback([token_range_reward], num_generations=8, sampling=SamplingParams(max_new_tokens=6),
                              engine=EngineConfig(page_size=8, num_pages=64, max_batch_size=16, max_seq_len=32,
                                                  attention="dense"),
                              eos_token_ids=[])
    rewards = _Rewards()
    trainer = L.Trainer(max_steps=10, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[rollout, rewards])
    module = GRPOModule(preset="tiny", learning_rate=2e-2, temperature=1.0)
    trainer.fit(module, datamodule=PromptDataModule(num_random_prompts=16, prompt_len=4, batch_size=2))
    h = rewards.history
    assert len(h) == 10
    assert sum(h[-3:]) / 3 > sum(h[:3]) / 3 + 0.1, h
    # fp32 on the CPU, refreshed before every rollout: the sampler's logprobs are the policy's
    assert len(rewards.gaps) == 9 and max(rewards.gaps) < 1e-4, rewards.gaps


@pytest.mark.timeout(240)
def test_grpo_fits_under_fsdp2_with_selective_ac_lora_and_kl(tmp_path):
    """GRPO through the CLI with FSDP2Strategy (wrapped, sharded layers), LoRA and the KL term."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import yaml

    root = Path(__file__).resolve().parents[2]
    cfg = yaml.safe_load((root / "configs" / "tiny_grpo.yaml").read_text())
    cfg["trainer"].update(max_steps=3, logger=False, default_root_dir=str(tmp_path),
                          strategy={"class_path": "lightning_ffpa.parallel.FSDP2Strategy",
                                    "init_args": {"param_dtype": None, "reduce_dtype": None,
                                                  "activation_checkpointing": "selective"}})
    cfg["model"]["init_args"].update(lora={"r": 4, "lora_alpha": 16, "target_modules": ["q_proj", "o_proj"]}, beta=0.05)
    path = tmp_path / "grpo_fsdp2.yaml"
    path.write_text(yaml.safe_dump(cfg))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1", MASTER_PORT="29641")
    proc = subprocess.run([sys.executable, "-m", "lightning_ffpa.cli", "fit", "--config", str(path)], env=env,
                          capture_output=True, text=True, timeout=220, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    # FSDP2 on one device keeps the frozen base whole (replicate_frozen auto): the engine reads it in place
    assert "engine weights shared: " in proc.stdout + proc.stderr, proc.stderr[-4000:]


def test_inference_dtype_option():
    with pytest.raises(ConfigError, match="RolloutCallback.inference_dtype"):
        RolloutCallback([token_range_reward], inference_dtype="bf17")
    rollout = RolloutCallback([token_range_reward], num_generations=2, sampling=SamplingParams(max_new_tokens=2),
                              engine=EngineConfig(page_size=8, num_pages=32, max_batch_size=4, max_seq_len=16,
                                                  attention="dense"),
                              eos_token_ids=[], inference_dtype="bfloat16")
    trainer = L.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[rollout])
    module = GRPOModule(preset="tiny", lora={"r": 2, "target_modules": ["q_proj", "o_proj"]})
    trainer.fit(module, datamodule=PromptDataModule(num_random_prompts=2, prompt_len=4, batch_size=2))
    assert {p.dtype for p in rollout.sync.inference.parameters()} == {torch.bfloat16}
    assert next(module.model.parameters()).dtype == torch.float32
    logged = trainer.callback_metrics  # how the engine ran is visible: eager on CPU, no graphs
    assert logged["rollout/eager_decodes"] > 0 and logged["rollout/graph_replays"] == 0


def test_routed_experts_are_logged_per_rollout():
    """`engine.count_routed_experts` on the tiny MoE: each rollout logs the share of expert bytes its decode steps
    read (top-2 of 4 experts, 4 rows: between a half and all of them) and the mean union per layer."""
    engine = EngineConfig(page_size=8, num_pages=32, max_batch_size=4, max_seq_len=16, attention="dense",
                          count_routed_experts=True)
    rollout = RolloutCallback([token_range_reward], num_generations=2, sampling=SamplingParams(max_new_tokens=4),
                              engine=engine, eos_token_ids=[])
    trainer = L.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[rollout])
    module = GRPOModule(preset="tiny-moe", lora={"r": 2, "target_modules": ["q_proj", "o_proj"]})
    trainer.fit(module, datamodule=PromptDataModule(num_random_prompts=2, prompt_len=4, batch_size=2))
    logged = trainer.callback_metrics
    union = logged["rollout/moe_mean_union"].item()
    assert 2 <= union <= 4 and logged["rollout/routed_expert_fraction"].item() == pytest.approx(union / 4)
    assert rollout.engine.routing.steps == 0  # reset after each rollout's log


@pytest.mark.timeout(240)
def test_sampler_logprobs_are_the_policys_past_the_window_on_moe_with_expert_lora_and_ffpa():
    """fp32 on the CPU: the engine's logprobs equal the update's on tiny-moe with LoRA on the expert stacks, the
    update on FFPA (its CPU reference op) and Flex for the sliding layers, and sequences past the 16-token window, so
    a gap a GPU run logs (`train/sampler_logprob_gap`) comes from its dtype, not from the plumbing."""
    from lightning_ffpa.attention import kernels
    from lightning_ffpa.callbacks import FFPAAttention

    torch.manual_seed(0)
    rollout = RolloutCallback([token_range_reward], num_generations=2, sampling=SamplingParams(max_new_tokens=24),
                              engine=EngineConfig(page_size=8, num_pages=64, max_batch_size=4, max_seq_len=64,
                                                  attention="flex"), eos_token_ids=[])
    rewards = _Rewards()
    trainer = L.Trainer(max_steps=2, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[rollout, rewards, FFPAAttention(sliding="flex")])
    module = GRPOModule(preset="tiny-moe", learning_rate=1e-2, temperature=1.0,
                        lora={"r": 2, "target_modules": ["q_proj", "o_proj"],
                              "target_parameters": ["experts.gate_up_proj", "experts.down_proj"]})
    with kernels.force_kernel("reference"):
        trainer.fit(module, datamodule=PromptDataModule(num_random_prompts=4, prompt_len=20, batch_size=2))
    gaps = [*rewards.gaps, trainer.callback_metrics["train/sampler_logprob_gap"].item()]
    assert len(gaps) == 2 and max(gaps) < 1e-4, gaps  # the second step's rollout read the refreshed adapters
    assert module.model.config.sliding_window < 20 + 24
