"""`DeferredRequeue` with gradient accumulation: a requeue signal during a window's first micro-batch is acted on
after the window's optimizer step, so the HPC checkpoint holds whole steps and the requeued job steps on whole
windows (a checkpoint written mid-window dropped the window's first micro-batches from the resumed run)."""

from __future__ import annotations

import os
import signal

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_ffpa.callbacks.preemption import DeferredRequeue

ACCUMULATE, SIGNAL_AT_BATCH, MAX_STEPS = 2, 6, 6  # batch 6 is the first micro-batch of optimizer step 4


class _Linear(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _Probe(L.Callback):
    """Sends the requeue signal at one batch and records the micro-batches of each optimizer step."""

    def __init__(self, signal_at: int | None) -> None:
        self.signal_at, self.micro, self.per_step = signal_at, 0, []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.fit_loop.total_batch_idx == self.signal_at:
            os.kill(os.getpid(), signal.SIGUSR1)

    def on_before_backward(self, trainer, pl_module, loss):
        self.micro += 1

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.per_step.append(self.micro)
        self.micro = 0


def _fit(root, signal_at: int | None) -> _Probe:
    probe = _Probe(signal_at)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=MAX_STEPS, accumulate_grad_batches=ACCUMULATE,
                        default_root_dir=root, callbacks=[DeferredRequeue(), probe], logger=False,
                        enable_checkpointing=False, enable_model_summary=False, enable_progress_bar=False)
    data = DataLoader(TensorDataset(torch.randn(64, 4)), batch_size=2)
    trainer.fit(_Linear(), data)
    return probe


def _fake_slurm(tmp_path, monkeypatch) -> None:
    """SLURM's variables for one task, and an `scontrol` that logs its arguments."""
    scontrol = tmp_path / "bin" / "scontrol"
    scontrol.parent.mkdir()
    scontrol.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path / "scontrol.log"}\n')
    scontrol.chmod(0o755)
    monkeypatch.setenv("PATH", f"{scontrol.parent}{os.pathsep}{os.environ['PATH']}")
    for key, value in dict(SLURM_JOB_ID="4242", SLURM_JOB_NAME="requeue-test", SLURM_NTASKS="1",
                           SLURM_NTASKS_PER_NODE="1", SLURM_NODELIST="localhost", SLURM_JOB_NUM_NODES="1",
                           SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_NODEID="0").items():
        monkeypatch.setenv(key, value)


def test_a_signal_mid_window_checkpoints_after_the_window(tmp_path, monkeypatch):
    _fake_slurm(tmp_path, monkeypatch)
    first = _fit(tmp_path, SIGNAL_AT_BATCH)
    assert first.per_step == [ACCUMULATE] * 4  # the window the signal came in completed its step
    checkpoint = torch.load(tmp_path / "hpc_ckpt_1.ckpt", map_location="cpu", weights_only=False)
    assert checkpoint["global_step"] == 4

    again = _fit(tmp_path, None)  # the requeued job: Lightning resumes from hpc_ckpt_1.ckpt by itself
    assert again.per_step == [ACCUMULATE] * (MAX_STEPS - 4)


def test_a_signal_after_fit_neither_requeues_nor_kills(tmp_path, monkeypatch):
    """SLURM's warning signal can come just after the last step: the run is complete, so no HPC checkpoint, no
    `scontrol requeue`, and the process goes on (the default action ended it with exit code 138)."""
    _fake_slurm(tmp_path, monkeypatch)
    try:
        _fit(tmp_path, None)
        os.kill(os.getpid(), signal.SIGUSR1)  # this test process would die here without the handler
    finally:
        signal.signal(signal.SIGUSR1, signal.SIG_DFL)
    assert not (tmp_path / "scontrol.log").exists() and not list(tmp_path.glob("hpc_ckpt_*.ckpt"))


def test_a_requeue_writes_no_second_checkpoint_beside_the_hpc_one(tmp_path, monkeypatch):
    """A ModelCheckpoint with `save_last` that had saved nothing yet wrote a full `last.ckpt` right after the HPC
    checkpoint, inside the signal's margin; its `save_last` is back after the fit."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    _fake_slurm(tmp_path, monkeypatch)
    saver = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, every_n_train_steps=100)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=MAX_STEPS, default_root_dir=tmp_path,
                        callbacks=[DeferredRequeue(), _Probe(3), saver], logger=False,
                        enable_model_summary=False, enable_progress_bar=False)
    trainer.fit(_Linear(), DataLoader(TensorDataset(torch.randn(64, 4)), batch_size=2))
    assert (tmp_path / "hpc_ckpt_1.ckpt").is_file()
    assert not (tmp_path / "ckpt").exists() or not list((tmp_path / "ckpt").iterdir())
    assert saver.save_last is True
