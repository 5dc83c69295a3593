"""A GRPO LightningModule around an HF causal LM (tiny preset or pretrained), optionally with peft LoRA.

Owns the policy forward and the loss on batches the rollout Callback has filled
(`input_ids`, `attention_mask`, `completion_mask`, `old_logprobs`, `advantages`). It does not generate:
any LightningModule exposing its HF model as `self.model` can use the Callback the same way.
"""

from __future__ import annotations

import lightning as L
import torch
from torch import nn
from torchmetrics import MeanMetric

from lightning_ffpa.module import build_adamw
from lightning_ffpa.rl.grpo import grpo_loss


def token_logprobs(model: nn.Module, batch: dict, temperature: float = 1.0) -> torch.Tensor:
    """log p(token t | < t) for t >= 1, shape (N, L-1), at the rollout temperature."""
    # use_cache=False: a KV cache would grow again in every activation-checkpoint recompute.
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                   use_cache=False).logits[:, :-1].float()
    if temperature > 0:
        logits = logits / temperature
    return torch.log_softmax(logits, -1).gather(2, batch["input_ids"][:, 1:, None])[..., 0]


class GRPOModule(L.LightningModule):
    """GRPO policy: HF model in `self.model`, clipped-ratio loss, optional KL to the adapter-free base."""

    def __init__(self, preset: str = "tiny", pretrained: str | None = None, lora_rank: int = 0,
                 lora_alpha: float = 16.0, lora_targets: list[str] | None = None, lr: float = 1e-5,
                 clip_eps: float = 0.2, beta: float = 0.0, temperature: float = 1.0,
                 dtype: str = "float32", seed: int = 0) -> None:
        """
        Args:
            preset: `lightning_ffpa.presets` name used when `pretrained` is None (random weights).
            pretrained: HF model name/path to load instead of a preset.
            lora_rank: peft LoRA rank; 0 trains all weights.
            lora_alpha: LoRA alpha (scale = alpha / rank).
            lora_targets: Module names LoRA wraps (default: attention and MLP projections).
            lr: AdamW learning rate.
            clip_eps: PPO/GRPO ratio clip.
            beta: KL coefficient against the base model (needs `lora_rank > 0`: the base is the adapter-free model).
            temperature: Rollout temperature; the policy scores tokens at the same temperature.
            dtype: Parameter dtype (`float32`, `bfloat16`).
            seed: Seed for random preset weights.
        """
        super().__init__()
        if beta > 0 and lora_rank == 0:
            raise ValueError(f"`beta={beta}` needs `lora_rank > 0` (the reference is the adapter-free base)")
        self.save_hyperparameters()
        self.model: nn.Module | None = None
        self.clip_fraction = MeanMetric()
        self.kl = MeanMetric()

    def configure_model(self) -> None:
        if self.model is not None:
            return
        from transformers import AutoModelForCausalLM, Gemma4ForCausalLM

        from lightning_ffpa.presets import build_text_config

        hp = self.hparams
        dtype = getattr(torch, hp.dtype)
        if hp.pretrained:
            model = AutoModelForCausalLM.from_pretrained(hp.pretrained, dtype=dtype)
        else:
            torch.manual_seed(hp.seed)
            model = Gemma4ForCausalLM(build_text_config(hp.preset)).to(dtype)
        if hp.lora_rank > 0:
            from peft import LoraConfig, get_peft_model

            targets = hp.lora_targets or ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
            model = get_peft_model(model, LoraConfig(r=hp.lora_rank, lora_alpha=hp.lora_alpha, target_modules=targets))
        self.model = model

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        hp = self.hparams
        logp = token_logprobs(self.model, batch, hp.temperature)
        mask = batch["completion_mask"][:, 1:]
        ref = None
        if hp.beta > 0:
            with torch.no_grad(), self.model.disable_adapter():
                ref = token_logprobs(self.model, batch, hp.temperature)
        loss, stats = grpo_loss(logp, batch["old_logprobs"][:, 1:], batch["advantages"], mask,
                                clip_eps=hp.clip_eps, beta=hp.beta, ref_logprobs=ref)
        self.log("train/loss", loss, prog_bar=True)
        self.clip_fraction.update(stats["clip_fraction"])
        self.log("train/clip_fraction", self.clip_fraction, on_step=True, on_epoch=False)
        if "kl" in stats:
            self.kl.update(stats["kl"])
            self.log("train/kl", self.kl, on_step=True, on_epoch=False)
        return loss

    def configure_optimizers(self):
        return build_adamw(self.model, self.hparams.lr, weight_decay=0.0, betas=(0.9, 0.999))  # fused on CUDA
