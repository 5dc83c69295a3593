"""`CheckpointSpace`: the disk-space pre-flight at fit start, so a run that cannot save its first checkpoint is
refused before it trains, not when that checkpoint is due (hours of steps later).

Owns estimating what one checkpoint will write (the module's state, plus the optimizer's state: what it holds
already on a resume, else the per-parameter buffers its class keeps, e.g. Adam's two moments) and checking it
against the free space of each `ModelCheckpoint` folder, on every rank, at `on_train_start`. Does not own the
check made at each save (`checkpoint.atomic` / `checkpoint.sharded`, with the same margin and message) or where
checkpoints go (`ModelCheckpoint`).
"""

from __future__ import annotations

import os

import lightning.pytorch as pl
import torch
from fsspec.utils import get_protocol

from lightning_ffpa.checkpoint import atomic
from lightning_ffpa.checkpoint.atomic import SPACE_MARGIN, checkpoint_bytes, space_error

__all__ = ["CheckpointSpace", "estimate_checkpoint_bytes"]

# optimizer state tensors per parameter, by class name (the state is allocated at the first step)
_STATES_PER_PARAM = {"Adam": 2, "AdamW": 2, "FusedAdam": 2, "Adamax": 2, "NAdam": 2, "RAdam": 2, "Adagrad": 1,
                     "RMSprop": 1, "Adafactor": 1}


def _optimizer_bytes(optimizer: torch.optim.Optimizer) -> int:
    held = checkpoint_bytes(optimizer.state_dict().get("state", {}))
    per_param = _STATES_PER_PARAM.get(type(optimizer).__name__)
    if per_param is None:  # SGD and others: a momentum buffer if it has momentum
        per_param = 1 if any(g.get("momentum") for g in optimizer.param_groups) else 0
    expected = per_param * sum(checkpoint_bytes(p) for g in optimizer.param_groups for p in g["params"])
    return max(held, expected)


def estimate_checkpoint_bytes(trainer: pl.Trainer, pl_module: pl.LightningModule) -> int:
    """Bytes this process will write for one checkpoint: its shard of the module's and optimizers' state, times
    the processes on this host when the state is sharded (they write to the same disk)."""
    local = checkpoint_bytes(pl_module.state_dict()) + sum(_optimizer_bytes(o) for o in trainer.optimizers)
    from torch.distributed.tensor import DTensor

    sharded = any(isinstance(p, DTensor) for p in pl_module.parameters())
    return local * (int(os.environ.get("LOCAL_WORLD_SIZE", trainer.num_devices)) if sharded else 1)


class CheckpointSpace(pl.Callback):
    """Refuse a fit, before its first step, whose checkpoint will not fit in a ModelCheckpoint folder."""

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Check every local ModelCheckpoint folder; every rank raises the same one-line error."""
        folders = [cb.dirpath for cb in trainer.checkpoint_callbacks
                   if getattr(cb, "dirpath", None) and get_protocol(str(cb.dirpath)) == "file"]
        if not folders:
            return
        needed = estimate_checkpoint_bytes(trainer, pl_module)
        short = next(((d, f) for d in folders if (f := atomic.free_bytes(d)) < needed * SPACE_MARGIN), None)
        if not trainer.strategy.reduce_boolean_decision(short is None, all=True):
            folder, free = short or (folders[0], atomic.free_bytes(folders[0]))
            raise space_error(folder, needed, free)
