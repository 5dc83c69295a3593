"""Activation checkpointing for decoder layers: full, or selective (SAC) with an FFPA-aware save policy.

Owns the op lists, the policy and the layer wrapper. Which layers get wrapped is `fsdp.parallelize`'s job;
which custom attention kernels exist is the attention package's: it declares their forwards in
`lightning_ffpa.saved_ops` when it is installed, so this package imports nothing from `lightning_ffpa.attention`.

The save policy (selective mode):
- MUST_SAVE attention forwards (the registered custom ops such as FFPA's, the flex_attention HOP, the SDPA
  fused ops), so a layer's attention runs once per step, and reduce-scatter (never redo communication);
- matmuls by a documented rule (`save_mm`):
  - `"high_k"` (default): save a matmul iff its reduction dim K is larger than the layer's width
    (the residual-stream width, read from the layer). Saving an (M, N) output costs M*N elements and
    spares 2*M*N*K recompute FLOPs, so K is the FLOPs bought per saved byte: the projections back into
    the residual stream (o_proj, down_proj: K = heads*head_dim, intermediate) are worth the most, and
    q/k/v/gate/up (K = width) are recomputed. On the Gemma4-31B shapes it saves fewer matmul bytes per
    layer than `"every_other"` for a little more recompute (benchmarks/sac_accounting.py counts both,
    benchmarks/results/sac_accounting.json); these activations are what FSDP does not shard;
  - `"every_other"`: the 2nd, 4th, ... mm of one layer invocation (torchtitan's counting trade-off);
  - `"all"` saves every matmul, `"none"` none;
- with FP8 (`fsdp.parallelize(fp8=...)`), the float8 casts' amax reductions (`lightning_ffpa.parallel.fp8` states
  the rule), passed in as extra save ops;
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

from lightning_ffpa import saved_ops
from lightning_ffpa._compat.torch import HigherOrderOperator, OpOverload, OpOverloadPacket, checkpoint_wrapper

__all__ = ["AC_MODES", "check_ac_mode", "default_save_ops", "resolve_op", "sac_policy", "sac_context_fn", "apply_activation_checkpointing",
           "layer_width", "mm_reduction_dim", "SAVE_MM_RULES"]

ACMode = Literal["none", "full", "selective"]
AC_MODES = ("none", "full", "selective")
SaveMM = Literal["high_k", "every_other", "all", "none"]
SAVE_MM_RULES = ("high_k", "every_other", "all", "none")

_SDPA_FORWARDS = (
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_fused_attention_overrideable",
)
_MM_OPS = ("mm", "addmm", "_grouped_mm", "_scaled_mm")  # _scaled_mm: the float8 LoRA base's forward


def default_save_ops() -> set:
    """Declared custom forwards (FFPA, `saved_ops`), the flex_attention HOP, SDPA fused forwards, reduce-scatter."""
    ops: set = set(saved_ops.registered())
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
    """Turn "aten.mm.default" / "lightning_ffpa.ref_dense_fwd" / "higher_order.flex_attention" into the op."""
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
    if isinstance(obj, OpOverloadPacket):
        obj = obj.default  # "aten.mm" means its default overload
    if not isinstance(obj, (OpOverload, HigherOrderOperator)):
        raise ValueError(f"`sac_extra_save_ops` entry {name!r} resolved to {obj!r}, not an op overload")
    return obj


def mm_reduction_dim(op, args) -> int:
    """K of a matmul op call: mm(a, b) / _grouped_mm(a, b, ...) reduce a's last dim, addmm(c, a, b) a's."""
    a = args[1] if op is torch.ops.aten.addmm.default else args[0]
    return int(a.shape[-1])


def _linear_like(m: torch.nn.Module) -> bool:
    """An nn.Linear, or a module that owns a 2-D `weight` and says its `in_features` (a float8 base)."""
    weight = m._parameters.get("weight")
    return isinstance(m, torch.nn.Linear) or (isinstance(getattr(m, "in_features", None), int)
                                               and weight is not None and weight.dim() == 2)


def layer_width(layer: torch.nn.Module) -> int:
    """The residual-stream width of a decoder layer: the `in_features` most of its linear layers share (nn.Linear,
    and a float8 LoRA base, which is no nn.Linear: without it the adapters' B widths, r, would outnumber the rest)."""
    widths = [m.in_features for m in layer.modules() if _linear_like(m)]
    if not widths:
        raise ValueError(f"`sac_save_mm='high_k'` needs nn.Linear modules to find the width of {type(layer).__name__}")
    return max(set(widths), key=widths.count)


def sac_policy(meta: dict, save_ops: frozenset, mm_ops: frozenset, save_mm: SaveMM, ctx, op, *args,
               width: int | None = None, **kwargs):
    """Selective-checkpoint decision for one op; `meta` is fresh for every layer invocation.

    Every answer depends only on the op, its argument shapes and its position among the invocation's
    matmuls, so the forward and the recompute pass (same op sequence) get the same answers.
    """
    if op in save_ops:
        return CheckpointPolicy.MUST_SAVE
    if op in mm_ops:
        key = "recompute_mm" if ctx.is_recompute else "forward_mm"
        meta[key] += 1
        if save_mm == "all" or (save_mm == "every_other" and meta[key] % 2 == 0):
            return CheckpointPolicy.MUST_SAVE
        if save_mm == "high_k" and width is not None and mm_reduction_dim(op, args) > width:
            return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def sac_context_fn(extra_save_ops: list[str] | tuple[str, ...] = (), save_mm: SaveMM = "every_other",
                   width: int | None = None):
    """A `context_fn` for torch checkpoint; resolves op names now so typos fail before training.

    `save_mm="high_k"` (the default of `parallelize` and `FSDP2Strategy`) needs the layer `width`:
    pass it, or let `apply_activation_checkpointing` bind it per layer (`context_fn.for_layer(layer)`).
    This function's own default is `"every_other"` because a bare checkpointed function has no width.
    """
    if save_mm not in SAVE_MM_RULES:
        raise ValueError(f"`sac_save_mm={save_mm!r}` is not one of {', '.join(map(repr, SAVE_MM_RULES))}")
    save_ops = frozenset(default_save_ops() | {resolve_op(n) for n in extra_save_ops})
    mm_ops = frozenset(_mm_ops())

    def context_fn():
        if save_mm == "high_k" and width is None:
            raise RuntimeError("`sac_save_mm='high_k'` context used without a layer width: wrap layers with "
                               "apply_activation_checkpointing (it binds the width) or pass `width=`")
        policy = partial(sac_policy, defaultdict(int), save_ops, mm_ops, save_mm, width=width)
        return create_selective_checkpoint_contexts(policy)

    context_fn.save_ops = save_ops  # for inspection / tests
    context_fn.width = width
    context_fn.for_layer = lambda layer: sac_context_fn(
        extra_save_ops, save_mm, layer_width(layer) if save_mm == "high_k" else None)
    return context_fn


def check_ac_mode(mode: str) -> None:
    """Raise unless `mode` is one of AC_MODES (the `activation_checkpointing` option)."""
    if mode not in AC_MODES:
        raise ValueError(f"`activation_checkpointing={mode!r}` is not one of {', '.join(map(repr, AC_MODES))}")


def apply_activation_checkpointing(layer: torch.nn.Module, mode: ACMode, context_fn=None) -> torch.nn.Module:
    """Return `layer` wrapped for `mode` ("none" returns it unchanged)."""
    check_ac_mode(mode)
    if mode == "none":
        return layer
    if mode == "full":
        return checkpoint_wrapper(layer)
    if mode == "selective":
        context_fn = context_fn or sac_context_fn(save_mm="high_k")
        if hasattr(context_fn, "for_layer"):  # ours: bind the per-layer width the "high_k" rule needs
            context_fn = context_fn.for_layer(layer)
        return checkpoint_wrapper(layer, context_fn=context_fn)
