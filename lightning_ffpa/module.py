"""The Gemma4 LightningModule: the causal-LM loss, metrics and optimizer around the shared model options.

It owns the training objective (plain, chunked or liger loss; CP sharding of the batch) and the optimizer.
Model construction and the shared model options live in `hf_module.py` (also used by `GRPOModule`); it
does not own sharding (`lightning_ffpa.parallel`), attention kernels (`lightning_ffpa.attention`) or data
(`lightning_ffpa.data`).
"""

from __future__ import annotations

import importlib.util
from typing import Any, Literal

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn

from lightning_ffpa._compat import lightning as lightning_compat
from lightning_ffpa.attention.documents import packed_inputs
from lightning_ffpa.cp import cp_group_info, cp_loss_reduce, shard_batch
from lightning_ffpa.dtypes import DtypeOrAuto
from lightning_ffpa.errors import ConfigError, data_option
from lightning_ffpa.hf_module import (  # noqa: F401 - re-exported: `from lightning_ffpa.module import resolve_dtype`
    _MODEL_CLASSES,
    HFModule,
    check_data_fits_model,
    resolve_dtype,
    text_config,
)
from lightning_ffpa.hidden_states import causal_lm_hidden_states, head_operands
from lightning_ffpa.lora import LoraSpec, lora_hparam
from lightning_ffpa.loss import IGNORE_INDEX, linear_cross_entropy
from lightning_ffpa.metrics import TokenMeanLoss, TokenPerplexity, total_grad_norm
from lightning_ffpa.parallel.dims import ParallelDims
from lightning_ffpa.token_weights import TokenWeights

DEFAULT_LOSS_CHUNK = 4096
SCHEDULE_KEY = "lightning_ffpa_lr_schedule_steps"  # the horizon the run's cosine was built for


def check_range(option: str, value: float, *, gt: float | None = None, ge: float | None = None,
                le: float | None = None) -> None:
    """Raise ConfigError naming `option` unless `value` is within the given bounds."""
    if gt is not None and not value > gt:
        raise ConfigError(option, value, f"must be > {gt}")
    if ge is not None and not value >= ge:
        raise ConfigError(option, value, f"must be >= {ge}")
    if le is not None and not value <= le:
        raise ConfigError(option, value, f"must be <= {le}")


