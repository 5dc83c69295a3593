"""Activation checkpointing for decoder layers: full, or selective (SAC) with an FFPA-aware save policy.

Owns the op lists, the policy and the layer wrapper. Which layers get wrapped is `fsdp.parallelize`'s job.

The save policy (selective mode):
- MUST_SAVE attention forwards (the FFPA custom ops, the flex_attention HOP, the SDPA fused ops), so a
  layer's attention runs once per step, and reduce-scatter (never redo communication);
- matmuls by a counting rule: with `save_mm="every_other"` the 2nd, 4th, ... mm/addmm of one layer
  invocation are saved and the others recomputed (torchtitan's trade-off: halves matmul recompute for
  half the matmul activations); `"all"` saves every matmul, `"none"` none;
- everything else (norms, rope, activations, casts) is recomputed: cheap elementwise work.
torch >= 2.11 calls the policy in the recompute pass too (`ctx.is_recompute`). The matmul counter is
kept separately per pass and reset for every layer invocation, so both passes see the same op
sequence and give the same answers.
"""

from __future__ import annotations

from collections import defaultdict
from functools import partial
from typing import Literal

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from lightning_ffpa.parallel._shim import checkpoint_wrapper

__all__ = ["default_save_ops", "resolve_op", "sac_policy", "sac_context_fn", "apply_activation_checkpointing"]

ACMode = Literal["none", "full", "selective"]
SaveMM = Literal["every_other", "all", "none"]

_SDPA_FORWARDS = (
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_fused_attention_overrideable",
)
_MM_OPS = ("mm", "addmm", "_grouped_mm")


def _ffpa_forward_ops() -> tuple:
    """The FFPA forward OpOverloads that exist in this process (attention package owns the list)."""
    try:
        from lightning_ffpa.attention.kernels import FFPA_FORWARD_OPS
    except ImportError:
        return ()
    return tuple(FFPA_FORWARD_OPS)


def default_save_ops() -> set:
    """FFPA forwards, the flex_attention HOP, SDPA fused forwards and reduce-scatter."""
    ops: set = set(_ffpa_forward_ops())
    ops.add(torch.ops.higher_order.flex_attention)
    for name in _SDPA_FORWARDS:
        packet = getattr(torch.ops.aten, name, None)
        if packet is not None:
            ops.add(packet.default)
    ops.add(torch.ops._c10d_functional.reduce_scatter_tensor.default)
    return ops


def _mm_ops() -> set:
    return {getattr(torch.ops.aten, n).default for n in _MM_OPS if hasattr(torch.ops.aten, n)}


def resolve_op(name: str):
    """Turn "aten.mm.default" / "ffpa_attn._fwd_cute.default" / "higher_order.flex_attention" into the op."""
    parts = name.split(".")
    if len(parts) < 2:
        raise ValueError(f"`sac_extra_save_ops` entry {name!r} is not 'namespace.op[.overload]'")
    try:
        obj = getattr(torch.ops, parts[0])
        for part in parts[1:]:
            obj = getattr(obj, part)
    except (AttributeError, RuntimeError) as e:
        raise ValueError(f"`sac_extra_save_ops` entry {name!r} is not a registered torch op "
                         f"(is the library that defines it imported?)") from e
    if isinstance(obj, torch._ops.OpOverloadPacket):
        obj = obj.default  # "aten.mm" means its default overload
    if not isinstance(obj, (torch._ops.OpOverload, torch._ops.HigherOrderOperator)):
        raise ValueError(f"`sac_extra_save_ops` entry {name!r} resolved to {obj!r}, not an op overload")
    return obj


def sac_policy(meta: dict, save_ops: frozenset, mm_ops: frozenset, save_mm: SaveMM, ctx, op, *args, **kwargs):
    """Selective-checkpoint decision for one op; `meta` is fresh for every layer invocation."""
    if op in save_ops:
        return CheckpointPolicy.MUST_SAVE
    if op in mm_ops:
        key = "recompute_mm" if ctx.is_recompute else "forward_mm"
        meta[key] += 1
        if save_mm == "all" or (save_mm == "every_other" and meta[key] % 2 == 0):
            return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def sac_context_fn(extra_save_ops: list[str] | tuple[str, ...] = (), save_mm: SaveMM = "every_other"):
    """A `context_fn` for torch checkpoint; resolves op names now so typos fail before training."""
    if save_mm not in ("every_other", "all", "none"):
        raise ValueError(f"`sac_save_mm={save_mm!r}` is not one of 'every_other', 'all', 'none'")
    save_ops = frozenset(default_save_ops() | {resolve_op(n) for n in extra_save_ops})
    mm_ops = frozenset(_mm_ops())

    def context_fn():
        return create_selective_checkpoint_contexts(partial(sac_policy, defaultdict(int), save_ops, mm_ops, save_mm))

    context_fn.save_ops = save_ops  # for inspection / tests
    return context_fn


def apply_activation_checkpointing(layer: torch.nn.Module, mode: ACMode, context_fn=None) -> torch.nn.Module:
    """Return `layer` wrapped for `mode` ("none" returns it unchanged)."""
    if mode == "none":
        return layer
    if mode == "full":
        return checkpoint_wrapper(layer)
    if mode == "selective":
        return checkpoint_wrapper(layer, context_fn=context_fn or sac_context_fn())
    raise ValueError(f"`activation_checkpointing={mode!r}` is not one of 'none', 'full', 'selective'")
