"""Private and version-dependent torch surfaces (checked on torch 2.11 and 2.13).

Owns DeviceMesh flattening, DTensor RNG support and local parts, the checkpoint wrapper, dynamo config knobs
and helpers, op-overload types, the autograd graph-task check, `BlockMask.from_kv_blocks` keyword drift, the
DCP reader/writer internals and the float8 `_scaled_mm`.
Does not own what they are used for: callers import these names so a torch upgrade breaks only this file.
"""

from __future__ import annotations

import inspect
import logging
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch._dynamo
from torch._ops import HigherOrderOperator, OpOverload, OpOverloadPacket
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.attention.flex_attention import BlockMask

__all__ = [
    "HigherOrderOperator",
    "OpOverload",
    "OpOverloadPacket",
    "all_to_all_autograd",
    "allow_checkpoint_side_effects_under_compile",
    "assume_constant_result",
    "block_mask_from_kv_blocks",
    "checkpoint_wrapper",
    "dispatch_mode_active",
    "dtensor_rng_spans_shards",
    "dynamo_counters",
    "without_wrapper_levels",
    "flatten_mesh",
    "grouped_mm",
    "grouped_mm_runs",
    "HAS_GROUPED_MM",
    "hf_storage_writer",
    "in_backward",
    "local_part",
    "load_dcp_keys",
    "on_recompile_limit_hit",
    "raise_recompile_limit",
    "read_dcp_metadata",
    "scaled_mm",
    "scale_local_grads_",
    "without_dispatch_modes",
]

# Mark a per-process constant so dynamo does not trace the call (it graph-breaks compiled layers otherwise).
assume_constant_result = torch._dynamo.assume_constant_result


def in_backward() -> bool:
    """True while autograd's engine runs a backward: a forward run now is an activation-checkpoint recompute."""
    # torch.utils.checkpoint uses the same private check (-1 outside a backward graph task).
    return torch._C._current_graph_task_id() != -1


def dynamo_counters() -> dict[str, Any]:
    """dynamo's process-wide event counters (graph breaks, recompiles), keyed by category."""
    import torch._dynamo.utils

    return torch._dynamo.utils.counters


# --------------------------------------------------------------------------- distributed


def flatten_mesh(mesh: DeviceMesh, name: str, dims: tuple[str, ...] | None = None) -> DeviceMesh:
    """One 1D mesh named `name` over the dims `dims` of `mesh` (all of them by default), reachable afterwards as
    `mesh[name]` (used for FSDP over dp x cp, and for dp over the dims that expert parallelism splits it into)."""
    if mesh.ndim == 1:
        return mesh
    dims = tuple(mesh.mesh_dim_names) if dims is None else dims
    if len(dims) == 1:
        return mesh[dims[0]]
    # DeviceMesh._flatten is private (torch >= 2.6) but is what torchtitan uses for dp_shard_cp.
    if not hasattr(mesh, "_flatten"):
        raise RuntimeError(f"torch {torch.__version__} has no DeviceMesh._flatten; need torch >= 2.6")
    return mesh[dims]._flatten(name)


def all_to_all_autograd(x: torch.Tensor, output_splits: list[int], input_splits: list[int], group: Any) -> torch.Tensor:
    """All-to-all of `x`'s rows (`input_splits` rows to each rank, `output_splits` from each) whose backward sends
    the gradient back the same way. The public `torch.distributed.nn.functional.all_to_all_single` is deprecated
    (torch 2.13 warns on every call) in favour of this functional collective, which is private."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    return all_to_all_single_autograd(x, output_splits, input_splits, group)


def dtensor_rng_spans_shards(param: torch.Tensor) -> bool:
    """Whether a random op on the DTensor `param` gives each shard its own part of one random stream (torch's
    offset-based RNG tracker, on CUDA-like devices). Elsewhere (a CPU mesh, or shards offloaded to CPU) each rank
    fills its shard from its own generator, so ranks seeded alike draw the same values for every shard."""
    from torch.distributed.tensor._random import is_rng_supported_mesh

    mesh = param.device_mesh
    if param.to_local().device.type != mesh.device_type:  # the tracker steps the mesh device's generator only
        return False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # it warns on every mesh it answers False for
        return is_rng_supported_mesh(mesh)


def local_part(whole: torch.Tensor, dtensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of `whole`, split as the DTensor `dtensor` is (a view of `whole`, on its device: unlike
    `distribute_tensor`, nothing moves to the mesh's device and no rank communicates)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(dtensor.shape, dtensor.device_mesh, dtensor.placements)
    return whole[tuple(slice(start, start + size) for start, size in zip(offset, shape))]


# The module levels torch's activation-checkpoint wrapper and torch.compile insert into parameter names.
WRAPPER_LEVELS = ("_checkpoint_wrapped_module", "_orig_mod")


def without_wrapper_levels(name: str) -> str:
    """`name` (a parameter, buffer or module path) as the unwrapped module spells it."""
    return ".".join(part for part in name.split(".") if part not in WRAPPER_LEVELS)


def checkpoint_wrapper(module: torch.nn.Module, **checkpoint_kwargs) -> torch.nn.Module:
    """Wrap `module` in non-reentrant activation checkpointing (torch's private wrapper module)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper as _wrap

    return _wrap(module, **checkpoint_kwargs)


# --------------------------------------------------------------------------- dynamo config


def allow_checkpoint_side_effects_under_compile() -> bool:
    """Let dynamo compile checkpointed layers whose forward mutates a dict captured from outside.

    The SAC policy's per-invocation op counter is such a dict; without this flag dynamo graph-breaks the
    whole checkpoint region back to eager ("HOP: Unsafe side effect", graph-break site gb0067). The
    mutation only matters in forward, so not replaying it in the recompute is correct here.
    Returns False on torch versions without the flag.
    """
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


class _RecompileLimitFilter(logging.Filter):
    """Calls each `hook(function, limit)` on dynamo's one "hit config.<limit>" warning; passes on what the user's
    logging settings would have emitted anyway (`user_enabled`: the logger's own `isEnabledFor`)."""

    def __init__(self, user_enabled: Callable[[int], bool]) -> None:
        super().__init__()
        self.user_enabled, self.hooks = user_enabled, []

    def filter(self, record: logging.LogRecord) -> bool:
        # torch 2.11 and 2.13 log this once per code object when they stop compiling it (convert_frame.py):
        # args = (limit name, limit value, "'fn' (file:line)", last recompile reason, url).
        if isinstance(record.msg, str) and record.msg.startswith("torch._dynamo hit config.") and record.args:
            args = record.args if isinstance(record.args, tuple) else (record.args,)
            function, limit = str(args[2]) if len(args) > 2 else "?", f"{args[0]}={args[1]}" if len(args) > 1 else "?"
            for hook in self.hooks:
                hook(function, limit)
        return self.user_enabled(record.levelno)


def on_recompile_limit_hit(hook: Callable[[str, str], None]) -> None:
    """Call `hook(function, "limit=value")` whenever dynamo gives up compiling a function (idempotent per hook).

    Past `recompile_limit` graphs per code object (or `accumulated_recompile_limit` in all) dynamo runs that
    function eagerly for the rest of the process, saying so in one log line only; there is no public event.
    The logger makes its WARNING records even where the user silenced dynamo's logs (`TORCH_LOGS`, `setLevel`),
    so the hooks still run; those records reach handlers only where the user's settings let them.
    """
    logger = logging.getLogger("torch._dynamo.convert_frame")
    watch = next((f for f in logger.filters if isinstance(f, _RecompileLimitFilter)), None)
    if watch is None:
        watch = _RecompileLimitFilter(logger.isEnabledFor)
        logger.isEnabledFor = lambda level: level >= logging.WARNING or watch.user_enabled(level)
        logger.addFilter(watch)
    if hook not in watch.hooks:
        watch.hooks.append(hook)


# --------------------------------------------------------------------------- flex attention

# Read once at import: a compiled decode step traces `block_mask_from_kv_blocks`, and a plain module
# constant keeps inspect/functools.cache out of the traced code.
_HAS_COMPUTE_Q_BLOCKS = "compute_q_blocks" in inspect.signature(BlockMask.from_kv_blocks).parameters


def block_mask_from_kv_blocks(*args: Any, compute_q_blocks: bool = True, **kwargs: Any) -> BlockMask:
    """`BlockMask.from_kv_blocks`, dropping `compute_q_blocks` on torch versions without it."""
    if _HAS_COMPUTE_Q_BLOCKS:
        kwargs["compute_q_blocks"] = compute_q_blocks
    return BlockMask.from_kv_blocks(*args, **kwargs)


# --------------------------------------------------------------------------- distributed checkpoints
# torch 2.13 (CPU CI) and 2.11 (GPU image) both have `_load_state_dict_from_keys` and
# `HuggingFaceStorageWriter`; the writer's keyword arguments changed across releases.


def load_dcp_keys(path: str, keys: set[str]) -> dict[str, Any]:
    """Read only `keys` of a DCP checkpoint into CPU tensors, in this process, without a process group."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message="torch.distributed is .*unavailable or uninitialized")
        return _load_state_dict_from_keys(keys, checkpoint_id=path)


def read_dcp_metadata(path: str) -> Any:
    """The `Metadata` of a DCP folder (tensor shapes/dtypes per key, and where each chunk is stored)."""
    from torch.distributed.checkpoint import FileSystemReader

    return FileSystemReader(path).read_metadata()


def hf_storage_writer(path: str, **kwargs: Any) -> Any:
    """`HuggingFaceStorageWriter(path, **kwargs)`; a keyword this torch version does not take is an error naming it."""
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    accepted = inspect.signature(HuggingFaceStorageWriter.__init__).parameters
    dropped = sorted(k for k in kwargs if k not in accepted)
    if dropped:
        raise TypeError(f"torch {torch.__version__} HuggingFaceStorageWriter does not accept {dropped}")
    return HuggingFaceStorageWriter(path, **kwargs)


def dispatch_mode_active() -> bool:
    """True inside a TorchDispatchMode (an eager SAC region, its replay in backward, or a user's mode)."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    return _get_current_dispatch_mode() is not None


def without_dispatch_modes():
    """A context that sets the active TorchDispatchModes aside (they come back on exit)."""
    from torch.utils._python_dispatch import _disable_current_modes

    return _disable_current_modes()


# --------------------------------------------------------------------------- float8 matmul


def scaled_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
              out_dtype: torch.dtype) -> torch.Tensor:
    """`torch._scaled_mm` (private; FP8 tensor cores, CUDA capability >= 8.9): (a * scale_a) @ (b * scale_b).

    Rowwise scaling: `a` (M, K) row-major float8 with `scale_a` (M, 1) fp32, `b` (K, N) column-major float8 with
    `scale_b` (1, N) fp32, K and N multiples of 16, `out_dtype` bfloat16."""
    return torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)



# --------------------------------------------------------------------------- grouped GEMM

# The public `F.grouped_mm` where torch has it, else the older private `torch._grouped_mm` (both take `offs`).
_GROUPED_MM = getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
HAS_GROUPED_MM = _GROUPED_MM is not None


def grouped_mm_runs(dtype: torch.dtype) -> bool:
    """Whether `grouped_mm` can take `dtype` here: torch's meta function, which dynamo traces with, takes bf16 only,
    while the eager kernels fall back for other dtypes (transformers' MoE makes the same check)."""
    return HAS_GROUPED_MM and (dtype == torch.bfloat16 or not torch.compiler.is_compiling())


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """x (N, K) with rows grouped by `offs` (G,) int32 group ends, group g through w[g] (G, K, M): (N, M)."""
    return _GROUPED_MM(x, w, offs=offs)


def scale_local_grads_(grads: list[torch.Tensor], scale: torch.Tensor) -> None:
    """Multiply gradients in place by a 0-dim tensor (no host sync): a DTensor's local shard, one fused
    `_foreach_mul_` per dtype."""
    local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
    for dtype in {g.dtype for g in local}:
        same = [g for g in local if g.dtype == dtype]
        torch._foreach_mul_(same, scale.to(same[0].device))
