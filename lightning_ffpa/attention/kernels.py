"""FFPA kernel handles: availability, the dense/varlen op contract, autograd wrappers, flop formulas.

This file owns the *kernel* layer only: which implementation runs for one attention call
(the FFPA CuTeDSL custom ops on a supported GPU, otherwise a reference in fp32 math that is
registered as torch custom ops so SAC policies and flop counters can name it). It knows nothing
about Hugging Face, masks or routing; that is ``backend.py``.

Op contract (shared with the ring context-parallel code):
- dense: q ``[B,Sq,Hq,D]``, k/v ``[B,Sk,Hkv,D]`` (any strides), ``Hq % Hkv == 0``;
  causal is bottom-right aligned (query i sees keys j <= i + Sk - Sq);
  returns o ``[B,Sq,Hq,D]`` (q dtype) and lse ``[B,Hq,Sq]`` float32, natural log.
- varlen: THD q ``[Tq,Hq,D]``, k/v ``[Tk,Hkv,D]``, int32 ``cu_seqlens``; lse ``[Hq,Tq]``.
- A row that sees no key has o = 0 and lse = -inf.
The CuTeDSL side runs ffpa-attn's private custom ops through ``lightning_ffpa._compat.ffpa`` (their import,
argument orders and the forwards SAC saves live there); this file adds the rows with no key, which the ops
do not take (they need ``Sk >= Sq``).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch
from torch import Tensor

from lightning_ffpa._compat import ffpa as ffpa_compat
from lightning_ffpa._compat.torch import assume_constant_result
from lightning_ffpa.attention import counters, registry

# importing registers torch.ops.lightning_ffpa.ref_* (the CPU reference of the contract)
from lightning_ffpa.attention.reference import _segments

__all__ = [
    "active_kernel",
    "dense_bwd",
    "dense_fwd",
    "ffpa_attention",
    "ffpa_available",
    "ffpa_unavailable_reason",
    "ffpa_varlen_attention",
    "force_kernel",
    "forced_kernel",
    "forward_ops",
    "kernel_counts",
    "register_flop_formulas",
    "reset_kernel_counts",
    "varlen_bwd",
    "varlen_fwd",
]

KERNELS = ("cutedsl", "reference")
CUTE_HEAD_DIM_RANGE = ffpa_compat.HEAD_DIM_RANGE
CUTE_ARCH_MAJORS = ffpa_compat.ARCH_MAJORS

_forced: str | None = None


# --------------------------------------------------------------------------- availability


# A per-process constant: dynamo must not trace the import (it graph-breaks compiled layers otherwise).
@assume_constant_result
def ffpa_available() -> bool:
    """Whether the FFPA CuTeDSL ops are importable in this process."""
    return ffpa_compat.unavailable_reason() == ""


def ffpa_unavailable_reason() -> str:
    """Why the FFPA ops are not available ('' when they are)."""
    return ffpa_compat.unavailable_reason()


@assume_constant_result
def _device_supported(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] in CUTE_ARCH_MAJORS


def _cute_unavailable(device: torch.device | None) -> str:
    # Only per-process constants (assume_constant_result) here: compiled layers trace this check.
    if not ffpa_available():
        return "ffpa-attn's CuTeDSL ops are not importable"
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return "" if _device_supported(device) else f"{device} is not an SM90/SM100 GPU"


def cute_supports(q: Tensor) -> bool:
    """Whether the CuTeDSL kernels can take this query tensor (device, arch, dtype, head_dim): the registry's
    "ffpa" entry."""
    return registry.get("ffpa").why_not(q.shape[-1], q.dtype, q.device) == ""


def active_kernel() -> str:
    """The kernel dense_fwd/varlen_fwd would use for a supported CUDA tensor now: 'cutedsl' or 'reference'."""
    if _forced is not None:
        return _forced
    if ffpa_available() and _device_supported(torch.device("cuda", torch.cuda.current_device())):
        return "cutedsl"
    return "reference"


@contextlib.contextmanager
def force_kernel(name: str | None) -> Iterator[None]:
    """Force 'reference' (CPU tests run the exact dispatch code) or 'cutedsl' (fail loudly if unusable)."""
    global _forced
    if name is not None and name not in KERNELS:
        raise ValueError(f"`force_kernel({name!r})`: expected one of {KERNELS} or None")
    previous, _forced = _forced, name
    try:
        yield
    finally:
        _forced = previous


def forced_kernel() -> str | None:
    """The kernel forced by `force_kernel`, or None."""
    return _forced


def kernel_counts() -> dict[str, int]:
    """Forward calls per kernel ('cutedsl', 'reference') since the last reset: which kernel really ran.

    Counted per forward call, eager or compiled; AC recomputes are not counted (``counters.py``).
    """
    got = counters.counts("kernel")
    return {name: got.get(name, 0) for name in KERNELS}


def reset_kernel_counts() -> None:
    """Zero the per-kernel forward counters."""
    counters.reset("kernel")


def _use_cute(q: Tensor) -> bool:
    if _forced == "reference":
        return False
    ok = cute_supports(q)
    if _forced == "cutedsl" and not ok:
        raise RuntimeError(
            f"force_kernel('cutedsl') but CuTeDSL cannot run dtype={q.dtype} head_dim={q.shape[-1]} "
            f"on {q.device}: {ffpa_unavailable_reason() or 'unsupported device/dtype/head_dim'}"
        )
    return ok


def _count(use_cute: bool, q: Tensor) -> bool:
    counters.count("kernel", "cutedsl" if use_cute else "reference", q)
    return use_cute


# --------------------------------------------------------------------------- the op contract


def dense_fwd(q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool) -> tuple[Tensor, Tensor]:
    """Dense attention forward: (o [B,Sq,Hq,D], lse [B,Hq,Sq] fp32); bottom-right causal."""
    if not _count(_use_cute(q), q):
        return torch.ops.lightning_ffpa.ref_dense_fwd(q, k, v, float(scale), bool(causal))
    sq, sk = q.shape[1], k.shape[1]
    skip = sq - sk if causal and sq > sk else 0  # leading rows that see no key (kernel requires Sk >= Sq)
    if skip == 0 and sk > 0:
        return ffpa_compat.dense_fwd(q, k, v, scale, causal)
    b, _, hq, _ = q.shape
    o = q.new_zeros(b, sq, hq, v.shape[-1])
    lse = torch.full((b, hq, sq), float("-inf"), dtype=torch.float32, device=q.device)
    if sk > 0:
        o[:, skip:], lse[:, :, skip:] = ffpa_compat.dense_fwd(q[:, skip:], k, v, scale, causal)
    return o, lse


def dense_bwd(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, scale: float,
              causal: bool) -> tuple[Tensor, Tensor, Tensor]:
    """Dense attention backward from (o, lse) of the forward (or a merged global o/lse): (dq, dk, dv)."""
    if not _use_cute(q):
        return torch.ops.lightning_ffpa.ref_dense_bwd(do, q, k, v, o, lse, float(scale), bool(causal))
    sq, sk = q.shape[1], k.shape[1]
    skip = sq - sk if causal and sq > sk else 0
    if skip == 0 and sk > 0:
        return ffpa_compat.dense_bwd(do, q, k, v, o, lse, scale, causal)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    if sk > 0:
        dq[:, skip:], dk, dv = ffpa_compat.dense_bwd(do[:, skip:], q[:, skip:], k, v, o[:, skip:], lse[:, :, skip:],
                                                     scale, causal)
    return dq, dk, dv


def varlen_fwd(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
               max_seqlen_k: int, scale: float, causal: bool) -> tuple[Tensor, Tensor]:
    """Packed THD attention forward: (o [Tq,Hq,D], lse [Hq,Tq] fp32); zero-length segments give o=0, lse=-inf."""
    if not _count(_use_cute(q), q):
        return torch.ops.lightning_ffpa.ref_varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q),
                                                       int(max_seqlen_k), float(scale), bool(causal))
    return ffpa_compat.varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, causal)


def varlen_bwd(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, cu_seqlens_q: Tensor,
               cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int, scale: float,
               causal: bool) -> tuple[Tensor, Tensor, Tensor]:
    """Packed THD attention backward: (dq, dk, dv)."""
    if not _use_cute(q):
        return torch.ops.lightning_ffpa.ref_varlen_bwd(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k,
                                                       int(max_seqlen_q), int(max_seqlen_k), float(scale),
                                                       bool(causal))
    return ffpa_compat.varlen_bwd(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                  scale, causal)


# --------------------------------------------------------------------------- autograd wrappers


class _DenseAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale, causal):
        o, lse = dense_fwd(q, k, v, scale, causal)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.scale, ctx.causal = scale, causal
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = dense_bwd(do, q, k, v, o, lse, ctx.scale, ctx.causal)
        return dq, dk, dv, None, None


class _VarlenAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, max_q, max_k, scale, causal):
        o, lse = varlen_fwd(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal)
        ctx.save_for_backward(q, k, v, o, lse, cu_q, cu_k)
        ctx.args = (max_q, max_k, scale, causal)
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        q, k, v, o, lse, cu_q, cu_k = ctx.saved_tensors
        dq, dk, dv = varlen_bwd(do, q, k, v, o, lse, cu_q, cu_k, *ctx.args)
        return dq, dk, dv, None, None, None, None, None, None


def ffpa_attention(q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool, return_lse: bool = False):
    """Differentiable dense attention on ``[B,S,H,D]`` tensors; returns o (and lse if asked)."""
    o, lse = _DenseAttention.apply(q, k, v, float(scale), bool(causal))
    return (o, lse) if return_lse else o


def ffpa_varlen_attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                          max_seqlen_q: int, max_seqlen_k: int, scale: float, causal: bool,
                          return_lse: bool = False):
    """Differentiable packed THD attention; returns o (and lse if asked)."""
    o, lse = _VarlenAttention.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k),
                                    float(scale), bool(causal))
    return (o, lse) if return_lse else o


# --------------------------------------------------------------------------- SAC ops and flop formulas


def forward_ops() -> tuple:
    """The forward OpOverloads that exist in this process (FFPA ones when importable, then the reference ones)."""
    return registry.get("ffpa").forward_ops() + registry.get("reference").forward_ops()


def _dense_flops(q: Tensor, k: Tensor) -> int:
    b, sq, hq, d = q.shape
    return registry.attention_flops(b, sq, k.shape[1], hq, d)


def _varlen_flops(q: Tensor, cu_q: Tensor, cu_k: Tensor, max_k: int) -> int:
    hq, d = q.shape[1], q.shape[2]
    try:
        pairs = sum((q1 - q0) * (k1 - k0) for q0, q1, k0, k1 in _segments(cu_q, cu_k))
    except Exception:  # noqa: BLE001 - meta/fake tensors (measure_flops) have no values: use the upper bound
        pairs = q.shape[0] * max_k
    return registry.attention_flops(1, 1, pairs, hq, d)


def _dense_fwd_formula(q, k, *args, out_val=None, **kw):
    return _dense_flops(q, k)


def _dense_bwd_formula(do, q, k, *args, out_val=None, **kw):  # dq, dk, dv, dp: twice the forward
    return 2 * _dense_flops(q, k)


def _varlen_fwd_formula(q, k, v, cu_q, cu_k, max_q, max_k, *args, out_val=None, **kw):
    return _varlen_flops(q, cu_q, cu_k, max_k)


def _varlen_bwd_formula(do, q, k, v, o, lse, cu_q, cu_k, max_q, max_k, *args, out_val=None, **kw):
    return 2 * _varlen_flops(q, cu_q, cu_k, max_k)


# torch.utils.flop_counter formulas of the op contract's four ops, in the contract's argument order
FLOP_FORMULAS = (_dense_fwd_formula, _dense_bwd_formula, _varlen_fwd_formula, _varlen_bwd_formula)


@functools.cache
def register_flop_formulas() -> None:
    """Register torch.utils.flop_counter formulas for the FFPA and reference ops (idempotent)."""
    from torch.utils.flop_counter import flop_registry, register_flop_formula

    ref = torch.ops.lightning_ffpa
    table = list(zip((ref.ref_dense_fwd, ref.ref_dense_bwd, ref.ref_varlen_fwd, ref.ref_varlen_bwd), FLOP_FORMULAS))
    table += ffpa_compat.flop_formulas(*FLOP_FORMULAS)  # [] without ffpa_attn
    for packet, formula in table:
        if packet not in flop_registry:  # someone (a newer ffpa_attn?) may have registered one already
            register_flop_formula(packet, get_raw=True)(formula)


# The FFPA contract as the ring and the backend call it: CuTeDSL where it runs, else the CPU reference (counted
# per kernel in `kernel_counts`; `force_kernel` pins one).
CONTRACT = registry.Contract(dense_fwd, dense_bwd, varlen_fwd, varlen_bwd)

registry.register(registry.Kernel(
    name="ffpa", head_dims=CUTE_HEAD_DIM_RANGE, head_dim_multiple=32, dtypes=(torch.float16, torch.bfloat16),
    features=frozenset({"causal", "gqa", "varlen", "lse", "merged_lse_backward"}),
    unavailable=_cute_unavailable, contract=CONTRACT, forward_ops=ffpa_compat.forward_ops, block_ops="contract",
    doc="ffpa-attn's CuTeDSL kernels (SM90/SM100, head_dim 320-512): the full layers at D=512"))
