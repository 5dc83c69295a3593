"""`TokenThroughput`: Lightning's ThroughputMonitor with real-token counts, model FLOPs and H200 peaks.

Owns the throughput/MFU metrics, the bf16 peak table Lightning lacks (it returns None for "NVIDIA H200"),
and an analytic model-FLOP count for HF decoder models. Timing and windowing stay Lightning's.

FLOPs are *model* FLOPs (what MFU conventionally counts): 2 x matmul params x tokens for the forward of the
decoder linears and the lm_head, plus the attention score/value matmuls (causal or sliding-window key counts
per query). A training batch adds the backward (`train_flops_per_batch`, the one count the benchmarks use too):
the input gradient of every matmul (as many FLOPs as its forward), and the weight gradient (as many again) only
for weights with `requires_grad`. A full fine-tune is then 3x the forward; a LoRA step, whose frozen base gets
no weight gradient, 2x for the base weights and 3x for the adapters and attention. Validation, test and predict
batches count the forward only. Activation-checkpoint recompute is not counted.
MoE layers count the routed work only: a 3-D expert stack, and the LoRA adapters peft's `target_parameters` puts
on it, at top_k / num_experts of their parameters per token. `active_train_flops_per_batch` is the MoE
convention instead: 6 x active parameters x tokens plus attention, as if every active weight trained.
Padding tokens cost compute, so FLOPs use the padded batch shape; tokens/s counts real tokens only.
Under context parallelism a rank counts its 1/cp share of each batch's samples, tokens and FLOPs, and the global
`batches_per_sec` counts a batch once per CP group (over the data-parallel size, world / cp).
The global metrics (`train/samples`, `lengths`, `samples_per_sec`, `items_per_sec`, `flops_per_sec`) are the job's:
every rank keeps its own counts, summed over the ranks by one small all-reduce on the steps that log (Lightning's
are rank 0's, times the world size for the rates). `train/device/*` stays rank 0's.
Validation logs one row per run (`validate/*`: its totals and its rates over the run's time), not Lightning's
per-batch rows, which land only on batches where `log_every_n_steps` hits.
"""

from __future__ import annotations

import contextlib
import re
import time
from collections import deque
from collections.abc import Iterator
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.throughput import Throughput, get_available_flops
from lightning.pytorch.callbacks import ThroughputMonitor
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities import rank_zero_info
from torch import nn

from lightning_ffpa._compat import lightning as lightning_compat
from lightning_ffpa.errors import ConfigError
from lightning_ffpa.loss import IGNORE_INDEX

__all__ = ["TokenThroughput", "BF16_PEAK_FLOPS", "peak_bf16_flops", "count_real_tokens", "forward_flops_per_batch",
           "train_flops_per_batch", "active_params", "active_train_flops_per_batch"]

# peft's adapters on a 3-D expert stack (`experts.lora_A.<adapter>.weight`, nested `base_layer.`s for a second
# stack of the same module): 2-D, but each token runs only its top_k experts' slices of them
_EXPERT_ADAPTER = re.compile(r"(^|\.)experts\.(base_layer\.)*lora_[AB]\.")

# Dense bf16 tensor-core peaks (no sparsity) from the vendor data sheets, by device-name substring.
BF16_PEAK_FLOPS: dict[str, float] = {
    "H200": 989e12,
    "H100 NVL": 835e12,
    "H100 PCIe": 756e12,
    "H100": 989e12,  # SXM
    "B200": 2250e12,
    "GB200": 2500e12,
}


