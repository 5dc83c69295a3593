"""flash-attn-4 (``flash_attn.cute``): the import guard, its forwards, and the backward it keeps private.

Owns every name this project takes from flash-attn-4, so an upgrade breaks this file only. Public:
``flash_attn_func`` / ``flash_attn_varlen_func`` (with ``return_lse=True`` they return ``(out, lse)``; without
autograd they compute lse only when asked). Private: ``flash_attn.cute.interface._flash_attn_bwd``, the backward
its own autograd Function calls, taken here so the project's custom op can run the backward from a saved
(o, lse) instead of re-running the forward under autograd. Its positional arguments
``(q, k, v, out, dout, lse, softmax_scale, causal, softcap)`` and the keywords used below are the same from
fa4-v4.0.0.beta27 to the main branch of 2026-12 (read from flash_attn/cute/interface.py).
Facts (DESIGN.md, checked 2026-12): SM90/SM100, causal with ``window_size=(left, 0)``, GQA, varlen; no head_dim
512. Head dims (``_validate_head_dims`` in the same file): SM90 takes 8-256, SM100 8-128 or exactly 256; all
multiples of 8 at 16-bit. The backward runs FA4's fast path (``deterministic=False``, as the issue's first
measurement ran it) unless torch's deterministic algorithms are on (``trainer.deterministic: true``), where it
asks for FA4's deterministic backward. Does not own when FA4 runs (``lightning_ffpa.attention.fa4``).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor

__all__ = ["ARCH_MAJORS", "HEAD_DIM_RANGE", "backward", "forward", "head_dim_supported", "unavailable_reason"]

ARCH_MAJORS = (9, 10)
HEAD_DIM_RANGE = (8, 256)


def head_dim_supported(head_dim: int, arch_major: int) -> bool:
    """Whether FA4 has a kernel for this head_dim (== head_dim_v) on this architecture (within HEAD_DIM_RANGE)."""
    return head_dim <= 128 or head_dim == 256 if arch_major >= 10 else True


@functools.cache
def _load() -> tuple[Any, Any, str]:
    """(flash_attn.cute, its interface module, '') once importable, else (None, None, why)."""
    if not torch.cuda.is_available():
        return None, None, "no CUDA device"
    try:
        import flash_attn.cute as cute
        from flash_attn.cute import interface
    except Exception as exc:  # noqa: BLE001 - any import failure means "not available"
        return None, None, f"`import flash_attn.cute` failed: {type(exc).__name__}: {exc}"
    if not hasattr(interface, "_flash_attn_bwd"):
        return None, None, "flash_attn.cute has no `_flash_attn_bwd` (an unsupported flash-attn-4 version)"
    return cute, interface, ""


def unavailable_reason(device: torch.device | None = None) -> str:
    """Why FA4 cannot run on `device` (default: the current CUDA device); '' when it can."""
    why = _load()[2]
    if why:
        return why
    device = device if device is not None else torch.device("cuda", torch.cuda.current_device())
    if device.type != "cuda":
        return f"{device.type} tensors (FA4 runs on CUDA)"
    major, minor = torch.cuda.get_device_capability(device)
    if major not in ARCH_MAJORS:
        return f"SM{major}{minor} is not SM90/SM100"
    return ""


def forward(q: Tensor, k: Tensor, v: Tensor, scale: float, window_left: int, cu_seqlens: Tensor | None = None,
            max_seqlen: int | None = None) -> tuple[Tensor, Tensor]:
    """Causal sliding-window forward: (o, lse). Dense [B,S,H,D] -> lse [B,H,S]; varlen THD -> lse [H,T]."""
    cute = _load()[0]
    window = (window_left, 0)
    if cu_seqlens is None:
        return cute.flash_attn_func(q, k, v, softmax_scale=scale, causal=True, window_size=window, return_lse=True)
    return cute.flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens,
                                       max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen, softmax_scale=scale,
                                       causal=True, window_size=window, return_lse=True)


def backward(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, scale: float, window_left: int,
             cu_seqlens: Tensor | None = None, max_seqlen: int | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) from the forward's (o, lse)."""
    interface = _load()[1]
    varlen = {} if cu_seqlens is None else dict(cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens,
                                                max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen)
    dq, dk, dv = interface._flash_attn_bwd(q, k, v, o, do, lse, scale, True, 0.0, window_size_left=window_left,
                                           window_size_right=0,
                                           deterministic=torch.are_deterministic_algorithms_enabled(), **varlen)[:3]
    return dq, dk, dv
