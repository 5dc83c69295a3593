"""The one place this package touches private torch APIs (DeviceMesh flattening, checkpoint_wrapper).

Owns version guards only; callers import from here so a torch upgrade breaks one file.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["flatten_mesh", "checkpoint_wrapper"]


def flatten_mesh(mesh: DeviceMesh, name: str) -> DeviceMesh:
    """One 1D mesh over all dims of `mesh` (used for FSDP over dp x cp)."""
    if mesh.ndim == 1:
        return mesh
    # DeviceMesh._flatten is private (torch >= 2.6) but is what torchtitan uses for dp_shard_cp.
    if not hasattr(mesh, "_flatten"):
        raise RuntimeError(f"torch {torch.__version__} has no DeviceMesh._flatten; need torch >= 2.6")
    return mesh[tuple(mesh.mesh_dim_names)]._flatten(name)


def checkpoint_wrapper(module: torch.nn.Module, **checkpoint_kwargs) -> torch.nn.Module:
    """Wrap `module` in non-reentrant activation checkpointing (torch's private wrapper module)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper as _wrap

    return _wrap(module, **checkpoint_kwargs)
