"""`StepLearningRateMonitor`: Lightning's `LearningRateMonitor`, one row per optimizer step."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import LearningRateMonitor

from lightning_ffpa._compat.lightning import logging_step


class StepLearningRateMonitor(LearningRateMonitor):
    """Logs the learning rates once per optimizer step. Lightning's writes them at every micro-batch of an
    accumulation window (its logging condition counts optimizer steps, which do not move inside the window), so
    `accumulate_grad_batches: 4` gave four identical rows a step."""

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any, **kwargs: Any) -> None:
        step = logging_step(trainer)
        if step == getattr(self, "_last_step", None):
            return
        self._last_step = step
        super().on_train_batch_start(trainer, *args, **kwargs)
