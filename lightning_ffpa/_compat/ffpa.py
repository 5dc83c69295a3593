"""ffpa-attn's CuTeDSL custom ops: the import guard, the four private ops, and the forwards SAC must save.

Owns every name this project takes from ffpa-attn below its public ``ffpa_attn_func``, so an upgrade breaks
this file only. Importing ``ffpa_attn`` registers ``torch.ops.ffpa_attn._fwd_cute``, ``_bwd_cute``,
``_varlen_fwd_cute`` and ``_varlen_bwd_cute``; the functions below call them with the argument orders read from
the 0.2.4 wheel (``ffpa_attn/cute/__init__.py``, ``ffpa_attn/cute/_utils.py``):
- ``_fwd_cute(q, k, v, scale, causal: int, return_lse: int) -> (o, lse)``: q ``[B,Sq,Hq,D]``, k/v
  ``[B,Sk,Hkv,D]`` (any strides, GQA native, bottom-right causal, needs ``Sk >= Sq``); o ``[B,Sq,Hq,D]``,
  lse ``[B,Hq,Sq]`` fp32.
- ``_bwd_cute(dout, q, k, v, out, lse, scale, causal: int, 0) -> (dq, dk, dv)``.
- ``_varlen_fwd_cute(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal: bool, window_left, window_right,
  softcap, Hq > Hkv) -> (o, lse)``: THD q ``[Tq,Hq,D]``, k/v ``[Tk,Hkv,D]``, lse ``[Hq,Tq]``.
- ``_varlen_bwd_cute(q, k, v, out, dout, lse, cu_q, cu_k, max_q, max_k, scale, causal: bool, window_left,
  window_right, softcap, None) -> (dq, dk, dv)``: note ``out, dout`` here against ``dout, ..., out`` in
  ``_bwd_cute``. The functions here take the project's order (``do`` first) for all four.
The trailing ``0`` of ``_bwd_cute``, ``Hq > Hkv`` of the varlen forward and ``None`` of the varlen backward are
the values this project has passed since its op contract was first written against that wheel; no window is
``_NO_WINDOW`` and softcap is 0.0 (CuTeDSL has neither).
Why the ops and not ``ffpa_attn_func(backend="cutedsl")``: the public function copies its output to a
contiguous ``[B,H,S,D]`` and saves ``.contiguous()`` copies of the transposed q/k/v for backward, while the ops
take HF's ``[B,S,H,D]`` projection storage as is and return the ``[B,S,H,D]`` output HF wants.
Does not own when the ops run, the empty-row handling, nor the CPU reference of their contract
(``lightning_ffpa.attention.kernels`` and ``attention.reference``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "ARCH_MAJORS",
    "HEAD_DIM_RANGE",
    "dense_bwd",
    "dense_fwd",
    "flop_formulas",
    "forward_ops",
    "unavailable_reason",
    "varlen_bwd",
    "varlen_fwd",
]

# CuTeDSL dense/varlen head-dim range on sm90 (ffpa_attn.cute._utils: MIN_SUPPORTED_HEAD_DIM=320,
# SM90_SUPPORTED_HEAD_DIM=512); sm100 has a dedicated D=512 path and the same range otherwise.
HEAD_DIM_RANGE = (320, 512)
ARCH_MAJORS = (9, 10)
# ffpa_attn.cute._utils._VARLEN_CUSTOM_OP_NONE_INT: how the varlen ops encode "no window".
_NO_WINDOW = -(2**31)


@functools.cache
def _load() -> tuple[Any, str]:
    """Import ffpa_attn once (it needs triton and a CUDA stack): (its ops namespace, '') or (None, why not)."""
    if not torch.cuda.is_available():
        return None, "no CUDA device"
    try:
        import ffpa_attn  # noqa: F401 - registers torch.ops.ffpa_attn.*
    except Exception as exc:  # noqa: BLE001 - any import failure means "not available"
        return None, f"`import ffpa_attn` failed: {type(exc).__name__}: {exc}"
    if not hasattr(torch.ops.ffpa_attn, "_fwd_cute"):
        return None, "ffpa_attn imported but its CuTeDSL ops are not registered (cutlass DSL missing?)"
    return torch.ops.ffpa_attn, ""


def unavailable_reason() -> str:
    """Why the CuTeDSL ops are not usable in this process ('' when they are); imports ffpa_attn on first call."""
    return _load()[1]


# The four calls below name `torch.ops.ffpa_attn` directly, not `_load()`: compiled layers trace them, and dynamo
# must not trace the import (it graph-breaks). Callers check `unavailable_reason() == ""` first.
def dense_fwd(q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool) -> tuple[Tensor, Tensor]:
    """(o [B,Sq,Hq,D], lse [B,Hq,Sq] fp32) for ``Sk >= Sq``; bottom-right causal."""
    return torch.ops.ffpa_attn._fwd_cute(q, k, v, float(scale), int(causal), 1)


def dense_bwd(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, scale: float,
              causal: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) from the forward's (o, lse)."""
    return torch.ops.ffpa_attn._bwd_cute(do, q, k, v, o, lse, float(scale), int(causal), 0)


def varlen_fwd(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
               max_seqlen_k: int, scale: float, causal: bool) -> tuple[Tensor, Tensor]:
    """Packed THD forward: (o [Tq,Hq,D], lse [Hq,Tq] fp32)."""
    return torch.ops.ffpa_attn._varlen_fwd_cute(q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q),
                                                int(max_seqlen_k), float(scale), bool(causal), _NO_WINDOW,
                                                _NO_WINDOW, 0.0, q.shape[1] > k.shape[1])


def varlen_bwd(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, cu_seqlens_q: Tensor,
               cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int, scale: float,
               causal: bool) -> tuple[Tensor, Tensor, Tensor]:
    """Packed THD backward: (dq, dk, dv). Takes ``do`` first; the op takes (q, k, v, out, dout, lse, ...)."""
    return torch.ops.ffpa_attn._varlen_bwd_cute(q, k, v, o, do, lse, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q),
                                                int(max_seqlen_k), float(scale), bool(causal), _NO_WINDOW,
                                                _NO_WINDOW, 0.0, None)


def forward_ops() -> tuple:
    """The forward OpOverloads a SAC policy must save (dense, varlen); () when ffpa_attn is not importable."""
    ops = _load()[0]
    if ops is None:
        return ()
    return (ops._fwd_cute.default, ops._varlen_fwd_cute.default)


def flop_formulas(dense_fwd: Callable, dense_bwd: Callable, varlen_fwd: Callable,
                  varlen_bwd: Callable) -> list[tuple[Any, Callable]]:
    """(op packet, torch.utils.flop_counter formula) for the four ops, given formulas in the project's argument
    order (``do`` first): only the varlen backward's order differs, (q, k, v, out, dout, lse, ...).
    [] when ffpa_attn is not importable."""
    ops = _load()[0]
    if ops is None:
        return []

    def varlen_bwd_(q, k, v, o, do, lse, *args, **kw):
        return varlen_bwd(do, q, k, v, o, lse, *args, **kw)

    return [(ops._fwd_cute, dense_fwd), (ops._bwd_cute, dense_bwd), (ops._varlen_fwd_cute, varlen_fwd),
            (ops._varlen_bwd_cute, varlen_bwd_)]
