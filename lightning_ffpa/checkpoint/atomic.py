"""Atomic checkpoint writes: a checkpoint appears under its final name only once it is complete.

Owns: the temporary name a checkpoint is written under (`.NAME.partial`, in the same directory, so the
final rename never crosses filesystems), publishing it (`os.replace` for files; for DCP folders the old
folder is moved aside, the new one renamed in, the old one deleted), the disk-space pre-flight, and
`AtomicCheckpointIO`, the plain-file CheckpointIO that uses them. Does not own when checkpoints are written
or kept (Lightning's `ModelCheckpoint`: `every_n_train_steps`, `save_top_k`, `save_last`) or DCP folders'
collective writing (`lightning_ffpa.checkpoint.sharded`).

Why not Lightning's `TorchCheckpointIO`: it serialises the whole checkpoint into memory, then writes through
an fsspec transaction whose temporary file lives in the system temp directory; on another filesystem the
final move is a copy, and a disk that fills during that copy leaves a truncated file under the final name.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from fsspec.utils import get_protocol
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.utilities import rank_zero_warn

from lightning_ffpa.errors import ConfigError

__all__ = ["AtomicCheckpointIO", "check_free_space", "checkpoint_bytes", "partial_path", "publish",
           "sweep_partials"]

PARTIAL_SUFFIX = ".partial"
# Headroom over the tensor bytes: pickled metadata, DCP's .metadata, filesystem blocks.
SPACE_MARGIN = 1.05
DISK_OPTION = "ModelCheckpoint.dirpath"  # Lightning fills it from trainer.default_root_dir when unset


def partial_path(final: str | os.PathLike) -> Path:
    """Where `final` is written until it is complete: a hidden sibling that `--ckpt_path last` never matches."""
    final = Path(final)
    return final.parent / f".{final.name}{PARTIAL_SUFFIX}"


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # some filesystems do not open directories; the rename itself is still atomic
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(tmp: str | os.PathLike, final: str | os.PathLike) -> None:
    """Rename the complete `tmp` to `final`, replacing an older checkpoint of that name.

    A file replaces a file (or link) in one `os.replace`. Any other pair (a folder over anything, a file over a
    folder: a resume that changed `save_distributed_checkpoint`) cannot, so the old one is first moved aside to
    `.NAME.old`; a crash between the two renames leaves the old checkpoint there.
    """
    tmp, final = Path(tmp), Path(final)
    if os.path.lexists(final) and (tmp.is_dir() or (final.is_dir() and not final.is_symlink())):
        old = final.parent / f".{final.name}.old"
        discard(old)
        os.replace(final, old)
        os.replace(tmp, final)
        discard(old)
    else:
        os.replace(tmp, final)
    _fsync_dir(final.parent)


def discard(tmp: str | os.PathLike) -> None:
    """Delete a partial or replaced checkpoint: a file, a link (not what it points to) or a folder, if there (best
    effort after a failed save: the save's own error is what matters)."""
    tmp = Path(tmp)
    if tmp.is_dir() and not tmp.is_symlink():
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        tmp.unlink(missing_ok=True)


def sweep_partials(directory: str | os.PathLike) -> list[Path]:
    """Delete partial checkpoints left in `directory` by a killed save; returns what was deleted."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [p for p in directory.iterdir() if p.name.startswith(".") and p.name.endswith(PARTIAL_SUFFIX)]
    for p in found:
        discard(p)
    return found


def checkpoint_bytes(obj: Any) -> int:
    """Bytes of the tensors in a checkpoint (local shards for DTensors): what this process will write."""
    from torch.distributed.tensor import DTensor

    if isinstance(obj, DTensor):
        obj = obj.to_local()
    if torch.is_tensor(obj):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(checkpoint_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(checkpoint_bytes(v) for v in obj)
    return 0


def free_bytes(directory: str | os.PathLike) -> int:
    """Free bytes on the filesystem that holds `directory` (or its nearest existing parent)."""
    path = Path(directory).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


# torch's zip writer reports a failed OS write (a full disk among them) as a RuntimeError with one of these.
_WRITER_FAILED = ("unexpected pos", "failed writing")
NEARLY_FULL = 256 * 2**20  # below this many free bytes, a failed write is taken as a full disk


def out_of_space(err: BaseException, directory: str | os.PathLike) -> bool:
    """Whether `err`, raised while writing under `directory`, means the disk is full: ENOSPC itself, or torch's
    writer failing while the filesystem is (nearly) full. Ask before the partial files are removed."""
    if isinstance(err, OSError) and err.errno == errno.ENOSPC:
        return True
    text = str(err)
    return (isinstance(err, RuntimeError) and any(s in text for s in _WRITER_FAILED)
            and free_bytes(directory) < NEARLY_FULL)


def _gib(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} bytes"


def space_error(directory: str | os.PathLike, needed: int, free: int) -> ConfigError:
    """The one-line error for a checkpoint that will not fit."""
    return ConfigError(DISK_OPTION, str(directory),
                       f"a checkpoint needs about {_gib(needed)} there but only {_gib(free)} is free; free space, "
                       "keep fewer checkpoints (ModelCheckpoint save_top_k) or choose another directory "
                       "(ModelCheckpoint dirpath, or trainer.default_root_dir when dirpath is unset)")


def check_free_space(directory: str | os.PathLike, needed: int) -> None:
    """Raise a one-line ConfigError, before anything is written, if `needed` bytes will not fit."""
    free = free_bytes(directory)
    if free < needed * SPACE_MARGIN:
        raise space_error(directory, needed, free)


class AtomicCheckpointIO(TorchCheckpointIO):
    """`torch.save` to `.NAME.partial` beside the target, fsync, then `os.replace`: never a half-written file.

    Checks free space first. Remote (fsspec URL) paths go through Lightning's own writer. Wrap it in
    Lightning's `AsyncCheckpointIO` to save in a background thread.
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | os.PathLike,
                        storage_options: Any | None = None) -> None:
        """Write `checkpoint` to `path` atomically."""
        if storage_options is not None:
            raise TypeError(f"`{type(self).__name__}` does not take storage_options; got {storage_options!r}")
        if get_protocol(str(path)) != "file":
            rank_zero_warn(f"{path} is not a local path: saved through Lightning's writer, not atomically")
            return super().save_checkpoint(checkpoint, path)
        final = Path(path)
        final.parent.mkdir(parents=True, exist_ok=True)
        check_free_space(final.parent, checkpoint_bytes(checkpoint))
        tmp = partial_path(final)
        try:
            with open(tmp, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            publish(tmp, final)
        except BaseException as err:
            full = out_of_space(err, final.parent)
            discard(tmp)
            if full and not isinstance(err, OSError):
                raise OSError(errno.ENOSPC, f"no space left on device while writing {final.name}", str(final)) from err
            raise
