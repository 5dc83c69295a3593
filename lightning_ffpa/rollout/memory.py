"""GPU memory arithmetic for GRPO on one device: what a config costs before anything is allocated.

Owns the estimate only: the policy's weights, the rollout engine's own weights (`weights="shared"`, the
Callback's default: the engine reads the policy's frozen base in place, so it owns only the LoRA A and B
buffers, with each fused group's B laid out block-diagonally; `weights="merged"`: a second full model with
W0 + s*B@A written in, `shared_weights.py`), the LoRA optimizer state (fp32 adapters, gradients and two AdamW
moments), the paged KV pools (the full layers' grows with `num_pages`; the sliding layers' own pool is
sized by their window, `EngineConfig.sliding_pages`), and a rough bound for one training step's activations. Parameters and KV
specs come from the model built on the meta device (no memory, exact shapes); the activation terms
are per-token rules of thumb whose coefficients `tests/rollout/test_memory.py` checks by counting the
tensors autograd saves. It does not measure a run; `benchmarks/results/` holds measured peaks.

    python -m lightning_ffpa.rollout.memory --preset gemma4-31b --num_hidden_layers 12 \
        --engine.page_size 128 --engine.num_pages 64 --train_tokens 5120
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn

from lightning_ffpa.rollout.engine import GIB, EngineConfig
from lightning_ffpa.rollout.fused_linear import GROUPS

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ACTIVATION_BYTES_PER_HIDDEN = 110
"""Bytes autograd saves per token, per decoder layer, per hidden unit for an HF eager Gemma4 layer in bf16
with SDPA attention and no activation checkpointing (the MLP's 4x-wide intermediates dominate)."""
LOGITS_BYTES_PER_VOCAB = 30
"""Bytes per token per vocabulary entry at the loss: bf16 logits and the softcap's saved tensors, the fp32
log-softmax the policy keeps for backward with its transient upcast and gradient, and the KL reference's
no-grad pass alive at the same time."""


@dataclass(frozen=True)
class GRPOMemory:
    """Bytes per component on the one GPU."""

    policy: int
    engine_weights: int
    lora_optimizer: int
    kv_pool: int
    activations: int
    logits: int

    @property
    def total(self) -> int:
        """Sum of every component."""
        return sum(asdict(self).values())

    def table(self) -> str:
        """One line per component in GiB, then the total."""
        rows = [f"{k:>15}: {v / GIB:8.1f} GiB" for k, v in asdict(self).items()]
        return "\n".join([*rows, f"{'total':>15}: {self.total / GIB:8.1f} GiB"])


def meta_model(preset: str, **config_overrides) -> nn.Module:
    """The preset's HF causal LM on the meta device: exact shapes, no storage."""
    from transformers import Gemma4ForCausalLM

    from lightning_ffpa.presets import build_text_config

    with torch.device("meta"):
        return Gemma4ForCausalLM(build_text_config(preset, **config_overrides))


def lora_params(model: nn.Module, r: int, targets: tuple[str, ...] = LORA_TARGETS) -> int:
    """Parameters peft LoRA adds: r * (in + out) for every nn.Linear whose name ends in a target."""
    return sum(r * (m.in_features + m.out_features) for name, m in model.named_modules()
               if isinstance(m, nn.Linear) and name.rsplit(".", 1)[-1] in targets)


def shared_adapter_params(model: nn.Module, r: int, targets: tuple[str, ...] = LORA_TARGETS) -> int:
    """Elements of the A and B buffers the shared engine owns for LoRA rank `r` on every target: per fused group
    (q/k/v, gate/up) R*in + out_total*R with R = r * members (B block-diagonal), r * (in + out) for the rest."""
    from lightning_ffpa.rollout.walker import _decoder

    total, grouped = 0, set()
    for layer in _decoder(model).layers:
        for parent_name, names in GROUPS:
            parent = getattr(layer, parent_name, None)
            members = [getattr(parent, n, None) for n in names if n in targets]
            members = [m for m in members if isinstance(m, nn.Linear)]
            if len(members) >= 2:
                rank, out = r * len(members), sum(m.out_features for m in members)
                total += rank * members[0].in_features + out * rank
                grouped.update(id(m) for m in members)
    return total + sum(r * (m.in_features + m.out_features) for name, m in model.named_modules()
                       if isinstance(m, nn.Linear) and id(m) not in grouped and name.rsplit(".", 1)[-1] in targets)


def kv_bytes_per_token(model: nn.Module, dtype_bytes: int) -> int:
    """K+V bytes one cached token costs over every caching layer (what `PagedKVCache` allocates per slot)."""
    from lightning_ffpa.rollout.kv_cache import token_bytes
    from lightning_ffpa.rollout.walker import DecoderWalker

    return token_bytes(DecoderWalker(model).specs, dtype_bytes)


def kv_pool_bytes(model: nn.Module, engine: EngineConfig, dtype_bytes: int) -> int:
    """Bytes of the engine's KV pools for this model (what `PagedKVCache` allocates): `num_pages` pages in the
    full layers, the sliding pool's pages (a few windows' worth, not the sequences' length) in the sliding ones."""
    from lightning_ffpa.rollout.walker import DecoderWalker

    return engine.pool_bytes(DecoderWalker(model).specs, dtype_bytes)


def estimate(preset: str = "gemma4-31b", num_hidden_layers: int | None = None, lora_r: int = 16,
             weight_bytes: int = 2, inference_bytes: int = 2, engine: EngineConfig | None = None,
             train_tokens: int = 0, kl: bool = True, weights: str = "shared") -> GRPOMemory:
    """Estimate one GPU's GRPO memory.

    Args:
        preset: `lightning_ffpa.presets` name.
        num_hidden_layers: Depth override (`model.config_overrides.num_hidden_layers`); None = the preset's.
        lora_r: LoRA rank on every projection (0 = full fine-tune, not estimated here: its optimizer is the model).
        weight_bytes: Bytes per policy weight (2 = bf16).
        inference_bytes: Bytes per engine weight (adapter buffers, or the merged copy) and KV element (2 = bf16).
        engine: The rollout engine's page pools (allocated up front: `num_pages * page_size` tokens in the full
            layers, the sliding pool's `EngineConfig.sliding_pages` pages in the sliding ones).
        train_tokens: Tokens in one GRPO training batch (prompts x num_generations x (prompt + completion)).
        kl: Whether the KL reference pass (beta > 0) runs in the training step.
        weights: `RolloutCallback.weights`: "shared" (the engine owns the adapter buffers) or "merged" (a full copy).
    """
    if weights not in ("shared", "merged"):
        raise ValueError(f"`weights={weights!r}` must be 'shared' or 'merged'")
    if lora_r <= 0:
        raise ValueError("`lora_r` must be > 0: this estimate covers LoRA (adapter-only optimizer state)")
    engine = engine or EngineConfig()
    overrides = {} if num_hidden_layers is None else {"num_hidden_layers": num_hidden_layers}
    model = meta_model(preset, **overrides)
    cfg = model.config
    params = sum(p.numel() for p in model.parameters())  # tied embeddings counted once
    adapters = lora_params(model, lora_r)
    logits_per_token = LOGITS_BYTES_PER_VOCAB if kl else LOGITS_BYTES_PER_VOCAB - 10
    return GRPOMemory(
        policy=params * weight_bytes + adapters * 4,
        engine_weights=(params if weights == "merged" else shared_adapter_params(model, lora_r)) * inference_bytes,
        lora_optimizer=adapters * 4 * 3,  # gradient + AdamW exp_avg + exp_avg_sq, fp32
        kv_pool=kv_pool_bytes(model, engine, inference_bytes),
        activations=train_tokens * cfg.num_hidden_layers * cfg.hidden_size * ACTIVATION_BYTES_PER_HIDDEN,
        logits=train_tokens * cfg.vocab_size * logits_per_token,
    )


def main(argv: list[str] | None = None) -> GRPOMemory:
    """Print the estimate's table for command-line arguments (jsonargparse over `estimate`)."""
    from jsonargparse import CLI

    result = CLI(estimate, args=argv)
    print(result.table())
    return result


if __name__ == "__main__":
    main()
