"""What the full-depth LoRA rows share (ours, HF + PEFT, Unsloth; dense and MoE): the model's overrides, ours'
fit as the console builds it (and `--profile`'s extra step in it), the HF + PEFT rows' one-rank placement under ours'
strategy options, the FSDP2 recipe a row applied, static memory and the timed steps' statistics. Owns no row and no run (`full_depth_lora.py`,
`moe_lora.py`, `unsloth_row.py`).
"""

from __future__ import annotations

import contextlib
import os
import socket
import statistics
from typing import Any


def config_overrides(spec: dict[str, Any]) -> dict[str, Any]:
    """Text-config overrides of the run: none at full depth; two layers (sliding, full) in the smoke run."""
    if spec["layers"] is None:
        return {}
    return dict(num_hidden_layers=spec["layers"],
                layer_types=["sliding_attention"] * (spec["layers"] - 1) + ["full_attention"])


def strategy_settings(strategy, model) -> dict[str, Any]:
    """The FSDP2 recipe `strategy` applied to `model`, as run: its parallelize options, what `replicate_frozen`
    decided (`frozen_placement`), and how many frozen parameters FSDP2 really holds (DTensors, counted on the
    model). Two rows compared on speed or memory must agree here except in what they exist to show."""
    from torch.distributed.tensor import DTensor

    frozen = [p for p in model.parameters() if not p.requires_grad]
    return dict(activation_checkpointing=strategy.activation_checkpointing, sac_save_mm=strategy.sac_save_mm,
                sac_extra_save_ops=list(strategy.sac_extra_save_ops), compile=strategy.compile_layers,
                param_dtype=str(strategy.param_dtype), reduce_dtype=str(strategy.reduce_dtype),
                reshard_after_forward=strategy.reshard_after_forward, cpu_offload=strategy.cpu_offload,
                activation_offload=strategy.activation_offload, fp8=strategy.fp8_training.recipe,
                replicate_frozen=strategy.replicate_frozen, frozen_placement=strategy.frozen_placement,
                frozen_params_in_fsdp2=sum(isinstance(p, DTensor) for p in frozen), frozen_tensors=len(frozen))


def static_memory(model) -> dict[str, Any]:
    """Parameters by dtype and trainability, and the bytes they and the AdamW states take (counted on the model)."""
    by_dtype: dict[str, int] = {}
    base = trainable = trainable_bytes = 0
    for p in model.parameters():
        by_dtype[str(p.dtype)] = by_dtype.get(str(p.dtype), 0) + p.numel()
        if p.requires_grad:
            trainable += p.numel()
            trainable_bytes += p.numel() * (p.element_size() * 2 + 8)  # weight + grad + two fp32 moments
        else:
            base += p.numel()
    frozen_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)
    return dict(params_by_dtype=by_dtype, frozen_params=base, trainable_params=trainable,
                frozen_gib=frozen_bytes / 2**30, trainable_with_adamw_gib=trainable_bytes / 2**30)


def step_stats(times: list[float], seq: int, flops: float, device) -> dict[str, Any]:
    """Median/min/max step time, tokens/s, peak memory and MFU of the timed steps."""
    import torch

    from lightning_ffpa.callbacks.throughput import peak_bf16_flops

    cuda = device.type == "cuda"
    median, peak = statistics.median(times), peak_bf16_flops(device)
    return dict(timed_steps=len(times), step_ms_median=median * 1e3, step_ms_min=min(times) * 1e3,
                step_ms_max=max(times) * 1e3, tokens_per_s=seq / median,
                peak_mem_allocated_gb=torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None,
                peak_mem_reserved_gb=torch.cuda.max_memory_reserved(device) / 2**30 if cuda else None,
                lora_tflops_per_step=flops / 1e12, spec_bf16_peak_tflops=peak and peak / 1e12,
                mfu_spec=flops / median / peak if peak else None)


