"""The Gemma4 LightningModule: build or load the HF model, the causal-LM loss, metrics, optimizer.

It owns model construction (pretrained or preset), the loss and the optimizer. It does not own sharding
(`lightning_ffpa.parallel`), attention kernels (`lightning_ffpa.attention`) or data (`lightning_ffpa.data`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import lightning as L
import torch
from torch import nn
from transformers import (
    AutoConfig,
    Gemma4Config,
    Gemma4ForCausalLM,
    Gemma4ForConditionalGeneration,
    PretrainedConfig,
    PreTrainedModel,
)
from transformers.optimization import get_cosine_with_min_lr_schedule_with_warmup

from lightning_ffpa._compat.transformers import attention_names, from_config, text_config
from lightning_ffpa.cp import cp_group_info, cp_loss_reduce, shard_batch
from lightning_ffpa.loss import linear_cross_entropy
from lightning_ffpa.metrics import TokenPerplexity
from lightning_ffpa.parallel.fsdp import causal_lm_hidden_states
from lightning_ffpa.presets import build_text_config

# HF names plus ours; anything else registered in transformers' AttentionInterface is accepted too.
KNOWN_ATTN = ("sdpa", "eager", "flex_attention", "ffpa")
_MODEL_CLASSES = {"causal_lm": Gemma4ForCausalLM, "conditional_generation": Gemma4ForConditionalGeneration}


def _registered_attn() -> set[str]:
    return set(KNOWN_ATTN) | attention_names()


def resolve_dtype(dtype: str) -> torch.dtype:
    """'auto' is bf16 where the device supports it (CUDA with bf16), else fp32."""
    if dtype == "auto":
        bf16 = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
        return torch.bfloat16 if bf16 else torch.float32
    return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[dtype]


def build_adamw(model: nn.Module, lr: float, weight_decay: float = 0.1,
                betas: tuple[float, float] = (0.9, 0.95)) -> torch.optim.AdamW:
    """The product's AdamW: no decay on norms and biases; the fused kernel when every parameter is on CUDA.

    Why fused: torch picks the foreach implementation by default, whose step allocates a parameter-sized
    temporary (`_foreach_sqrt(exp_avg_sq)`) and makes ~7 passes over params/grads/states. With fp32
    master weights that temporary is 4 bytes/param: on the 4.3B-param benchmark slice it *is* the step's
    peak (16 GiB above params + grads + Adam states). The fused kernel updates each element in one pass
    with no temporary, and DTensor (FSDP2) parameters support it. Elsewhere (CPU offload, CPU tests)
    torch's default stays.
    """
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if p.ndim < 2 or "norm" in name else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    on_cuda = bool(decay or no_decay) and all(p.is_cuda for p in (*decay, *no_decay))
    return torch.optim.AdamW(groups, lr=lr, betas=betas, fused=True if on_cuda else None)


class Gemma4LM(L.LightningModule):
    """Causal-LM training of Hugging Face Gemma4 (dense or MoE), from a checkpoint or a config preset."""

    def __init__(
        self,
        pretrained: str | None = None,
        preset: str = "tiny",
        config_overrides: dict[str, Any] | None = None,
        model_class: Literal["causal_lm", "conditional_generation"] = "causal_lm",
        attn_implementation: str = "sdpa",
        dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto",
        lora: dict[str, Any] | None = None,
        learning_rate: float = 3e-4,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: int = 100,
        min_lr_ratio: float = 0.1,
        loss_impl: Literal["plain", "chunked", "liger"] = "plain",
        loss_chunk_size: int = 4096,
        max_seq_length: int | None = None,
    ) -> None:
        """Build the module; the HF model itself is created in `configure_model`.

        Args:
            pretrained: local path or hub id passed to `from_pretrained`; None builds from `preset`.
            preset: config preset when `pretrained` is None: tiny, tiny-moe, gemma4-31b, gemma4-26b-a4b.
            config_overrides: text-config fields to override (e.g. `{num_hidden_layers: 6}`).
            model_class: `causal_lm` (Gemma4ForCausalLM) or `conditional_generation` (Gemma4ForConditionalGeneration).
            attn_implementation: sdpa, eager, flex_attention or ffpa (any name registered with transformers).
            dtype: parameter dtype; `auto` is bf16 on GPUs that support it, else fp32.
            lora: peft `LoraConfig` fields (e.g. `{r: 16, lora_alpha: 32, target_modules: [q_proj, v_proj]}`); None trains all weights.
            learning_rate: peak AdamW learning rate.
            weight_decay: AdamW weight decay (not applied to norms and biases).
            betas: AdamW betas.
            warmup_steps: linear warmup steps before the cosine decay.
            min_lr_ratio: final learning rate as a fraction of the peak.
            loss_impl: `plain` (full logits), `chunked` (never materialises fp32 logits) or `liger` (liger-kernel).
            loss_chunk_size: tokens per chunk for the chunked loss.
            max_seq_length: longest sequence the data will feed; checked against `max_position_embeddings`.
        """
        super().__init__()
        self.save_hyperparameters()
        if attn_implementation not in _registered_attn():
            raise ValueError(
                f"model.attn_implementation={attn_implementation!r} is unknown; "
                f"choose one of {sorted(_registered_attn())}"
            )
        self.config = self._load_config()
        self._check_seq_length(max_seq_length, "model.max_seq_length")
        self.model: PreTrainedModel | None = None
        self.train_ppl = TokenPerplexity()
        self.val_ppl = TokenPerplexity()

    # ---- model construction -------------------------------------------------------------------------
    def _load_config(self) -> PretrainedConfig:
        hp = self.hparams
        overrides = dict(hp.config_overrides or {})
        if hp.pretrained is None:
            cfg = build_text_config(hp.preset, **overrides)
            if hp.model_class == "conditional_generation":
                cfg = Gemma4Config(text_config=cfg.to_dict(), vision_config=None, audio_config=None)
            return cfg
        local = Path(hp.pretrained).expanduser()
        if not local.exists() and (hp.pretrained.startswith((".", "/", "~")) or os.environ.get("HF_HUB_OFFLINE")):
            raise FileNotFoundError(f"model.pretrained={hp.pretrained!r}: no such directory")
        try:
            cfg = AutoConfig.from_pretrained(hp.pretrained, **overrides)
        except OSError as err:
            raise FileNotFoundError(f"model.pretrained={hp.pretrained!r} could not be loaded: {err}") from err
        return cfg

    def _check_seq_length(self, seq_len: int | None, option: str) -> None:
        limit = getattr(text_config(self.config), "max_position_embeddings", None)
        if seq_len is not None and limit is not None and seq_len > limit:
            raise ValueError(f"{option}={seq_len} exceeds the model's max_position_embeddings={limit}")

    @property
    def shards_model(self) -> bool:
        """True under FSDP2Strategy, which shards, materialises and loads weights; the model is built on meta.

        Other strategies get a fully built model (Lightning's FSDP wraps it as is).
        """
        if self._trainer is None:
            return False
        from lightning_ffpa.parallel import FSDP2Strategy

        return isinstance(self.trainer.strategy, FSDP2Strategy)

    def build_model(self, device: torch.device | str | None = None) -> PreTrainedModel:
        """Create the HF model (weights loaded or randomly initialised) with the configured attention."""
        hp = self.hparams
        dtype = resolve_dtype(hp.dtype)
        cls = _MODEL_CLASSES[hp.model_class]
        attn = "sdpa" if hp.attn_implementation == "ffpa" else hp.attn_implementation
        if hp.pretrained is not None and device != "meta":
            model = cls.from_pretrained(hp.pretrained, config=self.config, dtype=dtype, attn_implementation=attn)
        else:
            with torch.device(device or "cpu"):
                model = from_config(cls, self.config, dtype=dtype, attn_implementation=attn)
        if hp.attn_implementation == "ffpa":
            from lightning_ffpa.attention import register_ffpa

            register_ffpa()
            model.set_attn_implementation("ffpa")
        if hp.lora:
            model = self._apply_lora(model)
        return model

    def _apply_lora(self, model: PreTrainedModel) -> nn.Module:
        from peft import LoraConfig, get_peft_model

        spec = dict(self.hparams.lora)
        spec.setdefault("task_type", "CAUSAL_LM")
        try:
            return get_peft_model(model, LoraConfig(**spec))
        except ValueError as err:
            raise ValueError(f"model.lora.target_modules={spec.get('target_modules')!r}: {err}") from err

    def configure_model(self) -> None:
        if self.model is not None:
            return
        if self.shards_model:
            # Sharded: build on meta; the strategy shards, materialises and initialises (parallel/).
            self.model = self.build_model(device="meta")
            self._needs_weight_init = True
        else:
            self.model = self.build_model()
        self.model.config.use_cache = False

    def load_sharded_weights(self) -> None:
        """Fill the sharded, materialised model from `pretrained` (called by FSDP2Strategy after sharding).

        Rank 0 reads the checkpoint through `from_pretrained` (so HF's key mapping applies) and broadcasts;
        each rank keeps only its shards.
        """
        if self.hparams.pretrained is None or not getattr(self, "_needs_weight_init", False):
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        full: dict[str, torch.Tensor] = {}
        if self.global_rank == 0:
            cls = _MODEL_CLASSES[self.hparams.model_class]
            ref = cls.from_pretrained(self.hparams.pretrained, config=self.config, dtype=resolve_dtype(self.hparams.dtype))
            full = ref.state_dict()
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
        set_model_state_dict(self.hf_model, full, options=options)
        self._needs_weight_init = False

    def setup(self, stage: str) -> None:
        dm = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        seq = getattr(dm, "max_seq_length", None)
        self._check_seq_length(seq, "data.max_seq_length")

    # ---- forward and loss -----------------------------------------------------------------------------
    @property
    def hf_model(self) -> PreTrainedModel:
        """The underlying HF model (peft wrapper removed)."""
        model = self.model
        return model.get_base_model() if hasattr(model, "get_base_model") else model

    def forward(self, input_ids: torch.Tensor, **kwargs: Any) -> Any:
        return self.model(input_ids=input_ids, **kwargs)

    def context_parallel(self) -> tuple[Any, int, int] | None:
        """(group, rank, size) of the context-parallel mesh dim when CP > 1, else None."""
        mesh = self.device_mesh if self._trainer is not None else None
        if mesh is None or "context_parallel" not in (mesh.mesh_dim_names or ()):
            return None
        cp_mesh = mesh["context_parallel"]
        return cp_group_info(cp_mesh) if cp_mesh.size() > 1 else None

    def compute_loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean next-token loss over labels != -100 (global over the CP group), and the local token count."""
        cp = self.context_parallel()
        if cp is not None:
            # Every CP rank holds the same full batch; each keeps its head-tail shard (the ring needs the layout).
            group, rank, size = cp
            shard = shard_batch(batch, rank, size)
            inputs = {k: shard[k] for k in ("input_ids", "position_ids", "ring_layout")}
            labels = shard["shift_labels"]
        else:
            inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids") if k in batch}
            labels = batch["labels"]
            # Shift by appending an ignored target, so both paths score position i against token i+1.
            labels = torch.cat([labels[:, 1:], labels.new_full((labels.shape[0], 1), -100)], dim=1)
        n_tokens = (labels != -100).sum()
        nll_sum = self._nll_sum(inputs, labels, n_tokens)
        if cp is not None:
            return cp_loss_reduce(nll_sum, n_tokens, group), n_tokens
        return nll_sum / n_tokens.clamp(min=1), n_tokens

    def _nll_sum(self, inputs: dict[str, Any], labels: torch.Tensor, n_tokens: torch.Tensor) -> torch.Tensor:
        if self.hparams.loss_impl == "plain":
            logits = self.model(use_cache=False, **inputs).logits  # HF applies the final softcap
            return nn.functional.cross_entropy(
                logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100, reduction="sum"
            )
        # Pass the module given to `parallelize` (the FSDP root), so its hooks gather lm_head too.
        hidden = causal_lm_hidden_states(self.model, use_cache=False, **inputs)
        mean = linear_cross_entropy(
            hidden.flatten(0, 1), self.hf_model.get_output_embeddings().weight, labels.flatten(),
            softcap=getattr(text_config(self.config), "final_logit_softcapping", None),
            chunk_size=self.hparams.loss_chunk_size, impl=self.hparams.loss_impl,
        )
        return mean * n_tokens

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss, n_tokens = self.compute_loss(batch)
        self.train_ppl.update(loss.detach(), n_tokens)
        self.log("train/loss", loss, prog_bar=True, batch_size=batch["input_ids"].shape[0])
        self.log("train/ppl", self.train_ppl, on_step=True, on_epoch=False)
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        loss, n_tokens = self.compute_loss(batch)
        self.val_ppl.update(loss, n_tokens)
        self.log("val/loss", loss, prog_bar=True, sync_dist=True, batch_size=batch["input_ids"].shape[0])
        self.log("val/ppl", self.val_ppl, on_epoch=True)

    def test_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        loss, _ = self.compute_loss(batch)
        self.log("test/loss", loss, sync_dist=True, batch_size=batch["input_ids"].shape[0])

    def predict_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        inputs = {k: batch[k] for k in ("attention_mask", "position_ids") if k in batch}
        return self.model(input_ids=batch["input_ids"], use_cache=False, **inputs).logits.argmax(-1)

    # ---- optimizer ------------------------------------------------------------------------------------
    def configure_optimizers(self) -> dict[str, Any]:
        hp = self.hparams
        opt = build_adamw(self.model, lr=hp.learning_rate, weight_decay=hp.weight_decay, betas=tuple(hp.betas))
        total = max(int(self.trainer.estimated_stepping_batches), hp.warmup_steps + 1)
        sched = get_cosine_with_min_lr_schedule_with_warmup(
            opt, num_warmup_steps=hp.warmup_steps, num_training_steps=total, min_lr_rate=hp.min_lr_ratio
        )
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
