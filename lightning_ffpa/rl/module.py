"""A GRPO LightningModule around an HF causal LM, built from the same model options as `Gemma4LM`.

Owns the policy forward and the loss on batches the rollout Callback has filled
(`input_ids`, `attention_mask`, `completion_mask`, `old_logprobs`, `advantages`). Model construction (preset
or pretrained, config overrides, attention, dtype, LoRA, FSDP2 meta build) is `HFModule`'s. It does not
generate: any LightningModule exposing its HF model as `self.model` can use the Callback the same way.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import nn
from torchmetrics import MeanMetric

from lightning_ffpa.dtypes import DtypeOrAuto
from lightning_ffpa.errors import ConfigError
from lightning_ffpa.hf_module import HFModule
from lightning_ffpa.lora import LoraSpec, lora_hparam
from lightning_ffpa.module import build_adamw, check_range
from lightning_ffpa.rl.grpo import grpo_loss, sampler_weights


def token_logprobs(model: nn.Module, batch: dict, temperature: float = 1.0) -> torch.Tensor:
    """log p(token t | < t) for t >= 1, shape (N, L-1), at the rollout temperature."""
    # use_cache=False: a KV cache would grow again in every activation-checkpoint recompute.
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                   use_cache=False).logits[:, :-1].float()
    if temperature > 0:
        logits = logits / temperature
    return torch.log_softmax(logits, -1).gather(2, batch["input_ids"][:, 1:, None])[..., 0]


class GRPOModule(HFModule):
    """GRPO policy: HF model in `self.model`, clipped-ratio loss, optional KL to the adapter-free base."""

    def __init__(
        self,
        pretrained: str | None = None,
        preset: str = "tiny",
        config_overrides: dict[str, Any] | None = None,
        attn_implementation: str = "sdpa",
        dtype: DtypeOrAuto = "float32",
        lora: LoraSpec | None = None,
        save_frozen_weights: bool = True,
        learning_rate: float = 1e-5,
        clip_eps: float = 0.2,
        clip_eps_high: float | None = None,
        beta: float = 0.0,
        temperature: float = 1.0,
        old_logprobs: Literal["policy", "engine"] = "policy",
        sampler_is_cap: float | None = 3.0,
    ) -> None:
        """Build the module; the policy is created in `configure_model` by the same code as `Gemma4LM`'s model.

        Args:
            pretrained: local path or hub id passed to `from_pretrained`; None builds from `preset`.
            preset: config preset when `pretrained` is None: tiny, tiny-moe, gemma4-31b, gemma4-26b-a4b.
            config_overrides: text-config fields to override (e.g. `{num_hidden_layers: 6}`); an unknown field is an error.
            attn_implementation: sdpa, eager, flex_attention or ffpa (any name registered with transformers).
            dtype: parameter dtype; `auto` is bf16 on GPUs that support it, else fp32.
            lora: peft LoRA options (e.g. `{r: 16, lora_alpha: 32, target_modules: [q_proj, v_proj]}`); None trains all weights.
            save_frozen_weights: write the frozen base (weights with requires_grad False: a LoRA's base) into
                checkpoints; false saves only the trained weights and a digest of the base, which a resume
                rebuilds from `pretrained` (or `preset` under the run's seed) and checks. Needs `lora`.
            learning_rate: AdamW learning rate (> 0).
            clip_eps: lower ratio clip: the ratio is kept >= 1 - clip_eps (> 0).
            clip_eps_high: upper ratio clip: the ratio is kept <= 1 + clip_eps_high (DAPO's clip-higher); None = clip_eps.
            beta: KL coefficient against the base model (>= 0; > 0 needs `lora`: the base is the adapter-free model).
            temperature: Rollout temperature; the policy scores tokens at the same temperature (> 0).
            old_logprobs: the ratio's denominator. "policy": the policy's own logprobs of the sampled tokens,
                without gradient (one optimizer step per rollout, so the ratio is 1 at the step, as in TRL);
                "engine": the sampler's logprobs, so the ratio also carries the engine's bf16 numerics.
            sampler_is_cap: with "policy", weight each token by min(pi_policy / pi_engine, cap), truncated
                importance sampling for the engine's numerics (TRL's vllm_importance_sampling_correction); >= 1,
                None for no weight. Must be None with "engine".
        """
        super().__init__()
        lora = lora_hparam(lora)  # plain data in hparams and checkpoints
        check_range("model.learning_rate", learning_rate, gt=0)
        check_range("model.clip_eps", clip_eps, gt=0)
        if clip_eps_high is not None:
            check_range("model.clip_eps_high", clip_eps_high, ge=clip_eps)
        check_range("model.beta", beta, ge=0)
        check_range("model.temperature", temperature, gt=0)
        if old_logprobs not in ("policy", "engine"):
            raise ConfigError("model.old_logprobs", old_logprobs, "must be 'policy' or 'engine'")
        if sampler_is_cap is not None:
            if old_logprobs == "engine":
                raise ConfigError("model.sampler_is_cap", sampler_is_cap,
                                  "corrects the policy ratio for the engine's numerics; set it to null with "
                                  "`old_logprobs: engine`, whose ratio already divides by the engine's logprobs")
            check_range("model.sampler_is_cap", sampler_is_cap, ge=1)
        if beta > 0 and lora is None:
            raise ConfigError("model.beta", beta, "needs `model.lora` (the KL reference is the adapter-free base)")
        self.save_hyperparameters()
        self.init_model_options()
        self.clip_fraction = MeanMetric()
        self.kl = MeanMetric()
        self.sampler_gap = MeanMetric()
        self.sampler_weight = MeanMetric()

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        hp = self.hparams
        logp = token_logprobs(self.model, batch, hp.temperature)
        mask = batch["completion_mask"][:, 1:]
        ref = None
        if hp.beta > 0:
            with torch.no_grad(), self.model.disable_adapter():
                ref = token_logprobs(self.model, batch, hp.temperature)
        engine = batch["old_logprobs"][:, 1:]
        old = logp.detach() if hp.old_logprobs == "policy" else engine
        weights = sampler_weights(logp, engine, hp.sampler_is_cap) if hp.sampler_is_cap is not None else None
        loss, stats = grpo_loss(logp, old, batch["advantages"], mask, clip_eps=hp.clip_eps,
                                clip_eps_high=hp.clip_eps_high, beta=hp.beta, ref_logprobs=ref, token_weights=weights)
        self.log("train/loss", loss, prog_bar=True)
        # How far the sampler's logprobs sit from the policy's on the same tokens: ~0 when the inference copy
        # and numerics match; bf16 engines and kernels move it (the importance weights correct for it).
        n_tokens = mask.sum().clamp(min=1)
        self.sampler_gap(((logp.detach() - engine).abs() * mask).sum() / n_tokens)
        self.log("train/sampler_logprob_gap", self.sampler_gap, on_step=True, on_epoch=False)
        if weights is not None:
            self.sampler_weight((weights * mask).sum() / n_tokens)
            self.log("train/sampler_is_weight", self.sampler_weight, on_step=True, on_epoch=False)
        self.clip_fraction(stats["clip_fraction"])  # forward: the step value is what on_step logs
        self.log("train/clip_fraction", self.clip_fraction, on_step=True, on_epoch=False)
        if "kl" in stats:
            self.kl(stats["kl"])
            self.log("train/kl", self.kl, on_step=True, on_epoch=False)
        return loss

    def configure_optimizers(self):
        return build_adamw(self.model, self.hparams.learning_rate, weight_decay=0.0, betas=(0.9, 0.999))  # fused on CUDA
