"""GPU memory arithmetic for GRPO on one device: what a config costs before anything is allocated.

Owns the estimate only. Lasting for the whole run:
- `policy`: the policy's weights as stored: every weight at `weight_bytes`, the LoRA adapters in fp32 (peft keeps
  them there), and with `base_dtype="fp8"` the LoRA targets' bases as `fp8_base.quantize_lora_bases` stores them
  (float8 at one byte, fp32 rowwise scales), counted on the meta model it converts;
- `engine_weights`: the rollout engine's own weights (`weights="shared"`, the Callback's default: the engine reads
  the policy's frozen base in place and owns only the LoRA A and B buffers, each fused group's B block-diagonal;
  `weights="merged"`: a second full model, `shared_weights.py`);
- `lora_optimizer`: the adapters' fp32 gradients and two AdamW moments;
- `kv_pool`: the paged KV pools (`EngineConfig.pool_bytes`). The engine keeps them through the update, so they sit
  under the update's peak too.
The update's peak (one micro-batch of at most `max_tokens_per_microbatch` padded tokens, `rl/module.py`):
- `activations`: what every decoder layer keeps for backward, alive together when backward starts. Selective
  checkpointing (`parallel/checkpointing.py`) keeps each layer's input and the outputs of the ops its policy must
  save: the attention forward (o in bf16, lse in fp32) and the matmuls the `high_k` rule saves, asked of the policy
  itself per Linear (a float8 base's `torch._scaled_mm` included). Without checkpointing, `ACTIVATION_BYTES_PER_HIDDEN` per hidden unit per layer. Plus the
  final hidden states and their completion rows, which the chunked log-probs keep;
- `layer_transient`: one layer's working memory during its backward: the recompute re-makes what a layer without
  checkpointing keeps (less what the policy saved), the gradients into and out of the layer, and with a float8 base
  the largest base weight dequantised for the input's gradient (`fp8_base._BaseMatmul.backward`);
- `logprob_chunks`: the chunked log-probs' buffers (`rl/logprobs.py`), one chunk of `logprob_chunk_size` rows
  x vocabulary at `LOGPROB_BYTES_PER_VOCAB` (the loop frees a chunk's buffers before the next one's);
  O(chunk x vocab), never tokens x vocab.
The two transients do not overlap (the log-probs' backward ends before the layers' starts), so `total` counts the
larger. Parameters, KV specs and stored bytes come from the model built on the meta device (no memory, exact
shapes); `tests/rollout/test_memory.py` checks the per-token terms against the bytes autograd and the product's
SAC policy save. MoE expert activations are counted by the same rules with a dense layer's coefficient (`caveats`
says so); the shared engine's expert adapter buffers are counted (`expert_adapter_params`). It does not measure a
run; `benchmarks/results/` holds measured peaks (`benchmarks/grpo_full_depth.py` records this estimate beside
them). Reading a recipe and console overrides into these arguments is `memory_recipe.py`'s.

    python -m lightning_ffpa.rollout.memory --preset gemma4-31b --num_hidden_layers 12 \
        --engine.page_size 128 --engine.num_pages 64 --train_tokens 5120 --max_tokens_per_microbatch 2560
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from lightning_ffpa.errors import ConfigError
from lightning_ffpa.rollout.engine import GIB, EngineConfig
from lightning_ffpa.rollout.fused_linear import GROUPS

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AC_MODES = ("selective", "none")  # `activation_checkpointing` modes the estimate covers
BASE_DTYPES = ("model", "fp8")  # `lora.base_dtype`
ACT_BYTES = 2  # activations in bf16: FSDP2 computes in `param_dtype` bf16
ACTIVATION_BYTES_PER_HIDDEN = 110
"""Bytes autograd saves per token, per decoder layer, per hidden unit for an HF eager Gemma4 layer in bf16
with SDPA attention and no activation checkpointing (the MLP's 4x-wide intermediates dominate)."""
LOGPROB_BYTES_PER_VOCAB = 10
"""Bytes per chunk row per vocabulary entry at the chunked log-probs' backward (`rl/logprobs.py`): the chunk's fp32
logits (4), the softcap's tanh kept for its derivative (4), and d logits cast to bf16 for the two matmuls (2); the
forward holds less."""


@dataclass(frozen=True)
class GRPOMemory:
    """Bytes per component on the one GPU; `total` counts the larger of the two transients (they never overlap)."""

    policy: int
    engine_weights: int
    lora_optimizer: int
    kv_pool: int
    activations: int
    layer_transient: int
    logprob_chunks: int
    caveats: tuple[str, ...] = field(default=(), compare=False)

    def components(self) -> dict[str, int]:
        """{component: bytes}, without the caveats."""
        return {k: v for k, v in asdict(self).items() if k != "caveats"}

    @property
    def total(self) -> int:
        """Every lasting component, the activations and the larger transient."""
        c = self.components()
        transient = max(c.pop("layer_transient"), c.pop("logprob_chunks"))
        return sum(c.values()) + transient

    def table(self) -> str:
        """One line per component in GiB, then the total and any caveat."""
        rows = [f"{k:>15}: {v / GIB:8.1f} GiB" for k, v in self.components().items()]
        notes = [f"{'caveat':>15}: {c}" for c in self.caveats]
        return "\n".join([*rows, f"{'total':>15}: {self.total / GIB:8.1f} GiB  (the larger transient counted)",
                          *notes])


def meta_model(preset: str, **config_overrides) -> nn.Module:
    """The preset's HF causal LM on the meta device: exact shapes, no storage."""
    from transformers import Gemma4ForCausalLM

    from lightning_ffpa.presets import build_text_config

    with torch.device("meta"):
        return Gemma4ForCausalLM(build_text_config(preset, **config_overrides))


def lora_meta_model(preset: str, layers: int | None, lora: dict[str, Any] | None) -> nn.Module:
    """The fit's model on meta: the preset (at `layers` depth), wrapped in peft LoRA by `lora` (the fit's
    `model.lora` options) and, with `base_dtype: fp8`, its LoRA bases converted as `HFModule` stores them."""
    from lightning_ffpa.lora import apply_lora

    model = meta_model(preset, **({} if layers is None else {"num_hidden_layers": layers}))
    if lora:
        model = apply_lora(model, lora)
        if lora.get("base_dtype") == "fp8":
            from lightning_ffpa.fp8_base import quantize_lora_bases

            quantize_lora_bases(model)
    return model


def stored_weight_bytes(model: nn.Module, weight_bytes: int = 2, trainable_bytes: int | None = None) -> int:
    """Bytes of `model`'s weights as stored: a `Float8BaseLinear`'s float8 weight (one byte) and fp32 rowwise scales
    (four) as they are, trainable weights (the LoRA A/B) at `trainable_bytes` (None: `weight_bytes`), every other
    weight at `weight_bytes`; a tied weight once."""
    from lightning_ffpa.fp8_base import Float8BaseLinear

    stored = {id(t) for m in model.modules() if isinstance(m, Float8BaseLinear) for t in (m.weight, m.weight_scale)}
    trainable = weight_bytes if trainable_bytes is None else trainable_bytes
    return sum(p.numel() * (p.element_size() if id(p) in stored else trainable if p.requires_grad else weight_bytes)
               for p in model.parameters())


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


def expert_adapter_params(model: nn.Module, r: int, target_parameters: tuple[str, ...]) -> int:
    """Elements of the `experts.StackAdapter` buffers the shared engine owns for LoRA rank `r` on the adapted expert
    stacks: per stack (E, out, in), E * r' * (in + out) with r' the rank padded for the grouped GEMM."""
    from lightning_ffpa.experts import StackAdapter

    return sum(StackAdapter.elements(p.shape, r) for name, p in model.named_parameters()
               if p.dim() == 3 and any(name.endswith(t) for t in target_parameters))


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


def _policy_saves_matmul(k: int, width: int) -> bool:
    """Whether the product's SAC policy (`sac_policy`, rule `high_k`) saves a matmul reducing over `k` in a layer
    of `width`: asked of the policy itself, with meta operands."""
    from lightning_ffpa.parallel.checkpointing import CheckpointPolicy, _mm_ops, sac_policy

    a, b = torch.empty(1, k, device="meta"), torch.empty(k, 1, device="meta")
    answer = sac_policy({"forward_mm": 0}, frozenset(), frozenset(_mm_ops()), "high_k",
                        SimpleNamespace(is_recompute=False), torch.ops.aten.mm.default, a, b, width=width)
    return answer == CheckpointPolicy.MUST_SAVE


def sac_saved_bytes_per_token(layer: nn.Module, hidden: int, num_heads: int, top_k: int = 0) -> int:
    """Bytes one decoder layer keeps per token under selective checkpointing: its input (checkpoint keeps it), the
    attention forward's outputs (o in bf16, lse in fp32; MUST_SAVE), and every matmul output the policy saves: an
    nn.Linear's (LoRA A and B included), a float8 base's (`torch._scaled_mm` is one of the policy's matmuls) and
    an expert stack's (`top_k` rows per token). `layer_width` is the policy's own."""
    from lightning_ffpa.fp8_base import Float8BaseLinear
    from lightning_ffpa.parallel.checkpointing import layer_width

    width = layer_width(layer)
    q = layer.self_attn.q_proj
    total = hidden * ACT_BYTES + q.out_features * ACT_BYTES + num_heads * 4
    for m in layer.modules():
        if isinstance(m, (nn.Linear, Float8BaseLinear)) and _policy_saves_matmul(m.in_features, width):
            total += m.out_features * ACT_BYTES
    experts = getattr(layer, "experts", None)
    if experts is not None:  # stacks stored (experts, out, in): each routed row reduces over `in`
        for p in experts.parameters():
            if p.dim() == 3 and _policy_saves_matmul(p.shape[2], width):
                total += top_k * p.shape[1] * ACT_BYTES
    return total


def _decoder_layers(model: nn.Module) -> list[nn.Module]:
    from lightning_ffpa.lora import unwrap_peft
    from lightning_ffpa.rollout.walker import _decoder

    return list(_decoder(unwrap_peft(model)).layers)


def _check(option: str, ok: bool, value: Any, why: str) -> None:
    if not ok:
        raise ConfigError(option, value, why)


def estimate(preset: str = "gemma4-31b", num_hidden_layers: int | None = None, lora_r: int = 16,
             weight_bytes: int = 2, inference_bytes: int = 2, engine: EngineConfig | None = None,
             train_tokens: int = 0, weights: str = "shared", max_tokens_per_microbatch: int | None = None,
             logprob_chunk_size: int = 4096, activation_checkpointing: str = "selective",
             base_dtype: str = "model", lora_targets: tuple[str, ...] = LORA_TARGETS,
             lora_target_parameters: tuple[str, ...] = ()) -> GRPOMemory:
    """Estimate one GPU's GRPO memory.

    Args:
        preset: `lightning_ffpa.presets` name.
        num_hidden_layers: Depth override (`model.config_overrides.num_hidden_layers`); None = the preset's.
        lora_r: LoRA rank on every target (0 = full fine-tune, not estimated here: its optimizer is the model).
        weight_bytes: Bytes per policy weight (2 = bf16); the adapters are fp32 whatever it is.
        inference_bytes: Bytes per engine weight (adapter buffers, or the merged copy) and KV element (2 = bf16).
        engine: The rollout engine's page pools (allocated up front: `num_pages * page_size` tokens in the full
            layers, the sliding pool's `EngineConfig.sliding_pages` pages in the sliding ones).
        train_tokens: Padded tokens of one GRPO training batch (prompts x num_generations x longest row); 0 = no update.
        weights: `RolloutCallback.weights`: "shared" (the engine owns the adapter buffers) or "merged" (a full copy).
        max_tokens_per_microbatch: `model.max_tokens_per_microbatch`: padded tokens per forward (null: the batch).
        logprob_chunk_size: `model.logprob_chunk_size`: tokens per chunk of the log-probs through the lm_head.
        activation_checkpointing: The strategy's mode: "selective" (the recipe's) or "none".
        base_dtype: `model.lora.base_dtype`: "model" (bases at weight_bytes) or "fp8" (float8 bases, fp32 scales).
        lora_targets: `model.lora.target_modules`: Linear name suffixes.
        lora_target_parameters: `model.lora.target_parameters`: MoE expert stacks (e.g. experts.gate_up_proj).
    """
    _check("weights", weights in ("shared", "merged"), weights, "must be 'shared' or 'merged'")
    _check("lora_r", lora_r > 0, lora_r, "must be > 0: this estimate covers LoRA (adapter-only optimizer state)")
    _check("activation_checkpointing", activation_checkpointing in AC_MODES, activation_checkpointing,
           f"must be one of {', '.join(AC_MODES)}")
    _check("base_dtype", base_dtype in BASE_DTYPES, base_dtype, f"must be one of {', '.join(BASE_DTYPES)}")
    _check("train_tokens", train_tokens >= 0, train_tokens, "must be >= 0")
    _check("max_tokens_per_microbatch", max_tokens_per_microbatch is None or max_tokens_per_microbatch >= 1,
           max_tokens_per_microbatch, "must be >= 1 or null (one forward over the batch)")
    _check("logprob_chunk_size", logprob_chunk_size >= 1, logprob_chunk_size, "must be >= 1")
    engine = engine or EngineConfig()
    overrides = {} if num_hidden_layers is None else {"num_hidden_layers": num_hidden_layers}
    model = meta_model(preset, **overrides)
    lora = {"r": lora_r, "target_modules": list(lora_targets),
            **({"target_parameters": list(lora_target_parameters)} if lora_target_parameters else {}),
            **({"base_dtype": "fp8"} if base_dtype == "fp8" else {})}
    if base_dtype == "fp8" or lora_target_parameters:  # count the converted model as HFModule stores it
        peft = lora_meta_model(preset, num_hidden_layers, lora)
        adapters = sum(p.numel() for p in peft.parameters() if p.requires_grad)
        policy = stored_weight_bytes(peft, weight_bytes, trainable_bytes=4)
    else:
        adapters = lora_params(model, lora_r, lora_targets)
        policy = sum(p.numel() for p in model.parameters()) * weight_bytes + adapters * 4  # tied embedding once
    caveats = []
    if any(getattr(layer, "experts", None) is not None for layer in _decoder_layers(model)):
        caveats.append("MoE: the recompute counts a dense layer's no-checkpoint bytes (experts' not measured)")
    act, transient, chunks = _update_terms(preset, model, lora, train_tokens, max_tokens_per_microbatch,
                                           logprob_chunk_size, activation_checkpointing)
    return GRPOMemory(
        policy=policy,
        engine_weights=(sum(p.numel() for p in model.parameters()) if weights == "merged"
                        else shared_adapter_params(model, lora_r, lora_targets)
                        + expert_adapter_params(model, lora_r, lora_target_parameters)) * inference_bytes,
        lora_optimizer=adapters * 4 * 3,  # gradient + AdamW exp_avg + exp_avg_sq, fp32
        kv_pool=kv_pool_bytes(model, engine, inference_bytes),
        activations=act, layer_transient=transient, logprob_chunks=chunks, caveats=tuple(caveats))


def _update_terms(preset: str, model: nn.Module, lora: dict[str, Any], train_tokens: int, budget: int | None, chunk: int,
                  mode: str) -> tuple[int, int, int]:
    """(activations, layer_transient, logprob_chunks) of the update's largest micro-batch."""
    tokens = train_tokens if budget is None else min(train_tokens, budget)  # padded tokens of one forward
    if tokens == 0:
        return 0, 0, 0
    cfg = model.config
    hidden, types = cfg.hidden_size, list(cfg.layer_types)
    kept = 3 * tokens * hidden * ACT_BYTES  # the last layer's output, the final norm's, the completion rows' copy
    chunks = min(chunk, tokens) * cfg.vocab_size * LOGPROB_BYTES_PER_VOCAB  # scored rows <= the micro-batch's tokens
    grads = 2 * tokens * hidden * ACT_BYTES  # the gradient into a layer's output and out of its input
    no_ac = ACTIVATION_BYTES_PER_HIDDEN * hidden  # per token per layer
    per_type, dequant = slice_terms(preset, cfg, lora)
    if mode == "none":
        return len(types) * no_ac * tokens + kept, grads + dequant, chunks
    saved = sum(per_type[t] for t in types) * tokens
    recompute = max(max(no_ac - b, 0) for b in per_type.values()) * tokens
    return saved + kept, recompute + grads + dequant, chunks


def slice_terms(preset: str, cfg: Any, lora: dict[str, Any] | None) -> tuple[dict[str, int], int]:
    """Per layer type of `cfg` (the preset's config), the bytes SAC keeps per token, counted on a meta model of one
    layer of each type with the fit's LoRA (and float8 bases); and the largest float8 base weight's bytes
    dequantised to bf16 (0 without)."""
    from lightning_ffpa.fp8_base import Float8BaseLinear
    from lightning_ffpa.lora import apply_lora

    kinds = sorted(set(cfg.layer_types), key=lambda t: (t == "full_attention", t))  # HF wants a full layer last
    sl = meta_model(preset, num_hidden_layers=len(kinds), layer_types=kinds)
    sl = apply_lora(sl, lora) if lora else sl
    if lora and lora.get("base_dtype") == "fp8":
        from lightning_ffpa.fp8_base import quantize_lora_bases

        quantize_lora_bases(sl)
    top_k = getattr(cfg, "top_k_experts", None) or 0
    per_type = {kind: sac_saved_bytes_per_token(layer, cfg.hidden_size, cfg.num_attention_heads, top_k)
                for kind, layer in zip(kinds, _decoder_layers(sl))}
    dequant = max((m.in_features * m.out_features for m in sl.modules() if isinstance(m, Float8BaseLinear)),
                  default=0) * ACT_BYTES
    return per_type, dequant


def main(argv: list[str] | None = None) -> GRPOMemory:
    """Print the estimate's table for command-line arguments (jsonargparse over `estimate`)."""
    from jsonargparse import CLI

    result = CLI(estimate, args=argv)
    print(result.table())
    return result


if __name__ == "__main__":
    main()