def peak_bf16_flops(device: torch.device) -> float | None:
    """Dense bf16 peak of `device` from our table, else Lightning's; None if unknown (CPU)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, flops in BF16_PEAK_FLOPS.items():  # ordered: specific names before "H100"
        if key in name:
            return flops
    return get_available_flops(device, torch.bfloat16)


def count_real_tokens(batch: Any, ignore_index: int = IGNORE_INDEX) -> int:
    """Tokens that carry a loss: the shifted labels (`labels[:, 1:]`, the targets the loss averages over; a row's
    first label is never one) != ignore_index, else attention_mask sum, else input_ids numel."""
    if isinstance(batch, dict):
        if batch.get("labels") is not None:
            return int((batch["labels"][..., 1:] != ignore_index).sum())
        if batch.get("attention_mask") is not None:
            return int(batch["attention_mask"].sum())
        if batch.get("input_ids") is not None:
            return batch["input_ids"].numel()
    if isinstance(batch, torch.Tensor):
        return batch.numel()
    if isinstance(batch, (list, tuple)) and batch and isinstance(batch[0], torch.Tensor):
        return batch[0].numel()
    raise TypeError(f"count_real_tokens cannot read a batch of type {type(batch).__name__}")


def _batch_shape(batch: Any) -> tuple[int, int]:
    ids = batch.get("input_ids") if isinstance(batch, dict) else batch[0] if isinstance(batch, (list, tuple)) else batch
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        raise TypeError("TokenThroughput needs input_ids of shape (B, S) to count FLOPs")
    return ids.shape[0], ids.shape[1]


def _keys_per_query(seq: int, window: int | None, causal: bool) -> float:
    if not causal:
        return float(seq if window is None else min(seq, window))
    w = seq if window is None else min(window, seq)
    # sum_i min(i + 1, w) over positions i < seq
    return (w * (w + 1) / 2 + (seq - w) * w) / seq


def _layers_and_config(model: nn.Module) -> tuple[Any, Any]:
    from lightning_ffpa._compat.transformers import find_decoder_layers, text_config

    found = find_decoder_layers(model)
    if found is None:
        raise TypeError(f"the model-FLOP count found no decoder layers in {type(model).__name__}")
    config = getattr(model, "config", None)
    return getattr(*found), text_config(config) if config is not None else None  # a multimodal model's experts live there


def _routed_fraction(config: Any, num_experts: int) -> float:
    """top_k / num_experts: the share of an expert stack (or its adapters) one token runs."""
    return getattr(config, "top_k_experts", num_experts) / getattr(config, "num_experts", num_experts)


def _attention_flops(layer: nn.Module, batch_size: int, seq_len: int) -> float:
    """Forward FLOPs of a layer's QK^T and PV matmuls (0 without an HF attention module)."""
    attn = getattr(layer, "self_attn", None)
    if attn is None or not hasattr(attn, "head_dim") or not hasattr(attn, "q_proj"):
        return 0.0
    n_heads = attn.q_proj.out_features // attn.head_dim
    kq = _keys_per_query(seq_len, getattr(attn, "sliding_window", None), getattr(attn, "is_causal", True))
    return 2 * 2 * batch_size * n_heads * seq_len * kq * attn.head_dim


def _flops_split(model: nn.Module, batch_size: int, seq_len: int) -> tuple[float, float]:
    """(forward FLOPs, the part of them that are matmuls with a frozen weight) of a (B, S) batch."""
    layers, config = _layers_and_config(model)
    tokens = batch_size * seq_len
    fwd = frozen = 0.0
    for layer in layers:
        for name, p in layer.named_parameters():
            flops = 0.0
            if p.dim() == 2 and _EXPERT_ADAPTER.search(name):
                flops = 2 * p.numel() * tokens * _routed_fraction(config, 1)
            elif p.dim() == 2 and not name.endswith("router.proj.weight"):
                flops = 2 * p.numel() * tokens
            elif p.dim() == 3:  # stacked MoE experts: only top_k of num_experts run per token
                flops = 2 * p.numel() * tokens * _routed_fraction(config, p.shape[0])
            fwd += flops
            frozen += 0.0 if p.requires_grad else flops
        fwd += _attention_flops(layer, batch_size, seq_len)
    head = getattr(model, "lm_head", None)
    if isinstance(head, nn.Linear):
        flops = 2 * head.weight.numel() * tokens
        fwd += flops
        frozen += 0.0 if head.weight.requires_grad else flops
    return fwd, frozen


def active_params(model: nn.Module) -> float:
    """Base parameters one token runs through: every decoder matmul weight (attention projections, dense MLP,
    the MoE router), top_k / num_experts of each 3-D expert stack, and the lm_head. LoRA adapters and the
    embedding lookup are not counted."""
    layers, config = _layers_and_config(model)
    total = 0.0
    for layer in layers:
        for name, p in layer.named_parameters():
            if p.dim() == 2 and "lora_" not in name:
                total += p.numel()
            elif p.dim() == 3:
                total += p.numel() * _routed_fraction(config, p.shape[0])
    head = getattr(model, "lm_head", None)
    return total + (head.weight.numel() if isinstance(head, nn.Linear) else 0)