def build_adamw(model: nn.Module, lr: float, weight_decay: float = 0.1,
                betas: tuple[float, float] = (0.9, 0.95)) -> torch.optim.AdamW:
    """The product's AdamW: no decay on norms and biases; the fused kernel when every parameter is on CUDA.

    Why fused: torch picks the foreach implementation by default, whose step allocates a parameter-sized
    temporary (`_foreach_sqrt(exp_avg_sq)`) and makes ~7 passes over params/grads/states. With fp32
    master weights that temporary is 4 bytes/param: on the benchmark slice it *is* the step's peak
    (benchmarks/results/train_throughput_memory.json, `peak_above_start_gb`). The fused kernel updates each element in one pass
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


class Gemma4LM(HFModule):
    """Causal-LM training of Hugging Face Gemma4 (dense or MoE), from a checkpoint or a config preset."""

    # options a resume takes from the checkpoint's optimizer state, not from this run (`check_hparams_match`)
    RESUMED_FROM_OPTIMIZER = ("learning_rate", "weight_decay", "betas")
    RESUMED_SCHEDULE = ("warmup_steps", "min_lr_ratio")  # the resumed scheduler's shape: a change jumps the rate

    def __init__(
        self,
        pretrained: str | None = None,
        preset: str = "tiny",
        config_overrides: dict[str, Any] | None = None,
        model_class: Literal["causal_lm", "conditional_generation"] = "causal_lm",
        attn_implementation: str = "sdpa",
        dtype: DtypeOrAuto = "auto",
        lora: LoraSpec | None = None,
        save_frozen_weights: bool = True,
        learning_rate: float = 3e-4,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: int = 100,
        min_lr_ratio: float = 0.1,
        loss_impl: Literal["plain", "chunked", "liger"] = "plain",
        loss_chunk_size: int = DEFAULT_LOSS_CHUNK,
        max_seq_length: int | None = None,
    ) -> None:
        """Build the module; the HF model itself is created in `configure_model`.

        Args:
            pretrained: local path or hub id passed to `from_pretrained`; None builds from `preset`.
            preset: config preset when `pretrained` is None: tiny, tiny-moe, gemma4-31b, gemma4-26b-a4b.
            config_overrides: text-config fields to override (e.g. `{num_hidden_layers: 6}`); an unknown field is an error.
            model_class: `causal_lm` (Gemma4ForCausalLM) or `conditional_generation` (Gemma4ForConditionalGeneration).
            attn_implementation: sdpa, eager, flex_attention or ffpa (any name registered with transformers).
            dtype: parameter dtype; `auto` is bf16 on GPUs that support it, else fp32.
            lora: peft LoRA options (e.g. `{r: 16, lora_alpha: 32, target_modules: [q_proj, v_proj]}`; MoE expert stacks: `target_parameters: [experts.gate_up_proj, experts.down_proj]`; a float8 frozen base: `base_dtype: fp8`); None trains all weights.
            save_frozen_weights: write the frozen base (weights with requires_grad False: a LoRA's base) into
                checkpoints; false saves only the trained weights and a digest of the base, which a resume (or
                `lightning-ffpa-export`) rebuilds from `pretrained` (or `preset` under the run's seed) and checks. Needs `lora`.
            learning_rate: peak AdamW learning rate (> 0).
            weight_decay: AdamW weight decay (not applied to norms and biases).
            betas: AdamW betas.
            warmup_steps: linear warmup steps before the cosine decay (>= 0).
            min_lr_ratio: final learning rate as a fraction of the peak, in [0, 1].
            loss_impl: `plain` (full logits), `chunked` (never materialises fp32 logits) or `liger` (liger-kernel).
            loss_chunk_size: tokens per chunk for the chunked loss (>= 1).
            max_seq_length: longest sequence the data will feed; checked against `max_position_embeddings`.
        """
        super().__init__()
        lora = lora_hparam(lora)  # plain data in hparams and checkpoints
        check_range("model.learning_rate", learning_rate, gt=0)
        check_range("model.weight_decay", weight_decay, ge=0)
        if len(betas) != 2 or not all(0 <= b < 1 for b in betas):  # AdamW's own rule, raised after the build
            raise ConfigError("model.betas", list(betas), "must be two numbers in [0, 1), e.g. [0.9, 0.95]")
        check_range("model.warmup_steps", warmup_steps, ge=0)
        check_range("model.min_lr_ratio", min_lr_ratio, ge=0, le=1)
        check_range("model.loss_chunk_size", loss_chunk_size, ge=1)
        if loss_impl not in ("plain", "chunked", "liger"):
            raise ConfigError("model.loss_impl", loss_impl, "must be one of 'plain', 'chunked', 'liger'")
        if loss_impl == "liger" and importlib.util.find_spec("liger_kernel") is None:
            raise ConfigError("model.loss_impl", loss_impl, "needs liger-kernel, which is not installed: "
                              "`pip install lightning-ffpa[liger]`, or use 'chunked'")
        if loss_impl != "chunked" and loss_chunk_size != DEFAULT_LOSS_CHUNK:
            rank_zero_warn(f"`model.loss_chunk_size={loss_chunk_size}` has no effect with `model.loss_impl={loss_impl}` "
                           "(only 'chunked' splits the loss into chunks)")
        if max_seq_length is not None:
            check_range("model.max_seq_length", max_seq_length, ge=1)
        self.save_hyperparameters()
        self.init_model_options()
        self.check_seq_length(max_seq_length, "model.max_seq_length")
        self.train_ppl = TokenPerplexity()
        self.val_ppl = TokenPerplexity()
        self.val_loss = TokenMeanLoss()  # per token, as val/ppl: log(val/ppl) == val/loss
        self.test_loss = TokenMeanLoss()
        self._token_weights = TokenWeights()

    def setup(self, stage: str) -> None:
        self.check_data(getattr(self.trainer, "datamodule", None) if self._trainer is not None else None)

    def check_data(self, datamodule: Any) -> None:
        """The data options this model must accept (the CLI's pre-flight runs this before `fit`, then `setup`)."""
        data_len = getattr(datamodule, "max_seq_length", None)
        data_opt = data_option(datamodule, "max_seq_length", "seq_length")  # MockDataModule: seq_length
        self.check_seq_length(data_len, data_opt)
        declared = self.hparams.get("max_seq_length")
        if isinstance(declared, int) and isinstance(data_len, int) and data_len > declared:
            raise ConfigError("model.max_seq_length", declared, f"is shorter than the data's rows "
                              f"(`{data_opt}={data_len}`); raise it, or leave it unset")
        self.attention_plan.check_packing(bool(getattr(datamodule, "pack", False)))
        check_data_fits_model(self, datamodule)  # else an IndexError in the embedding at the first batch

    # ---- forward and loss -----------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, **kwargs: Any) -> Any:
        return self.model(input_ids=input_ids, **kwargs)

    def context_parallel(self) -> tuple[Any, int, int] | None:
        """(group, rank, size) of the context-parallel mesh dim when CP > 1, else None."""
        mesh = self.device_mesh if self._trainer is not None else None
        dims = None if mesh is None else ParallelDims.from_mesh(mesh)
        return cp_group_info(dims.cp_mesh) if dims is not None and dims.cp > 1 else None

    def compute_loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean next-token loss over labels != -100 (global over the CP group), and the local token count."""
        loss, n_tokens, _ = self._loss_terms(batch)
        return loss, n_tokens

    def _loss_terms(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`compute_loss`'s two values and the local summed loss (this rank's tokens only)."""
        cp = self.context_parallel()
        if cp is not None:
            # Every CP rank holds the same full batch; each keeps its head-tail shard (the ring needs the layout).
            group, rank, size = cp
            shard = shard_batch(batch, rank, size)
            inputs = {k: shard[k] for k in ("input_ids", "position_ids", "ring_layout")}
            labels = shard["shift_labels"]
        else:
            inputs = self._model_inputs(batch)
            labels = batch["labels"]
            # Shift by appending an ignored target, so both paths score position i against token i+1.
            labels = torch.cat([labels[:, 1:], labels.new_full((labels.shape[0], 1), IGNORE_INDEX)], dim=1)
        n_tokens = (labels != IGNORE_INDEX).sum()
        nll_sum = self._nll_sum(inputs, labels, n_tokens)
        if cp is not None:
            return cp_loss_reduce(nll_sum, n_tokens, group), n_tokens, nll_sum
        return nll_sum / n_tokens.clamp(min=1), n_tokens, nll_sum

    def _model_inputs(self, batch: dict[str, torch.Tensor]) -> dict[str, Any]:
        inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids") if k in batch}
        # Packed rows (`document_ids`): keep documents apart (FFPA varlen + document masks for "ffpa").
        inputs.update(packed_inputs(batch, self.hf_model))
        return inputs

    def _nll_sum(self, inputs: dict[str, Any], labels: torch.Tensor, n_tokens: torch.Tensor) -> torch.Tensor:
        if self.hparams.loss_impl == "plain":
            logits = self.model(use_cache=False, **inputs).logits  # HF applies the final softcap
            return nn.functional.cross_entropy(
                logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
            )
        # Pass the module given to `parallelize` (the FSDP root), so its hooks gather lm_head too.
        hidden = causal_lm_hidden_states(self.model, use_cache=False, **inputs)
        hidden, weight = head_operands(self.hf_model.get_output_embeddings(), hidden.flatten(0, 1))
        mean = linear_cross_entropy(
            hidden, weight, labels.flatten(),
            softcap=getattr(text_config(self.config), "final_logit_softcapping", None),
            chunk_size=self.hparams.loss_chunk_size, impl=self.hparams.loss_impl,
        )
        return mean * n_tokens

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss, n_tokens, nll_sum = self._loss_terms(batch)
        self.train_ppl(loss.detach(), n_tokens)  # forward, not update: on_step logs the value forward returns
        self.log("train/loss", loss, prog_bar=True, batch_size=batch["input_ids"].shape[0])
        self.log("train/ppl", self.train_ppl, on_step=True, on_epoch=False)
        if self._trainer is None or not TokenWeights.needed(self.trainer):
            return loss  # one micro-batch on one rank: its mean is already the step's mean
        self._token_weights.add(n_tokens)
        return self._token_weights.loss(loss, nll_sum)

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """Backward, then at the accumulation window's last micro-batch the gradients become the mean over the
        step's labelled tokens on every rank (`TokenWeights`): every hook after this one sees the exact step."""
        super().backward(loss, *args, **kwargs)
        if self._trainer is not None and not lightning_compat.accumulating(self.trainer):
            self._token_weights.scale_grads(self.trainer, self.parameters())

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Log `train/grad_norm`: the step's gradient norm before clipping, on the steps the trainer logs (it costs
        an all-reduce per device mesh under FSDP2)."""
        if self._trainer is None or not self.trainer.loggers or not lightning_compat.should_update_logs(self.trainer):
            return
        norm = total_grad_norm(self.parameters())
        if norm is not None:
            self.log("train/grad_norm", norm, on_step=True, on_epoch=False)

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        loss, n_tokens = self.compute_loss(batch)
        self.val_ppl.update(loss, n_tokens)
        self.val_loss.update(loss, n_tokens)
        self.log("val/loss", self.val_loss, prog_bar=True, on_epoch=True)
        self.log("val/ppl", self.val_ppl, on_epoch=True)

    def test_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        loss, n_tokens = self.compute_loss(batch)
        self.test_loss.update(loss, n_tokens)
        self.log("test/loss", self.test_loss, on_epoch=True)

    def predict_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.model(use_cache=False, **self._model_inputs(batch)).logits.argmax(-1)

    # ---- optimizer ------------------------------------------------------------------------------------
    def configure_optimizers(self) -> dict[str, Any]:
        # imported here: it pulls in peft and transformers' trainer utilities, half a second of every CLI start
        from transformers.optimization import get_cosine_with_min_lr_schedule_with_warmup

        hp = self.hparams
        opt = build_adamw(self.model, lr=hp.learning_rate, weight_decay=hp.weight_decay, betas=tuple(hp.betas))
        total = max(int(self.trainer.estimated_stepping_batches), hp.warmup_steps + 1)
        self._schedule_steps = total
        sched = get_cosine_with_min_lr_schedule_with_warmup(
            opt, num_warmup_steps=hp.warmup_steps, num_training_steps=total, min_lr_rate=hp.min_lr_ratio
        )
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:  # noqa: D102
        super().on_save_checkpoint(checkpoint)
        checkpoint[SCHEDULE_KEY] = getattr(self, "_schedule_steps", None)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:  # noqa: D102
        super().on_load_checkpoint(checkpoint)
        self._resumed_schedule_steps = checkpoint.get(SCHEDULE_KEY)

    def on_train_start(self) -> None:
        """A resume whose schedule horizon differs from the checkpoint's (a larger `trainer.max_steps` to continue a
        finished run): the cosine is rebuilt over the new horizon, so the learning rate jumps at the resume."""
        self._token_weights.reset()
        old, new = getattr(self, "_resumed_schedule_steps", None), getattr(self, "_schedule_steps", None)
        if old is not None and new is not None and old != new:
            rank_zero_warn(f"the learning-rate schedule of the checkpoint's run spanned {old} steps and this run's "
                           f"spans {new} (trainer.max_steps): the cosine continues over the new horizon from step "
                           f"{self.trainer.global_step}, so the learning rate changes at the resume, not as one "
                           f"run of {new} steps would have it")
