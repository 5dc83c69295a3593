"""`RunLock`: one fit at a time writes into a run directory (`trainer.default_root_dir`) and its checkpoint folders.

Owns the lock file `<default_root_dir>/.lightning-ffpa.lock` (JSON: pid, host, SLURM job id), and the same file
in each `ModelCheckpoint.dirpath` outside that directory (two runs with different run directories but one
checkpoint folder would overwrite each other's `last.ckpt`), taken by rank 0 when `fit` starts and released
when it ends, and the sweep of partial checkpoints a killed save left in the
run's checkpoint folders (safe once the lock is held: no other writer exists). A second fit into a locked
directory fails on every rank with one line naming `trainer.default_root_dir` (or the checkpoint folder's
option), before it writes anything.
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
CHECKPOINT_OPTION = "trainer.callbacks.init_args.dirpath"  # ModelCheckpoint's folder, as the CLI spells it


def locked_folders(trainer: pl.Trainer) -> list[tuple[str, Path]]:
    """(option, folder) for every folder a fit writes into that needs the lock: the run directory, and each
    ModelCheckpoint folder outside it (the folders inside it are covered by its lock)."""
    root = Path(trainer.default_root_dir)
    out = [(OPTION, root)]
    for cb in trainer.checkpoint_callbacks:
        folder = getattr(cb, "dirpath", None) if isinstance(cb, ModelCheckpoint) else None
        if not folder:
            continue
        folder = Path(folder)
        if not any(folder.resolve().is_relative_to(seen.resolve()) for _, seen in out):
            out.append((CHECKPOINT_OPTION, folder))
    return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def _slurm_restart() -> str:
    """Which attempt of the SLURM job this is: a requeued job starts with the count one higher."""
    return os.environ.get("SLURM_RESTART_COUNT", "0")


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
        self.paths: list[Path] = []
        self._token: str | None = None
        self.took_over: dict[str, Any] | None = None

    def _me(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "host": socket.gethostname(), "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
                "slurm_restart": _slurm_restart(), "token": self._token}

    def _acquire(self, root: Path) -> str | None:
        """Take the lock; returns the reason it is held by another fit, or None."""
        root.mkdir(parents=True, exist_ok=True)
        path = root / LOCK_NAME
        self._token = self._token or uuid.uuid4().hex  # one token for every folder this fit locks
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
                self.paths.append(path)
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
            if held.get("slurm_restart") != _slurm_restart() or pid == os.getpid() or not isinstance(pid, int) or (
                    host == socket.gethostname() and not _alive(pid)):
                return None  # an earlier attempt of this SLURM job (requeued): it is no longer running
            return (f"another task of this SLURM job (pid {pid} on host {host}) is writing into it: each task runs a "
                    "fit of its own where `trainer.devices` x `trainer.num_nodes` is not the job's task count")
        if host == socket.gethostname():
            if pid == os.getpid() or not isinstance(pid, int) or not _alive(pid):
                return None
            return f"another fit (pid {pid} on this host) is writing into it"
        return (f"another fit (pid {pid} on host {host}) may be writing into it; if that run is dead, "
                "delete the lock file")

    def check_free(self, root: str | os.PathLike, option: str = OPTION) -> None:
        """Raise the one-line error `setup` would raise if another fit holds `root`, without taking the lock: the
        CLI asks before `fit` starts, since the logger writes its version folder into `root` before `setup`."""
        path = Path(root) / LOCK_NAME
        reason = self._held_by_other(_read(path))
        if reason is not None:
            raise ConfigError(option, str(root), f"{reason}; lock file {path}")

    def _acquire_all(self, trainer: pl.Trainer) -> tuple[str, str, str] | None:
        """Lock every folder of `locked_folders`; on a refusal release those taken and return (option, folder,
        reason)."""
        for option, folder in locked_folders(trainer):
            reason = self._acquire(folder)
            if reason is not None:
                self._release()
                return option, str(folder), reason
        return None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Take the lock on rank 0 at fit start; every rank raises the same one-line error if it is held."""
        if stage != "fit":
            return
        refused = self._acquire_all(trainer) if trainer.is_global_zero else None
        refused = trainer.strategy.broadcast(refused, src=0)
        if refused is not None:
            raise ConfigError(*refused)
        if self.sweep_partial_checkpoints and trainer.is_global_zero:
            for cb in trainer.checkpoint_callbacks:
                if isinstance(cb, ModelCheckpoint) and cb.dirpath:
                    for p in sweep_partials(cb.dirpath):
                        rank_zero_info(f"RunLock: deleted the partial checkpoint {p} of a killed save")

    def _release(self) -> None:
        for path in self.paths:
            if (_read(path) or {}).get("token") == self._token:
                path.unlink(missing_ok=True)
        self.paths, self._token = [], None

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Release the lock when fit ends."""
        if stage == "fit":
            self._release()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        """Release the lock if fit fails (never one this callback did not take)."""
        self._release()
