"""Where a run's checkpoints go when the config does not say: `<trainer.default_root_dir>/checkpoints`.

Owns filling in `ModelCheckpoint.dirpath` when it is unset, before `fit` resolves `--ckpt_path last`, so
the shipped configs follow `--trainer.default_root_dir` and a resumed run finds its `last.ckpt`; and listing
the checkpoints a folder already holds, so a fresh fit does not write over an earlier run's. Lightning
itself would put them under the first logger's versioned folder (`.../version_N/checkpoints`), which
changes from run to run, so `last` would not be found on resume. Does not own the loggers' folders
(with no explicit logger, Lightning's default logger writes under `default_root_dir`) or saving.
"""

from __future__ import annotations

import os

from lightning.pytorch.callbacks import ModelCheckpoint

__all__ = ["HPC_PREFIX", "newer_than_hpc", "root_checkpoint_dirs", "saved_checkpoints"]

HPC_PREFIX = "hpc_ckpt_"  # Lightning's SLURM checkpoints in default_root_dir: hpc_ckpt_N.ckpt


def root_checkpoint_dirs(trainer) -> list[str]:
    """Set `dirpath = <default_root_dir>/checkpoints` on every ModelCheckpoint without one; returns those set."""
    set_now = []
    for cb in trainer.checkpoint_callbacks:
        if isinstance(cb, ModelCheckpoint) and cb.dirpath is None:
            cb.dirpath = os.path.realpath(os.path.join(trainer.default_root_dir, "checkpoints"))
            set_now.append(cb.dirpath)
    return set_now


def saved_checkpoints(trainer) -> list[str]:
    """The checkpoints (`*.ckpt` files and links, DCP folders) already in the ModelCheckpoint folders, newest first."""
    found = []
    for cb in trainer.checkpoint_callbacks:
        folder = getattr(cb, "dirpath", None)
        if isinstance(cb, ModelCheckpoint) and folder and os.path.isdir(folder):
            found += [e for e in os.scandir(folder) if e.name.endswith(".ckpt")]
    found.sort(key=lambda e: _saved_at(e.path), reverse=True)
    return [e.path for e in found]


def _saved_at(path: str) -> float:
    """When a checkpoint's content was written: a `save_last: link` link's target's time. The link itself is made
    again whenever `last` is refreshed (at the end of every fit), after an HPC checkpoint of a later step."""
    try:
        return os.stat(path).st_mtime
    except FileNotFoundError:  # a dangling link
        return os.lstat(path).st_mtime


def newer_than_hpc(trainer, resolved: str | os.PathLike | None) -> str | None:
    """The newest saved checkpoint when `resolved` is an HPC checkpoint (`hpc_ckpt_N.ckpt`, which Lightning takes
    first under SLURM) older than it, else None. Lightning never removes an HPC checkpoint, so a later job in the
    same folder would go back to the step of an old requeue and train over the checkpoints saved since."""
    if resolved is None or not os.path.basename(str(resolved)).startswith(HPC_PREFIX):
        return None
    saved = saved_checkpoints(trainer)
    if saved and _saved_at(saved[0]) > _saved_at(str(resolved)):
        return saved[0]
    return None
