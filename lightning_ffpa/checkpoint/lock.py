"""`RunLock`: one fit at a time writes into a run directory (`trainer.default_root_dir`).

Owns the lock file `<default_root_dir>/.lightning-ffpa.lock` (JSON: pid, host, SLURM job id), taken by rank 0
when `fit` starts and released when it ends, and the sweep of partial checkpoints a killed save left in the
run's checkpoint folders (safe once the lock is held: no other writer exists). A second fit into a locked
directory fails on every rank with one line naming `trainer.default_root_dir`, before it writes anything.
A lock left by a dead process on this host, or by an earlier attempt of the same SLURM job (a requeue), is
taken over with a warning; a lock from another host cannot be checked and is refused.
Does not own where checkpoints go (`ModelCheckpoint`) or how they are written (`checkpoint.atomic`).
"""

from __future__ import annotations

import json
import os
import socket
import uuid
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lightning_ffpa.checkpoint.atomic import sweep_partials
from lightning_ffpa.errors import ConfigError

__all__ = ["LOCK_NAME", "RunLock"]

LOCK_NAME = ".lightning-ffpa.lock"
OPTION = "trainer.default_root_dir"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def _read(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


class RunLock(pl.Callback):
    """Lock `trainer.default_root_dir` for the duration of `fit`; sweep partial checkpoints once it is held."""

    def __init__(self, sweep_partial_checkpoints: bool = True) -> None:
        """
        Args:
            sweep_partial_checkpoints: delete `.NAME.partial` leftovers of killed saves in the checkpoint folders.
        """
        self.sweep_partial_checkpoints = sweep_partial_checkpoints
        self.path: Path | None = None
        self._token: str | None = None
        self.took_over: dict[str, Any] | None = None

    def _me(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "host": socket.gethostname(), "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
                "token": self._token}

    def _acquire(self, root: Path) -> str | None:
        """Take the lock; returns the reason it is held by another fit, or None."""
        root.mkdir(parents=True, exist_ok=True)
        path = root / LOCK_NAME
        self._token = uuid.uuid4().hex
        me = self._me()
        for _ in range(3):  # create, or replace a stale lock, then re-read to confirm the lock is ours
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                held = _read(path)
                reason = self._held_by_other(held)
                if reason is not None:
                    return f"{reason}; lock file {path}"
                tmp = path.with_name(f"{LOCK_NAME}.{self._token}")
                tmp.write_text(json.dumps(me))
                os.replace(tmp, path)
                self.took_over = held
            else:
                with os.fdopen(fd, "w") as f:
                    f.write(json.dumps(me))
            if (_read(path) or {}).get("token") == self._token:
                self.path = path
                if self.took_over:
                    rank_zero_warn(f"RunLock: took over the stale lock {path} of {self.took_over}")
                return None
        return f"could not take the lock file {path} (another fit is taking it)"

    @staticmethod
    def _held_by_other(held: dict[str, Any] | None) -> str | None:
        if held is None:
            return None  # unreadable or half-written by a killed process: stale
        pid, host, job = held.get("pid"), held.get("host"), held.get("slurm_job_id")
        if job is not None and job == os.environ.get("SLURM_JOB_ID"):
            return None  # an earlier attempt of this SLURM job (requeued): it is no longer running
        if host == socket.gethostname():
            if pid == os.getpid() or not isinstance(pid, int) or not _alive(pid):
                return None
            return f"another fit (pid {pid} on this host) is writing into it"
        return (f"another fit (pid {pid} on host {host}) may be writing into it; if that run is dead, "
                "delete the lock file")

    def check_free(self, root: str | os.PathLike) -> None:
        """Raise the one-line error `setup` would raise if another fit holds `root`, without taking the lock: the
        CLI asks before `fit` starts, since the logger writes its version folder into `root` before `setup`."""
        path = Path(root) / LOCK_NAME
        reason = self._held_by_other(_read(path))
        if reason is not None:
            raise ConfigError(OPTION, str(root), f"{reason}; lock file {path}")

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Take the lock on rank 0 at fit start; every rank raises the same one-line error if it is held."""
        if stage != "fit":
            return
        root = Path(trainer.default_root_dir)
        reason = self._acquire(root) if trainer.is_global_zero else None
        reason = trainer.strategy.broadcast(reason, src=0)
        if reason is not None:
            raise ConfigError(OPTION, str(root), reason)
        if self.sweep_partial_checkpoints and trainer.is_global_zero:
            for cb in trainer.checkpoint_callbacks:
                if isinstance(cb, ModelCheckpoint) and cb.dirpath:
                    for p in sweep_partials(cb.dirpath):
                        rank_zero_info(f"RunLock: deleted the partial checkpoint {p} of a killed save")

    def _release(self) -> None:
        if self.path is not None and (_read(self.path) or {}).get("token") == self._token:
            self.path.unlink(missing_ok=True)
        self.path = None

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Release the lock when fit ends."""
        if stage == "fit":
            self._release()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        """Release the lock if fit fails (never one this callback did not take)."""
        self._release()
