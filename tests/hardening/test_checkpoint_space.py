"""The disk pre-flight at fit start (`CheckpointSpace`): a checkpoint that will not fit is refused before the first
step, not when the first checkpoint is due (every step until then was lost work)."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_ffpa.checkpoint import AtomicCheckpointIO
from lightning_ffpa.checkpoint import atomic as atomic_mod
from lightning_ffpa.checkpoint.space import CheckpointSpace, estimate_checkpoint_bytes
from lightning_ffpa.errors import ConfigError


class Steps(L.Callback):
    def __init__(self) -> None:
        self.steps = 0

    def on_train_batch_start(self, *args) -> None:
        self.steps += 1


class AdamBoring(BoringModel):
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.1)


def _trainer(root: Path, *extra: L.Callback) -> L.Trainer:
    return L.Trainer(default_root_dir=root, max_steps=50, accelerator="cpu", logger=False, enable_progress_bar=False,
                     enable_model_summary=False, limit_val_batches=0, plugins=[AtomicCheckpointIO()],
                     callbacks=[ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=40), *extra])


def test_a_checkpoint_that_will_not_fit_is_refused_before_the_first_step(tmp_path, monkeypatch, record_property):
    monkeypatch.setattr(atomic_mod, "free_bytes", lambda d: 500)  # one checkpoint of AdamBoring: 792 bytes
    steps = Steps()
    with pytest.raises(ConfigError) as err:
        _trainer(tmp_path, CheckpointSpace(), steps).fit(AdamBoring())
    record_property("hardening", "checkpoint")
    record_property("case", "disk too small for the first checkpoint: refused at fit start, before step 1")
    msg = str(err.value)
    assert msg.startswith(f"`ModelCheckpoint.dirpath={str(tmp_path / 'ckpt')!r}`: a checkpoint needs about ")
    assert "500 bytes is free" in msg and steps.steps == 0


def test_the_estimate_counts_the_optimizer_state_before_it_exists(tmp_path):
    seen = {}

    class Peek(L.Callback):
        def on_train_start(self, trainer, pl_module):
            seen["bytes"] = estimate_checkpoint_bytes(trainer, pl_module)

    _trainer(tmp_path, Peek()).fit(AdamBoring())
    params = 32 * 2 * 4 + 2 * 4  # BoringModel: Linear(32, 2), fp32
    assert seen["bytes"] == 3 * params  # weights + AdamW's two moments (allocated only at the first step)


def test_enough_space_trains(tmp_path, monkeypatch):
    monkeypatch.setattr(atomic_mod, "free_bytes", lambda d: 10**9)
    steps = Steps()
    _trainer(tmp_path, CheckpointSpace(), steps).fit(AdamBoring())
    assert steps.steps == 50


def test_the_cli_adds_it(tmp_path):
    from lightning_ffpa.cli import build

    cli = build(["--config", "tiny", f"--trainer.default_root_dir={tmp_path}"], run=False)
    assert sum(isinstance(c, CheckpointSpace) for c in cli.trainer.callbacks) == 1
