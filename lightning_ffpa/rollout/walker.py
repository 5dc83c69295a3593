"""Layer walker: runs an HF causal-LM decoder (Gemma4, Llama, Qwen2/3, ...) layer by layer for rollouts.

Owns the forward order (embed, per-layer inputs, RoPE, decoder layers, norm, head, final softcap) and
the per-layer facts the cache needs (`LayerSpec`). Attention itself is HF's module calling our
registered paged attention function; this file does not know about pages or masks. After `fuse()`
the projections that read one input run as one GEMM while the engine runs (`fused_linear.py`). Under
torch.compile the RoPE tables go through the custom op `lightning_ffpa::rope_table`, so they are computed
once per step, not once per layer.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from lightning_ffpa._compat import transformers as hf_compat
from lightning_ffpa.rollout.attention import ATTENTION_NAME, StepContext
from lightning_ffpa.rollout.fused_linear import fuse_projections, serving
from lightning_ffpa.rollout.kv_cache import LayerSpec, PagedKVCache


@torch.library.custom_op("lightning_ffpa::rope_table", mutates_args=())
def rope_table(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's RoPE cos/sin, materialized once: opaque to inductor, which would otherwise inline their
    fp32 cos/sin math into every layer's query and key norm + RoPE kernel (docs/performance.md)."""
    return cos.clone(), sin.clone()


@rope_table.register_fake
def _(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(cos), torch.empty_like(sin)


def _rope(rotary: nn.Module, hidden: torch.Tensor, position_ids: torch.Tensor, *layer_type: str):
    cos, sin = rotary(hidden, position_ids, *layer_type)
    return rope_table(cos, sin) if torch.compiler.is_compiling() else (cos, sin)


def _decoder(model: nn.Module) -> nn.Module:
    base = getattr(model, "model", None)
    if base is None or not hasattr(base, "layers") or not hasattr(base, "embed_tokens"):
        raise TypeError(f"{type(model).__name__} is not an HF *ForCausalLM with `.model.layers`; the rollout "
                        "engine walks decoder layers and needs that shape")
    return base


class DecoderWalker:
    """Forward of an HF decoder over explicit positions with a paged cache."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.base = _decoder(model)
        self.config = model.config
        n = len(self.base.layers)
        self.layer_types = list(getattr(self.config, "layer_types", None) or ["full_attention"] * n)
        # First-appearance order, not a set's: the traced step (and inductor's cache key) must not depend on
        # the process's string hashing.
        self.rope_types = list(dict.fromkeys(self.layer_types))
        self.softcap = getattr(self.config, "final_logit_softcapping", None)
        self.per_layer_dim = getattr(self.base, "hidden_size_per_layer_input", 0) or 0
        self.rotary_by_type = hf_compat.rotary_takes_layer_type(self.base.rotary_emb)
        params = hf_compat.decoder_layer_params(self.base.layers[0])
        self._cache_kw = hf_compat.cache_kwarg(params)
        self._shared_kw = "shared_kv_states" in params
        self._per_layer_kw = "per_layer_input" in params
        self.specs = [self._spec(layer) for layer in self.base.layers]
        self.groups: list = []
        self.unfused: list[str] = []

    def fuse(self) -> None:
        """Fuse the projections that read one input (`fused_linear.py`); they serve fused inside
        `paged_attention()` only."""
        self.groups, self.unfused = fuse_projections(self.base.layers)

    @property
    def projection_path(self) -> str:
        """What the projections run as: "fused (N groups)", with how many were left separate and why."""
        if not self.groups and not self.unfused:
            return "separate"
        path = f"fused ({len(self.groups)} groups)"
        if self.unfused:
            path += f"; {len(self.unfused)} separate, first: {self.unfused[0]}"
        return path

    @staticmethod
    def _spec(layer: nn.Module) -> LayerSpec:
        attn = layer.self_attn
        window = getattr(attn, "sliding_window", None)
        if getattr(attn, "is_kv_shared_layer", False):
            return LayerSpec(0, attn.head_dim, window, shared=True)
        return LayerSpec(attn.k_proj.out_features // attn.head_dim, attn.head_dim, window)

    @property
    def windows(self) -> set[int | None]:
        """Distinct sliding windows over all layers (None = full attention)."""
        return {s.window for s in self.specs}

    @contextmanager
    def paged_attention(self):
        """Route the model's attention modules to the paged flex function, and serve fused projections, while
        inside."""
        cfg = self.config
        saved = hf_compat.config_attn_implementation(cfg)
        hf_compat.set_config_attn_implementation(cfg, ATTENTION_NAME)
        try:
            with serving(self.groups):
                yield
        finally:
            hf_compat.set_config_attn_implementation(cfg, saved)

    def logits(self, input_ids: torch.Tensor, position_ids: torch.Tensor, ctx: StepContext,
               cache: PagedKVCache, logits_index: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (N, V) in fp32 for `input_ids` (B, S), keeping rows `logits_index` of the flat (B*S).

        Call inside `paged_attention()`; it sets no Python state, so a compiled decode step traces it whole.
        """
        hidden = self.base.embed_tokens(input_ids)  # (B, S, hidden); Gemma scales inside
        per_layer = None
        if self.per_layer_dim:
            per_layer = self.base.get_per_layer_inputs(input_ids, hidden)
            per_layer = self.base.project_per_layer_inputs(hidden, per_layer)
        if self.rotary_by_type:
            rope = {t: _rope(self.base.rotary_emb, hidden, position_ids, t) for t in self.rope_types}
        else:
            shared_rope = _rope(self.base.rotary_emb, hidden, position_ids)
            rope = {t: shared_rope for t in self.rope_types}
        shared: dict = {}
        for i, layer in enumerate(self.base.layers):
            kw = {"position_embeddings": rope[self.layer_types[i]], "attention_mask": ctx,
                  "position_ids": position_ids, self._cache_kw: cache}
            if self._shared_kw:
                kw["shared_kv_states"] = shared
            if self._per_layer_kw:
                kw["per_layer_input"] = per_layer[:, :, i, :] if per_layer is not None else None
            out = layer(hidden, **kw)
            hidden = out[0] if isinstance(out, tuple) else out
        hidden = self.base.norm(hidden)
        hidden = hidden.reshape(-1, hidden.shape[-1])  # (B*S, hidden)
        if logits_index is not None:
            hidden = hidden[logits_index]
        logits = self.model.lm_head(hidden).float()  # (N, V)
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits
