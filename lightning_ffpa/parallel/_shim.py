"""The one place this package touches private torch APIs (DeviceMesh flattening, checkpoint_wrapper).

Owns version guards only; callers import from here so a torch upgrade breaks one file.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["flatten_mesh", "checkpoint_wrapper", "allow_checkpoint_side_effects_under_compile", "raise_recompile_limit"]


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


def allow_checkpoint_side_effects_under_compile() -> bool:
    """Let dynamo compile checkpointed layers whose forward mutates a dict captured from outside.

    The SAC policy's per-invocation op counter is such a dict; without this flag dynamo graph-breaks the
    whole checkpoint region back to eager ("HOP: Unsafe side effect", graph-break site gb0067). The
    mutation only matters in forward, so not replaying it in the recompute is correct here.
    Returns False on torch versions without the flag.
    """
    import torch._dynamo

    if not hasattr(torch._dynamo.config, "skip_fwd_side_effects_in_bwd_under_checkpoint"):
        return False
    torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
    return True


def raise_recompile_limit(limit: int = 64) -> None:
    """Let dynamo keep `limit` graphs per code object (the config was renamed across torch versions).

    Past the limit dynamo silently runs a frame eagerly; Gemma4's layer variants (sliding/full, KV-shared)
    times a few sequence lengths pass the default of 8.
    """
    cfg = torch._dynamo.config
    name = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
    setattr(cfg, name, max(getattr(cfg, name), limit))
