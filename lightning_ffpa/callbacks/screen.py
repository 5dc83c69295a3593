"""What a fit shows on the terminal: a progress bar that counts optimizer steps of `max_steps`, and a model
summary without a FLOPs column it cannot fill.

Owns `StepProgressBar` (tqdm) and `RichStepProgressBar` (rich, Lightning's default when rich is installed):
with `trainer.max_steps` set, the training bar reads `steps done / max_steps` and the epoch without a total
(Lightning's reads batches of the epoch and `Epoch 0/-2`, from `max_epochs=-1`), and a small number in
scientific notation (rich's `.3f` shows a GRPO loss of -2e-5 as `-0.000`). `ParameterSummary` is
Lightning's ModelSummary without its FLOPs column and total, which are 0 unless the module defines an
`example_input_array` (and then miss the FFPA and flex attention ops). `default_callbacks` picks them for the
CLI. Does not own throughput or MFU (`TokenThroughput` logs those as metrics).
"""

from __future__ import annotations

import math
from importlib.util import find_spec
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelSummary, ProgressBar, RichProgressBar, TQDMProgressBar
from lightning.pytorch.utilities import rank_zero_info

__all__ = ["ParameterSummary", "RichStepProgressBar", "StepProgressBar", "default_callbacks"]


def _description(trainer: pl.Trainer) -> str:
    if trainer.max_steps > 0:
        return f"Epoch {trainer.current_epoch}, step"
    last = trainer.max_epochs - 1 if trainer.max_epochs is not None and trainer.max_epochs > 0 else None
    return f"Epoch {trainer.current_epoch}" + (f"/{last}" if last is not None else "")  # Lightning's 0-based form


def format_metric(value: float) -> str:
    """A number for the progress bar: 3 decimals from 0.001 to 1e5 (and for 0), else 3 significant digits in
    scientific notation, so a small loss reads `-2.31e-05`, not `-0.000`."""
    if not math.isfinite(value) or value == 0 or 1e-3 <= abs(value) < 1e5:
        return f"{value + 0.0:.3f}"  # + 0.0: -0.0 reads `0.000`
    return f"{value:.2e}"


class StepProgressBar(TQDMProgressBar):
    """tqdm progress bar: optimizer steps done of `max_steps` when it is set, else Lightning's batches."""

    def on_train_epoch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        super().on_train_epoch_start(trainer, *args)
        bar = self.train_progress_bar
        if trainer.max_steps > 0:
            bar.reset(total=trainer.max_steps)
            bar.n = bar.initial = trainer.global_step  # initial: steps of earlier epochs or runs are not in its rate
        bar.set_description(_description(trainer))

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if trainer.max_steps <= 0:
            return super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        step = trainer.global_step
        if self.is_enabled and (step % self.refresh_rate == 0 or step == trainer.max_steps):
            bar = self.train_progress_bar
            if bar.total != trainer.max_steps:  # a run resumed mid-epoch skips `on_train_epoch_start`
                bar.reset(total=trainer.max_steps)
                bar.n = bar.initial = step
                bar.set_description(_description(trainer), refresh=False)
            bar.update(step - bar.n)  # through `update`: tqdm's rate counts the steps it is told of
            bar.set_postfix(self.get_metrics(trainer, pl_module))  # also redraws


