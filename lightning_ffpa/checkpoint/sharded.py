"""Sharded (DCP) checkpoint folders written atomically, optionally in the background, by every rank.

Owns how `FSDP2Strategy` writes a checkpoint folder: each rank writes its own shard file through
`torch.distributed.checkpoint` into `.NAME.partial`, rank 0 adds Lightning's non-tensor state, and the folder
is renamed to NAME only once every rank's shard and the `.metadata` are on disk. Before writing, each host's
free space is checked against the bytes its ranks will write (params + optimizer states). With
`async_save`, tensors are copied to CPU on the caller's thread and written by `dcp.async_save` in the
background; the rename, and the deletion of checkpoints `ModelCheckpoint` retired meanwhile, happen when
the write completes, so a failed background save never costs an older checkpoint.
Does not own the folder layout Lightning reads back (`ModelParallelStrategy.load_checkpoint`) or when
checkpoints are written (`ModelCheckpoint`).
"""

from __future__ import annotations

import errno
import os
import socket
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities import rank_zero_info

from lightning_ffpa._compat import lightning as lightning_compat
from lightning_ffpa.checkpoint.atomic import (
    SPACE_MARGIN,
    checkpoint_bytes,
    discard,
    free_bytes,
    out_of_space,
    partial_path,
    publish,
    space_error,
)

__all__ = ["ShardedCheckpointWriter"]


def _split(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """The tensor part DCP writes (Lightning's layout: `state_dict`, `optimizer_0`, ...); leaves the rest."""
    state = {"state_dict": checkpoint.pop("state_dict")}
    state.update({f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
    return state


class ShardedCheckpointWriter:
    """Writes Lightning checkpoints as DCP folders for a strategy; one instance per strategy."""

    def __init__(self, async_save: bool = False) -> None:
        """
        Args:
            async_save: write in the background with `dcp.async_save` (one save in flight at a time).
        """
        self.async_save = async_save
        self._pending: Future | None = None
        self._finished = threading.Event()  # rank 0: the pending save is published (or failed)
        self._finished.set()
        self._error: BaseException | None = None
        self._retired: list[Path] = []  # removals that wait for the pending save to be published
        self._lock = threading.Lock()
        self._group: Any = None
        self.num_saved = 0

    # -- saving ------------------------------------------------------------------------------------------
    def save(self, strategy: Any, checkpoint: dict[str, Any], filepath: str | os.PathLike) -> None:
        """Collective: every rank calls it with its shard of `checkpoint`."""
        path = Path(strategy.broadcast(str(filepath)))
        self.wait()  # at most one save in flight; raises a failed background save's error here
        state = _split(checkpoint)
        self._check_space(strategy, path.parent, checkpoint_bytes(state))
        tmp = partial_path(path)
        if strategy.global_rank == 0:  # an older `path` stays until publish: it is the last good checkpoint
            discard(tmp)
            tmp.mkdir(parents=True)
            torch.save(checkpoint, tmp / lightning_compat.lightning_dcp_meta_filename())  # loops, hparams, callbacks
        strategy.barrier("ffpa_dcp_partial_ready")
        import torch.distributed.checkpoint as dcp

        if not self.async_save:
            try:
                dcp.save(state, checkpoint_id=str(tmp))
            except BaseException as err:
                full = _disk_full(err, tmp)
                if strategy.global_rank == 0:
                    discard(tmp)
                if full is not None:
                    raise full from err
                raise
            strategy.barrier("ffpa_dcp_written")
            if strategy.global_rank == 0:
                publish(tmp, path)
                self.num_saved += 1
            strategy.barrier("ffpa_dcp_published")
            return
        group = self._background_group()
        if strategy.global_rank == 0:
            self._finished.clear()
        future = dcp.async_save(state, checkpoint_id=str(tmp), process_group=group)
        if strategy.global_rank == 0:
            # DCP's finish step gathers every rank's write result before rank 0 writes `.metadata`,
            # so when rank 0's future is done, all shards are on disk.
            future.add_done_callback(lambda f: self._finish(f, tmp, path))
        self._pending = future

    def _finish(self, future: Future, tmp: Path, path: Path) -> None:
        with self._lock:
            retired, self._retired = self._retired, []
            try:
                future.result()
                publish(tmp, path)
                self.num_saved += 1
            except BaseException as err:  # noqa: BLE001 - re-raised on the training thread by `wait`
                self._error = _disk_full(err, tmp) or err
                discard(tmp)
                retired = []  # keep the checkpoints it would have replaced
            finally:
                self._finished.set()
            for old in retired:
                _remove(old)

    def wait(self) -> None:
        """Block until the background save (if any) is written and published; raise its error."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            try:
                pending.result()
            except BaseException as err:  # noqa: BLE001
                self._error = self._error or err
        self._finished.wait()  # rank 0: the done-callback has published (or discarded) the folder
        with self._lock:
            error, self._error = self._error, None
        if error is not None:
            raise error

    def _background_group(self) -> Any:
        # The background thread runs collectives; on their own gloo group they never interleave with the
        # training thread's (and async_save needs a CPU backend even when training uses NCCL).
        if self._group is None:
            self._group = dist.new_group(backend="gloo")
        return self._group

    def _check_space(self, strategy: Any, directory: Path, local: int) -> None:
        """Every rank learns whether every host has room for its ranks' shards (same decision everywhere)."""
        mine = (socket.gethostname(), local, free_bytes(directory))
        if dist.is_available() and dist.is_initialized():
            everyone: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, mine)
        else:
            everyone = [mine]
        hosts: dict[str, list[int]] = {}
        for host, needed, free in everyone:
            entry = hosts.setdefault(host, [0, free])
            entry[0] += needed
            entry[1] = min(entry[1], free)
        for needed, free in hosts.values():
            if free < needed * SPACE_MARGIN:
                raise space_error(directory, needed, free)

    # -- retention -----------------------------------------------------------------------------------------
    def remove(self, strategy: Any, filepath: str | os.PathLike) -> None:
        """Delete a retired checkpoint (rank 0); while a background save is in flight, after it is published."""
        if strategy.global_rank != 0:
            return
        path = Path(filepath)
        with self._lock:
            if not self._finished.is_set():
                self._retired.append(path)
                return
        _remove(path)


def _disk_full(err: BaseException, folder: Path) -> OSError | None:
    """DCP reports every rank's failure inside one CheckpointException; surface a full disk as ENOSPC (one line).
    Call before `folder` (the partial checkpoint) is removed: that frees the space the check looks at."""
    failures = getattr(err, "failures", None) or {}
    for rank, failure in sorted(failures.items()):
        failure = failure[0] if isinstance(failure, tuple) else failure  # (exception, traceback summary)
        if isinstance(failure, BaseException) and out_of_space(failure, folder):
            return OSError(errno.ENOSPC, f"no space left on device while rank {rank} wrote its shard",
                           getattr(failure, "filename", None) or str(folder))
    return None


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        import shutil

        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink()
    rank_zero_info(f"removed checkpoint {path}")