def active_train_flops_per_batch(model: nn.Module, batch_size: int, seq_len: int) -> float:
    """MoE MFU's count for one training step on a (B, S) batch: 6 x `active_params` x tokens (forward, input and
    weight gradients of every active weight, adapters or not) plus 3 x the attention score/value matmuls."""
    layers, _ = _layers_and_config(model)
    attention = sum(_attention_flops(layer, batch_size, seq_len) for layer in layers)
    return 6.0 * active_params(model) * batch_size * seq_len + 3.0 * attention


def forward_flops_per_batch(model: nn.Module, batch_size: int, seq_len: int) -> float:
    """Model FLOPs of one forward of an HF decoder CausalLM on a (B, S) batch."""
    return _flops_split(model, batch_size, seq_len)[0]


def train_flops_per_batch(model: nn.Module, batch_size: int, seq_len: int) -> float:
    """Model FLOPs of one training step of an HF decoder CausalLM on a (B, S) batch: forward, input gradient of
    every matmul, weight gradient of trainable weights only (3x the forward for a full fine-tune, less for LoRA)."""
    fwd, frozen = _flops_split(model, batch_size, seq_len)
    return 3.0 * fwd - frozen  # a frozen weight's matmul: forward + input gradient, no weight gradient


class _RankTally:
    """This rank's running totals of a stage (samples, tokens, FLOPs) after each batch, the last `window` of them
    kept: Lightning counts on rank 0 only, and the job's counts are the sum of every rank's."""

    def __init__(self, window: int) -> None:
        self.rows: deque[tuple[float, float, float]] = deque(maxlen=window)
        self.total = (0.0, 0.0, 0.0)
        self.batches = 0

    def add(self, samples: float, tokens: float, flops: float) -> None:
        self.total = (self.total[0] + samples, self.total[1] + tokens, self.total[2] + flops)
        self.rows.append(self.total)
        self.batches += 1


def _job_sum(trainer: pl.Trainer, rows: list[tuple[float, float, float]]) -> torch.Tensor:
    """`rows` summed over every rank (one all-reduce, every rank calls it). A CP rank counts its 1/cp share of the
    batch its group shares, so the sum counts each batch once."""
    local = torch.tensor(rows, dtype=torch.float64, device=trainer.strategy.root_device)
    if trainer.world_size > 1:
        local = trainer.strategy.reduce(local, reduce_op="sum")
    return local.cpu()


