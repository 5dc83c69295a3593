"""`RunLock`: a second fit into a run directory fails with one line; stale locks are taken over."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_ffpa.checkpoint import RunLock
from lightning_ffpa.checkpoint.lock import LOCK_NAME
from lightning_ffpa.errors import ConfigError


def _fit(root: Path, lock: RunLock, max_steps: int = 1) -> L.Trainer:
    trainer = L.Trainer(default_root_dir=root, max_steps=max_steps, accelerator="cpu", logger=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        enable_checkpointing=False, callbacks=[lock])
    trainer.fit(BoringModel())
    return trainer


def _hold(root: Path, pid: int, host: str | None = None) -> str:
    root.mkdir(parents=True, exist_ok=True)
    text = json.dumps({"pid": pid, "host": host or socket.gethostname(), "slurm_job_id": None, "token": "x"})
    (root / LOCK_NAME).write_text(text)
    return text


@pytest.fixture
def live_pid():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield proc.pid
    proc.kill()
    proc.wait()


def test_second_fit_into_a_locked_dir_fails_with_one_line(tmp_path, live_pid, record_property):
    held = _hold(tmp_path, live_pid)
    with pytest.raises(ConfigError) as err:
        _fit(tmp_path, RunLock())
    record_property("hardening", "checkpoint")
    record_property("case", "second fit into a locked run directory: one line naming trainer.default_root_dir")
    msg = str(err.value)
    assert msg.startswith(f"`trainer.default_root_dir={str(tmp_path)!r}`") and f"pid {live_pid}" in msg
    assert "\n" not in msg
    assert (tmp_path / LOCK_NAME).read_text() == held  # the other run's lock is left alone
    assert sorted(p.name for p in tmp_path.iterdir()) == [LOCK_NAME]  # nothing else written


def test_lock_is_held_during_fit_and_released_after(tmp_path):
    seen = {}

    class Peek(L.Callback):
        def on_train_start(self, trainer, pl_module):
            seen.update(json.loads((tmp_path / LOCK_NAME).read_text()))

    lock = RunLock()
    trainer = L.Trainer(default_root_dir=tmp_path, max_steps=1, accelerator="cpu", logger=False,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                        callbacks=[lock, Peek()])
    trainer.fit(BoringModel())
    import os

    assert seen["pid"] == os.getpid() and seen["host"] == socket.gethostname()
    assert not (tmp_path / LOCK_NAME).exists()
    _fit(tmp_path, RunLock())  # and a later fit takes it again


def test_stale_lock_of_a_dead_process_is_taken_over_with_a_warning(tmp_path, record_property):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    _hold(tmp_path, dead.pid)
    lock = RunLock()
    with pytest.warns(UserWarning, match="took over the stale lock"):
        _fit(tmp_path, lock)
    record_property("hardening", "checkpoint")
    record_property("case", "stale lock of a dead pid on this host: taken over with a warning")
    assert lock.took_over["pid"] == dead.pid
    assert not (tmp_path / LOCK_NAME).exists()


def test_lock_from_another_host_is_refused(tmp_path):
    _hold(tmp_path, 1, host="some-other-node")
    with pytest.raises(ConfigError, match="pid 1 on host some-other-node.*delete the lock file"):
        _fit(tmp_path, RunLock())


def test_requeued_slurm_job_takes_over_its_own_lock(tmp_path, monkeypatch):
    (tmp_path / LOCK_NAME).write_text(json.dumps({"pid": 1, "host": "node-a", "slurm_job_id": "4242"}))
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    lock = RunLock()
    with pytest.warns(UserWarning, match="took over"):
        lock._acquire(tmp_path)
    assert lock.took_over["host"] == "node-a"
    lock._release()
    assert not (tmp_path / LOCK_NAME).exists()


def test_a_running_task_of_the_same_slurm_attempt_keeps_its_lock(tmp_path, monkeypatch):
    """Any lock of the same job was taken over as a requeue's leftover, also a sibling task's still running (srun
    tasks outnumbering `trainer.devices`: each ran a fit of its own into one folder). The attempt count tells them
    apart: the next attempt takes over, the same attempt's live task keeps it."""
    sibling = subprocess.Popen(["sleep", "60"])
    try:
        monkeypatch.setenv("SLURM_JOB_ID", "4242")
        held = {"pid": sibling.pid, "host": socket.gethostname(), "slurm_job_id": "4242", "slurm_restart": "0"}
        (tmp_path / LOCK_NAME).write_text(json.dumps(held))
        with pytest.raises(ConfigError, match=r"another task of this SLURM job \(pid \d+"):
            RunLock().check_free(tmp_path)
        monkeypatch.setenv("SLURM_RESTART_COUNT", "1")  # the requeued attempt
        RunLock().check_free(tmp_path)
    finally:
        sibling.kill()


def test_partial_checkpoints_of_a_killed_save_are_swept_once_locked(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    ckpt = tmp_path / "checkpoints"
    ckpt.mkdir()
    (ckpt / ".epoch=0-step=3.ckpt.partial").write_bytes(b"half")
    (ckpt / ".last.ckpt.partial").mkdir()
    (ckpt / "epoch=0-step=2.ckpt").write_bytes(b"kept")
    trainer = L.Trainer(default_root_dir=tmp_path, max_steps=1, accelerator="cpu", logger=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        callbacks=[RunLock(), ModelCheckpoint(dirpath=ckpt, every_n_train_steps=10)])
    trainer.fit(BoringModel())
    assert sorted(p.name for p in ckpt.iterdir()) == ["epoch=0-step=2.ckpt"]  # partials gone, complete kept


def test_a_checkpoint_folder_outside_the_run_dir_is_locked_too(tmp_path, live_pid, record_property):
    """Two fits with different run directories but one ModelCheckpoint.dirpath would both write its last.ckpt."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    shared = tmp_path / "shared_ckpt"
    held = _hold(shared, live_pid)  # the other fit, which took the lock of the shared folder
    trainer = L.Trainer(default_root_dir=tmp_path / "run_b", max_steps=1, accelerator="cpu", logger=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        callbacks=[RunLock(), ModelCheckpoint(dirpath=shared, every_n_train_steps=1)])
    with pytest.raises(ConfigError) as err:
        trainer.fit(BoringModel())
    record_property("hardening", "checkpoint")
    record_property("case", "two fits, two run directories, one ModelCheckpoint.dirpath: the second refused")
    assert str(err.value).startswith(f"`trainer.callbacks.init_args.dirpath={str(shared)!r}`: another fit (pid {live_pid}")
    assert (shared / LOCK_NAME).read_text() == held
    assert not list(shared.glob("*.ckpt")) and not (tmp_path / "run_b" / LOCK_NAME).exists()  # its own lock released


def test_both_folders_are_locked_during_fit_and_released_after(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    seen = []

    class Peek(L.Callback):
        def on_train_start(self, trainer, pl_module):
            seen.extend(p.exists() for p in (tmp_path / "run" / LOCK_NAME, tmp_path / "ckpt" / LOCK_NAME))

    trainer = L.Trainer(default_root_dir=tmp_path / "run", max_steps=1, accelerator="cpu", logger=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        callbacks=[RunLock(), Peek(), ModelCheckpoint(dirpath=tmp_path / "ckpt")])
    trainer.fit(BoringModel())
    assert seen == [True, True]
    assert not (tmp_path / "run" / LOCK_NAME).exists() and not (tmp_path / "ckpt" / LOCK_NAME).exists()
