"""The one place that touches private torch / Lightning checkpoint APIs; a version upgrade breaks only here.

torch 2.13 (CPU CI) and 2.11 (GPU image) both have `_load_state_dict_from_keys` and
`HuggingFaceStorageWriter`; the writer's keyword arguments changed across releases, so it is built
checking the kwargs against its signature (an unknown one is an error naming it, never silently dropped). Lightning's `ckpt_path` resolution ("last", "hpc") is private too.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch


def load_dcp_keys(path: str, keys: set[str]) -> dict[str, Any]:
    """Read only `keys` of a DCP checkpoint into CPU tensors, in this process, without a process group."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    return _load_state_dict_from_keys(keys, checkpoint_id=path)


def read_dcp_metadata(path: str) -> Any:
    """The `Metadata` of a DCP folder (tensor shapes/dtypes per key, and where each chunk is stored)."""
    from torch.distributed.checkpoint import FileSystemReader

    return FileSystemReader(path).read_metadata()


def hf_storage_writer(path: str, **kwargs: Any) -> Any:
    """`HuggingFaceStorageWriter(path, **kwargs)`, dropping kwargs this torch version does not take."""
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    accepted = inspect.signature(HuggingFaceStorageWriter.__init__).parameters
    dropped = sorted(k for k in kwargs if k not in accepted)
    if dropped:
        raise TypeError(f"torch {torch.__version__} HuggingFaceStorageWriter does not accept {dropped}")
    return HuggingFaceStorageWriter(path, **kwargs)


def resolve_ckpt_path(trainer: Any, ckpt_path: str | None) -> str | None:
    """What `trainer.fit(ckpt_path=...)` will load: resolves "last", "hpc", "best" and SLURM auto-resume."""
    from lightning.pytorch.trainer.states import TrainerFn

    connector = trainer._checkpoint_connector
    return connector._parse_ckpt_path(TrainerFn.FITTING, ckpt_path, model_provided=True, model_connected=False)


def lightning_dcp_meta_filename() -> str:
    """File in a Lightning DCP folder that holds the non-tensor state (loops, hparams, callbacks)."""
    from lightning.fabric.strategies.model_parallel import _METADATA_FILENAME

    return _METADATA_FILENAME