class _JobThroughput(Throughput):
    """Lightning's Throughput with the job's counts: its global `samples`, `lengths` and rates were rank 0's counts
    (times the world size for the rates), wrong where ranks hold different batches; `job` (every rank's running
    totals over the window, from `_job_sum`) replaces them. Context-parallel ranks share each batch: the global
    `batches_per_sec` (the device rate x world size) is over the data-parallel size (world / cp)."""

    def __init__(self, cp: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.cp = cp
        self.job: torch.Tensor | None = None  # (window, 3): samples, tokens, FLOPs; set before each compute

    def compute(self) -> dict[str, float]:
        metrics = super().compute()
        if "batches_per_sec" in metrics:
            metrics["batches_per_sec"] /= self.cp
        if self.job is not None and len(self.job) == len(self._time):  # the same batches as the window's times
            metrics.update(_job_metrics(metrics, self.job, self._time[-1] - self._time[0]))
        return metrics


def _job_metrics(metrics: dict[str, float], job: torch.Tensor, elapsed: float) -> dict[str, float]:
    """The job's totals and, where Lightning computed its global rates (a full window), the job's rates over the
    window's time."""
    out = {"samples": float(job[-1, 0])}
    if "lengths" in metrics:
        out["lengths"] = float(job[-1, 1])
    moved = job[-1] - job[0]
    for key, column in (("samples_per_sec", 0), ("items_per_sec", 1), ("flops_per_sec", 2)):
        if key in metrics:
            out[key] = float(moved[column]) / elapsed
    return out


def _run_metrics(job: torch.Tensor, mine: _RankTally, elapsed: float, peak: float | None) -> dict[str, float]:
    """A whole evaluation run's throughput: the job's totals (`job`, every rank's summed) and this rank's (`mine`)
    over the run's time."""
    metrics = {"time": elapsed, "batches": float(mine.batches), "samples": float(job[0]), "lengths": float(job[1]),
               "flops": float(job[2]), "samples_per_sec": float(job[0]) / elapsed,
               "items_per_sec": float(job[1]) / elapsed, "flops_per_sec": float(job[2]) / elapsed,
               "device/samples_per_sec": mine.total[0] / elapsed, "device/items_per_sec": mine.total[1] / elapsed,
               "device/flops_per_sec": mine.total[2] / elapsed}
    if peak:
        metrics["device/mfu"] = mine.total[2] / elapsed / peak
    return metrics


def matmul_path_metrics() -> dict[str, float]:
    """The counted matmul paths beside attention's, once any ran: the MoE experts' with unmerged adapters
    (`experts/grouped_mm`, `experts/loop`) and the float8 frozen base's (`fp8_base/<path>`); forwards so far."""
    from lightning_ffpa import experts, fp8_base

    return {f"{name}/{path}": float(n) for name, counts in (("experts", experts.path_counts()),
                                                             ("fp8_base", fp8_base.path_counts()))
            for path, n in counts.items() if n}


def _backend_counts() -> dict[str, int]:
    """The FFPA backend's path counters (every forward so far), read where they live at call time."""
    from lightning_ffpa import attention

    return attention.dispatch_counts()


class TokenThroughput(ThroughputMonitor):
    """ThroughputMonitor counting real tokens per rank, model FLOPs, peak memory and attention dispatch."""

    def __init__(self, window_size: int = 20, peak_flops: float | None = None,
                 count: Literal["real", "padded"] = "real", ignore_index: int = IGNORE_INDEX,
                 log_attention_dispatch: bool = True) -> None:
        """Configure the monitor.

        Args:
            window_size: Batches in the moving window for the rates (at least 2).
            peak_flops: Per-device peak FLOP/s for MFU (> 0); default: bf16 peak from the device name.
            count: "real" counts the loss's targets (labels after the shift, else attention_mask); "padded" B x S.
            ignore_index: Label value that marks a token without loss.
            log_attention_dispatch: Also log the attention backend's dispatch counters (skipped when an
                FFPAAttention callback already logs them).
        """
        if count not in ("real", "padded"):
            raise ConfigError("TokenThroughput.count", count, "must be one of 'real', 'padded'")
        if window_size < 2:  # Lightning's Throughput asserts this only once the fit has started
            raise ConfigError("TokenThroughput.window_size", window_size, "must be >= 2 (the rates are differences "
                              "over the window's batches)")
        if peak_flops is not None and not peak_flops > 0:  # a negative MFU was logged
            raise ConfigError("TokenThroughput.peak_flops", peak_flops, "must be > 0 FLOP/s, or null for the "
                              "device's bf16 peak")
        tokens = (lambda b: count_real_tokens(b, ignore_index)) if count == "real" else (
            lambda b: _batch_shape(b)[0] * _batch_shape(b)[1])
        # Context-parallel peers share each sequence: a rank does 1/cp of the batch it is handed
        super().__init__(batch_size_fn=lambda b: _batch_shape(b)[0] / self._cp,
                         length_fn=lambda b: tokens(b) / self._cp, window_size=window_size)
        self._cp = 1
        self.peak_flops = peak_flops
        self.log_attention_dispatch = log_attention_dispatch
        self._said_uncounted = False
        self._auto_flops = False
        self._training: Any = None  # the backend's training calls (`TrainingCalls`), where no FFPAAttention counts
        self._tallies: dict[RunningStage, _RankTally] = {}  # this rank's counts, every rank's (Lightning: rank 0's)
        self._run_start = 0.0  # perf_counter at the start of the validation run

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        # Lightning picks the peak from the Trainer precision, which is "32-true" under FSDP2 mixed
        # precision and unknown for H200; use the bf16 table (or the user's number) instead.
        peak = self.peak_flops or peak_bf16_flops(trainer.strategy.root_device)
        self.available_flops = peak
        from lightning_ffpa.callbacks.attention import FFPAAttention, context_parallel_size

        self._cp = context_parallel_size(trainer, pl_module)
        for stage, tp in self._throughputs.items():  # the job's counts, and one batch per CP group
            tp = self._throughputs[stage] = _JobThroughput(self._cp, world_size=tp.world_size, **self.kwargs)
            tp.available_flops = peak
        self._auto_flops = not hasattr(pl_module, "flops_per_batch")
        from lightning_ffpa.attention.counters import TrainingCalls

        self._training = TrainingCalls(_backend_counts)
        self._training.start()  # the process-wide counters: earlier fits' calls are not this one's

        if any(isinstance(cb, FFPAAttention) and cb.log_every_n_steps for cb in trainer.callbacks):
            self.log_attention_dispatch = False  # one writer per metric key
        from lightning_ffpa.attention.kernels import register_flop_formulas

        register_flop_formulas()  # FLOP formulas for the FFPA ops, for anyone using measure_flops on this model

    def _batch_flops(self, pl_module: pl.LightningModule, batch: Any, backward: bool) -> float | None:
        """This rank's model FLOPs of `batch`: the module's own `flops_per_batch`, else the analytic count of the
        rank's 1/cp share (every rank counts: the job's FLOPs are the sum of theirs)."""
        if not self._auto_flops:
            return getattr(pl_module, "flops_per_batch", None)
        from lightning_ffpa._compat.transformers import find_hf_model

        model = find_hf_model(pl_module, strict=False) or pl_module
        count = train_flops_per_batch if backward else forward_flops_per_batch
        return count(model, *_batch_shape(batch)) / self._cp

    @contextlib.contextmanager
    def _flops_of(self, pl_module: pl.LightningModule, flops: float | None) -> Iterator[None]:
        """`flops` as `pl_module.flops_per_batch` while Lightning's hook reads it, then removed: a later fit
        (another length) or stage (forward only) computes its own, and a user's own attribute is left alone."""
        if not self._auto_flops:
            yield
            return
        pl_module.flops_per_batch = flops
        try:
            yield
        finally:
            del pl_module.flops_per_batch

    def _tally(self, stage: RunningStage, batch: Any, flops: float | None) -> _RankTally:
        """Count `batch` in this rank's tally of `stage` (Lightning's counts are rank 0's only)."""
        tally = self._tallies[stage]
        tally.add(self.batch_size_fn(batch), self.length_fn(batch), flops or 0.0)
        return tally

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._tallies[RunningStage.TRAINING] = _RankTally(self.kwargs["window_size"])  # as Lightning's window
        super().on_train_start(trainer, pl_module)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        # FLOPs from the batch as trained: a RolloutCallback listed after this one fills `input_ids` in its
        # own batch-start hook (it stays last in the list, where command-line `init_args` overrides land).
        flops = self._batch_flops(pl_module, batch, backward=True)
        tally = self._tally(RunningStage.TRAINING, batch, flops)
        logs = not lightning_compat.accumulating(trainer) and lightning_compat.should_update_logs(trainer)
        if logs:  # where Lightning's hook computes the metrics: the job's counts, summed over the ranks first
            self._throughputs[RunningStage.TRAINING].job = _job_sum(trainer, list(tally.rows))
        with self._flops_of(pl_module, flops):
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if not logs:
            return
        metrics: dict[str, float] = {}
        if trainer.strategy.root_device.type == "cuda":
            metrics["device/peak_memory_gb"] = torch.cuda.max_memory_allocated(trainer.strategy.root_device) / 2**30
            metrics["device/peak_reserved_gb"] = torch.cuda.max_memory_reserved(trainer.strategy.root_device) / 2**30
        if self.log_attention_dispatch:
            metrics.update(self._dispatch_metrics(trainer, pl_module))
        metrics.update(matmul_path_metrics())
        if metrics:
            pl_module.log_dict(metrics, on_step=True, on_epoch=False, rank_zero_only=True)

    def _dispatch_metrics(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, float]:
        """The attention counters, once any call was counted: an `FFPAAttention`'s training counts where one is
        installed (the CP ring's included, which the backend's counters never see), else the backend's with the same
        bookkeeping (`TrainingCalls`: training forwards only, paths that ran). A model on
        HF's own attention (`sdpa` without the FFPA backend) counts nothing, and zeros would read as "no attention
        ran"; said once instead."""
        from lightning_ffpa.callbacks.attention import FFPAAttention

        installed = next((cb for cb in trainer.callbacks if isinstance(cb, FFPAAttention)), None)
        counts = installed.training_counts() if installed is not None else self._training.counts()
        if counts:
            return {f"attention/{k}": float(v) for k, v in counts.items()}
        if not self._said_uncounted:
            self._said_uncounted = True
            from lightning_ffpa._compat.transformers import config_attn_implementation, find_hf_model

            config = getattr(find_hf_model(pl_module, strict=False), "config", None)
            attn = config_attn_implementation(config) if config is not None else None
            rank_zero_info(f"TokenThroughput: no attention call went through the FFPA backend (the model's attention "
                           f"is {attn!r}, not the backend's), so no `attention/*` counter is logged")
        return {}

    def _compute(self, trainer: pl.Trainer, iter_num: int | None = None) -> None:
        # Lightning logs `validate/*` (`test/*`) on the evaluation batches where `log_every_n_steps` hits (never, for
        # 8 batches logging every 10 steps): one row per evaluation run instead (`_log_run`)
        if trainer.state.stage not in (RunningStage.VALIDATING, RunningStage.TESTING):
            super()._compute(trainer, iter_num)

    def _run_begins(self, stage: RunningStage) -> None:
        self._tallies[stage] = _RankTally(1)
        self._run_start = time.perf_counter()

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._training.eval_start()  # the sanity check's too: its calls are no training's
        if not trainer.sanity_checking:
            self._run_begins(RunningStage.VALIDATING)
        super().on_validation_start(trainer, pl_module)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._training.eval_end()
        if not trainer.sanity_checking:
            self._log_run(trainer, RunningStage.VALIDATING)
        super().on_validation_end(trainer, pl_module)

    def on_validation_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                                batch_idx: int, dataloader_idx: int = 0) -> None:
        flops = self._batch_flops(pl_module, batch, backward=False)
        if not trainer.sanity_checking:
            self._tally(RunningStage.VALIDATING, batch, flops)
        with self._flops_of(pl_module, flops):  # Lightning's window still times validation for the training rate
            super().on_validation_batch_end(trainer, pl_module, outputs, batch, batch_idx, dataloader_idx)

    def _log_run(self, trainer: pl.Trainer, stage: RunningStage) -> None:
        """One row of `stage` metrics for the run that just ended, at the step its `val/loss` lands on (every rank
        takes part in the sum of the counts)."""
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize(trainer.strategy.root_device)
        elapsed = time.perf_counter() - self._run_start
        mine = self._tallies.pop(stage)
        job = _job_sum(trainer, [mine.total])[0]
        if not trainer.is_global_zero or not mine.batches:
            return
        metrics = {f"{stage.value}/{k}": v for k, v in _run_metrics(job, mine, elapsed, self.available_flops).items()}
        step = lightning_compat.logging_step(trainer)
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)

    def on_test_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._run_begins(RunningStage.TESTING)
        super().on_test_start(trainer, pl_module)

    def on_test_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._log_run(trainer, RunningStage.TESTING)
        super().on_test_end(trainer, pl_module)

    def on_test_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                          batch_idx: int, dataloader_idx: int = 0) -> None:
        flops = self._batch_flops(pl_module, batch, backward=False)
        self._tally(RunningStage.TESTING, batch, flops)
        with self._flops_of(pl_module, flops):
            super().on_test_batch_end(trainer, pl_module, outputs, batch, batch_idx, dataloader_idx)

    def on_predict_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                             batch_idx: int, dataloader_idx: int = 0) -> None:
        with self._flops_of(pl_module, self._batch_flops(pl_module, batch, backward=False)):
            super().on_predict_batch_end(trainer, pl_module, outputs, batch, batch_idx, dataloader_idx)
