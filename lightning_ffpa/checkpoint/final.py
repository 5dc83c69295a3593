"""`FinalCheckpoint`: a fit that ends normally (`max_steps`, `max_epochs`, an early stop) saves its last step.

Why: with `every_n_train_steps`, Lightning 2.6's `ModelCheckpoint` saves at those steps and, at the end of fit,
links or copies `last` only to a save it already made, so a run stopped at step 110 with saves every 100 kept
step 100 and lost the ten steps after it. This saves the final step through the same `ModelCheckpoint` (its
top-k rule, then `last`), so the files, names and links are those of a periodic save. A stop by a signal
(SIGTERM, Ctrl-C: an exception) or a SLURM requeue (its HPC checkpoint) saves nothing more, and a `fast_dev_run`
saves nothing at all (nor `last`, which Lightning 2.6's ModelCheckpoint writes at the end of fit even then). Does
not own when periodic saves happen or what a checkpoint holds.
"""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_ffpa._compat import lightning as lightning_compat

__all__ = ["FinalCheckpoint"]


class FinalCheckpoint(pl.Callback):
    """Save the step a fit ended at, through each `ModelCheckpoint`, where no save of that step exists."""

    def __init__(self) -> None:
        self._start_step: int | None = None
        self._last_epoch: int | None = None  # the epoch of the last trained batch: the file's `epoch=`

    def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
        # At the end of fit, an epoch that ran to its end has been counted: `current_epoch` is one past it.
        self._last_epoch = trainer.current_epoch

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start_step = trainer.global_step  # a resume that trains no step has nothing new to save

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.fast_dev_run:  # Lightning says "checkpointing is suppressed"; a smoke test's save would be
            for callback in trainer.checkpoint_callbacks:  # refused by, or resumed in, the next real fit there
                if isinstance(callback, ModelCheckpoint):
                    callback.save_last = False  # its own on_train_end (after this one) writes `last` regardless
            return
        if trainer.global_step == self._start_step or any(getattr(c, "requeued", None) for c in trainer.callbacks):
            return
        for callback in trainer.checkpoint_callbacks:
            if isinstance(callback, ModelCheckpoint) and (
                    lightning_compat.last_checkpoint_step(callback) != trainer.global_step):
                lightning_compat.save_checkpoint_now(callback, trainer, epoch=self._last_epoch)