def sync(device) -> None:
    """Wait for the device's queued work (CUDA); nothing on CPU."""
    if device.type == "cuda":
        __import__("torch").cuda.synchronize(device)


def recipe_strategy_options(recipe: dict[str, Any], words: list[str]) -> dict[str, Any]:
    """A recipe's FSDP2Strategy `init_args` with the `--trainer.strategy.init_args.*` overrides among `words`:
    the HF + PEFT rows build their strategy from ours' options, so the rows cannot drift apart."""
    import yaml

    options = dict(recipe["trainer"]["strategy"]["init_args"])
    prefix = "--trainer.strategy.init_args."
    for flag, value in zip(words, words[1:]):
        if flag.startswith(prefix):
            options[flag.removeprefix(prefix)] = yaml.safe_load(value)
    return options


def fit_as_built(words: list[str], clock, reference_kernel: bool):
    """Ours as `lightning-ffpa fit` runs it: `cli.build(words)`, `clock` appended to the callbacks, the console's
    pre-flight, then fit (the CPU smoke runs the FFPA op's CPU reference: fp32 would otherwise fall back to sdpa)."""
    from lightning_ffpa._compat import torch as torch_compat
    from lightning_ffpa.attention import kernels
    from lightning_ffpa.cli import build
    from lightning_ffpa.validation import preflight

    cli = build(words, run=False)
    cli.trainer.callbacks.append(clock)
    preflight(cli.trainer, cli.model, cli.datamodule, None)  # what `lightning-ffpa fit` checks before fit
    torch_compat.dynamo_counters().clear()
    with kernels.force_kernel("reference") if reference_kernel else contextlib.nullcontext():
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    return cli


class ExtraStepProfile:
    """`--profile` in ours' fit: the batch at global step `at_step` (None: no profile), the one after the timed ones,
    runs under `step_probe.StepProfiler`, started at its batch start, stopped at its batch end (`profile` then holds
    the result). A clock's batch-end hook calls `stop()` first and times nothing when it returns True."""

    def __init__(self, at_step: int | None) -> None:
        self.at_step, self.profile, self._profiler = at_step, None, None

    def start_if_due(self, trainer) -> None:
        """At the batch start of `at_step`, start the profiler."""
        if self.at_step is not None and trainer.global_step == self.at_step:
            from benchmarks.step_probe import StepProfiler

            self._profiler = StepProfiler(trainer.strategy.root_device)
            self._profiler.start()

    def stop(self) -> bool:
        """At a batch end: stop a running profile and keep its result; True when this batch was the profiled one."""
        if self._profiler is None or not self._profiler.active:
            return False
        self.profile = self._profiler.stop()
        return True


def one_rank_group(cuda: bool):
    """A one-rank process group on a free local port (nccl on GPU 0, gloo on CPU); returns the row's device."""
    import torch

    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]))
    torch.distributed.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1,
                                         **({"device_id": device} if cuda else {}))
    return device


def place_peft_model(model, strategy_options: dict[str, Any], device):
    """An HF + PEFT model built on meta, placed as ours' strategy places it on a mesh of one (replicate_frozen
    included), materialised, and its adapters back to peft's init (HF's init touched them; B = 0, as the product
    has them); returns the strategy."""
    import torch
    from peft.tuners.lora import LoraLayer

    from lightning_ffpa._compat import torch as torch_compat
    from lightning_ffpa.parallel import FSDP2Strategy
    from lightning_ffpa.parallel.dims import ParallelDims
    from lightning_ffpa.parallel.strategy import materialize

    strategy = FSDP2Strategy(**strategy_options)
    strategy.use_parallel_dims(ParallelDims(1), device.type)
    torch_compat.raise_recompile_limit(64)
    strategy.parallelize_module(model)
    materialize(model, device)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, LoraLayer):
                for adapter in module.lora_A:
                    module.reset_lora_parameters(adapter, True)
    model.train()
    return strategy