class RichStepProgressBar(RichProgressBar):
    """rich progress bar: optimizer steps done of `max_steps` when it is set, else Lightning's batches."""

    def _set_train_task(self, trainer: pl.Trainer, **fields: Any) -> None:
        if self.progress is not None and self.train_progress_bar_id is not None:
            self.progress.update(self.train_progress_bar_id, **fields)
            self.refresh()

    def _restart_train_task(self, trainer: pl.Trainer) -> None:
        """At `global_step` of `max_steps`, with rich's speed samples cleared: a jump to the step reached in earlier
        epochs (or by the run a resume continues) is no step of this one, and read as one it shows ~100 it/s."""
        if self.progress is not None and self.train_progress_bar_id is not None:
            self.progress.reset(self.train_progress_bar_id, total=trainer.max_steps, completed=trainer.global_step,
                                description=_description(trainer), visible=True)
            self.refresh()

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_epoch_start(trainer, pl_module)
        if trainer.max_steps > 0:
            self._restart_train_task(trainer)
        else:
            self._set_train_task(trainer, description=_description(trainer))

    def get_metrics(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        """Lightning's, as text: rich formats every number `.3f` (`v_num: 1.000`, a loss of -2e-5 `-0.000`)."""
        items = super().get_metrics(trainer, pl_module)
        if isinstance(items.get("v_num"), int):
            items["v_num"] = str(items["v_num"])
        return {k: format_metric(v) if isinstance(v, float) else v for k, v in items.items()}

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if trainer.max_steps <= 0:
            return super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        # Lightning's would set the task to `batch_idx + 1` first: each batch a jump down and back up to the step
        if not self.is_disabled and self.train_progress_bar_id is None:  # a run resumed mid-epoch
            self._initialize_train_progress_bar_id()
        task = next((t for t in self.progress.tasks if t.id == self.train_progress_bar_id), None) if self.progress else None
        if task is not None and task.total != trainer.max_steps:  # the epoch-start hook was skipped
            self._restart_train_task(trainer)
        self._set_train_task(trainer, completed=trainer.global_step)
        self._update_metrics(trainer, pl_module)
        self.refresh()


class ParameterSummary(ModelSummary):
    """Lightning's ModelSummary (layers, parameters, size, modes) without the FLOPs it does not count."""

    @staticmethod
    def summarize(summary_data: list[tuple[str, list[str]]], total_parameters: int, trainable_parameters: int,
                  model_size: float, total_training_modes: dict[str, int], total_flops: int,
                  **summarize_kwargs: Any) -> None:
        from lightning.pytorch.utilities.model_summary import (
            get_formatted_model_size,
            get_human_readable_count,
        )

        columns = [(name, [str(v) for v in values]) for name, values in summary_data if name != "FLOPs"]
        widths = [max([len(name), *map(len, values)]) for name, values in columns]
        lines = [" | ".join(f"{name:<{w}}" for (name, _), w in zip(columns, widths))]
        lines.append("-" * len(lines[0]))
        for row in zip(*(values for _, values in columns)):
            lines.append(" | ".join(f"{v:<{w}}" for v, w in zip(row, widths)))
        lines.append("-" * len(lines[0]))
        for value, label in [
            (get_human_readable_count(trainable_parameters), "Trainable params"),
            (get_human_readable_count(total_parameters - trainable_parameters), "Non-trainable params"),
            (get_human_readable_count(total_parameters), "Total params"),
            (get_formatted_model_size(model_size), "Total estimated model params size (MB)"),
            (total_training_modes["train"], "Modules in train mode"),
            (total_training_modes["eval"], "Modules in eval mode"),
        ]:
            lines.append(f"{value!s:<10} {label}")
        rank_zero_info("\n" + "\n".join(lines))


def default_callbacks(trainer_options: dict[str, Any], callbacks: list[Any]) -> list[Any]:
    """The screen callbacks to add to `callbacks`: a step progress bar and the summary, unless disabled or given.

    With a `ParameterSummary` added, pass `enable_model_summary=False` to the Trainer (it would add its own).
    """
    extra: list[Any] = []
    if trainer_options.get("enable_progress_bar", True) is not False and not any(
            isinstance(c, ProgressBar) for c in callbacks):
        extra.append(RichStepProgressBar() if find_spec("rich") else StepProgressBar())
    if trainer_options.get("enable_model_summary", True) is not False and not any(
            isinstance(c, ModelSummary) for c in callbacks):
        extra.append(ParameterSummary())
    return extra
