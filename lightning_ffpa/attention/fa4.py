"""The registry's "fa4" kernel: flash-attn-4's causal sliding-window attention as opaque torch custom ops.

Owns the ops ``torch.ops.lightning_ffpa.fa4_fwd`` / ``fa4_bwd`` (dense ``[B,S,H,D]``) and ``fa4_varlen_fwd`` /
``fa4_varlen_bwd`` (packed THD with ``cu_seqlens``), their autograd and FLOP formulas, and the "fa4" entry.
The forwards are custom ops, so SAC can keep them must-save like FFPA's (``lightning_ffpa.saved_ops``) and
compiled layers call them as one extern kernel. Window rule: a query sees key ``k`` when ``0 <= q - k < window``
(HF Gemma4's sliding rule), i.e. FA4's ``causal=True, window_size=(window - 1, 0)``.

Where the ops run: on CUDA through flash-attn-4 (``lightning_ffpa._compat.fa4``); on CPU through the fp32
reference of the same contract (``reference.py``), which is what CPU tests exercise. The entry reports CPU as
unavailable unless a test flips ``cpu_stand_in()``, so a CPU run never picks "fa4" by accident.
Does not own when FA4 runs: ``plan.py`` resolves the sliding choice once, ``backend.py`` routes each call and counts
a fallback to Flex with its reason.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor

from lightning_ffpa._compat import fa4 as fa4_compat
from lightning_ffpa._compat.torch import assume_constant_result
from lightning_ffpa.attention import registry
from lightning_ffpa.attention.reference import _ref_bwd_math, _ref_fwd_math, _segments

__all__ = ["cpu_stand_in", "fa4_attention", "fa4_varlen_attention", "stand_in_active"]

_stand_in = False


@contextlib.contextmanager
def cpu_stand_in(on: bool = True) -> Iterator[None]:
    """Let the "fa4" entry run on CPU tensors through its reference kernels (tests of the dispatch)."""
    global _stand_in
    previous, _stand_in = _stand_in, on
    try:
        yield
    finally:
        _stand_in = previous


def stand_in_active() -> bool:
    """Whether `cpu_stand_in` is on."""
    return _stand_in


@assume_constant_result
def _runs_on_cuda(device: torch.device) -> bool:
    # A per-process constant: compiled layers trace the check without tracing the import.
    return fa4_compat.unavailable_reason(device) == ""


@assume_constant_result
def _arch_major(device: torch.device) -> int:
    return torch.cuda.get_device_capability(device)[0]


def _head_dim_ok(head_dim: int, device: torch.device | None) -> bool:
    if device is None or device.type != "cuda":
        return True  # the CPU stand-in and meta take every head_dim in range
    return fa4_compat.head_dim_supported(head_dim, _arch_major(device))


def _unavailable(device: torch.device | None) -> str:
    if device is not None and device.type == "meta":  # FLOP counting: cost the call as the real run will run it
        return "" if _stand_in or _runs_on_cuda(None) else "flash-attn-4 cannot run here (meta tensors)"
    if device is not None and device.type == "cpu":
        return "" if _stand_in else "cpu tensors (flash-attn-4 runs on SM90/SM100 GPUs)"
    if device is None or device.type == "cuda":
        return "" if _runs_on_cuda(device) else "flash-attn-4 cannot run here"
    return f"{device.type} tensors (flash-attn-4 runs on SM90/SM100 GPUs)"


def unavailable_detail(device: torch.device | None = None) -> str:
    """The full reason FA4 cannot run (for messages; not for compiled code)."""
    if device is not None and device.type != "cuda":
        return _unavailable(device)
    return fa4_compat.unavailable_reason(device)


# --------------------------------------------------------------------------- dense ops


@torch.library.custom_op("lightning_ffpa::fa4_fwd", mutates_args=())
def fa4_fwd(q: Tensor, k: Tensor, v: Tensor, scale: float, window: int) -> tuple[Tensor, Tensor]:
    """Causal sliding-window forward on [B,S,H,D]: (o [B,S,Hq,D], lse [B,Hq,S] fp32)."""
    if q.device.type == "cpu":
        return _ref_fwd_math(q, k, v, scale, True, window)
    o, lse = fa4_compat.forward(q, k, v, scale, window - 1)
    return o, lse.float()


@fa4_fwd.register_fake
def _(q, k, v, scale, window):
    b, s, hq, _ = q.shape
    return q.new_empty(b, s, hq, v.shape[-1]), q.new_empty(b, hq, s, dtype=torch.float32)


@torch.library.custom_op("lightning_ffpa::fa4_bwd", mutates_args=())
def fa4_bwd(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, scale: float,
            window: int) -> tuple[Tensor, Tensor, Tensor]:
    """Backward of `fa4_fwd` from its (o, lse): (dq, dk, dv), dk/dv with the KV heads."""
    if q.device.type == "cpu":
        return _ref_bwd_math(do, q, k, v, o, lse, scale, True, window)
    return fa4_compat.backward(do.contiguous(), q, k, v, o, lse, scale, window - 1)


@fa4_bwd.register_fake
def _(do, q, k, v, o, lse, scale, window):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _dense_setup(ctx, inputs, output):
    q, k, v, scale, window = inputs
    ctx.save_for_backward(q, k, v, *output)
    ctx.scale, ctx.window = scale, window


def _dense_backward(ctx, do, _dlse):  # lse is not differentiated (callers use o only)
    q, k, v, o, lse = ctx.saved_tensors
    dq, dk, dv = torch.ops.lightning_ffpa.fa4_bwd(do, q, k, v, o, lse, ctx.scale, ctx.window)
    return dq, dk, dv, None, None


fa4_fwd.register_autograd(_dense_backward, setup_context=_dense_setup)


# --------------------------------------------------------------------------- varlen ops


def _ref_varlen(q, k, v, cu, scale, window, do=None, o=None, lse=None):
    """Per-segment reference forward (do is None) or backward, in THD layout."""
    if do is None:
        out = q.new_zeros(q.shape[0], q.shape[1], v.shape[-1])
        lse_out = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float32, device=q.device)
    else:
        grads = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for s0, s1, _, _ in _segments(cu, cu):
        if s1 <= s0:
            continue
        seg = slice(s0, s1)
        if do is None:
            o_i, lse_i = _ref_fwd_math(q[None, seg], k[None, seg], v[None, seg], scale, True, window)
            out[seg], lse_out[:, seg] = o_i[0], lse_i[0]
        else:
            g = _ref_bwd_math(do[None, seg], q[None, seg], k[None, seg], v[None, seg], o[None, seg],
                              lse[None, :, seg], scale, True, window)
            for acc, gi in zip(grads, g):
                acc[seg] = gi[0]
    return (out, lse_out) if do is None else grads


@torch.library.custom_op("lightning_ffpa::fa4_varlen_fwd", mutates_args=())
def fa4_varlen_fwd(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int, scale: float,
                   window: int) -> tuple[Tensor, Tensor]:
    """Causal sliding-window forward over packed THD documents: (o [T,Hq,D], lse [Hq,T] fp32)."""
    if q.device.type == "cpu":
        return _ref_varlen(q, k, v, cu_seqlens, scale, window)
    o, lse = fa4_compat.forward(q, k, v, scale, window - 1, cu_seqlens, max_seqlen)
    return o, lse.float()


@fa4_varlen_fwd.register_fake
def _(q, k, v, cu_seqlens, max_seqlen, scale, window):
    return q.new_empty(q.shape[0], q.shape[1], v.shape[-1]), q.new_empty(q.shape[1], q.shape[0], dtype=torch.float32)


@torch.library.custom_op("lightning_ffpa::fa4_varlen_bwd", mutates_args=())
def fa4_varlen_bwd(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, cu_seqlens: Tensor,
                   max_seqlen: int, scale: float, window: int) -> tuple[Tensor, Tensor, Tensor]:
    """Backward of `fa4_varlen_fwd` from its (o, lse): (dq, dk, dv) in THD layout."""
    if q.device.type == "cpu":
        return _ref_varlen(q, k, v, cu_seqlens, scale, window, do, o, lse)
    return fa4_compat.backward(do.contiguous(), q, k, v, o, lse, scale, window - 1, cu_seqlens, max_seqlen)


@fa4_varlen_bwd.register_fake
def _(do, q, k, v, o, lse, cu_seqlens, max_seqlen, scale, window):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _varlen_setup(ctx, inputs, output):
    q, k, v, cu, max_seqlen, scale, window = inputs
    ctx.save_for_backward(q, k, v, cu, *output)
    ctx.args = (max_seqlen, scale, window)


def _varlen_backward(ctx, do, _dlse):
    q, k, v, cu, o, lse = ctx.saved_tensors
    dq, dk, dv = torch.ops.lightning_ffpa.fa4_varlen_bwd(do, q, k, v, o, lse, cu, *ctx.args)
    return dq, dk, dv, None, None, None, None


fa4_varlen_fwd.register_autograd(_varlen_backward, setup_context=_varlen_setup)


# --------------------------------------------------------------------------- differentiable calls, FLOPs, entry


def fa4_attention(q: Tensor, k: Tensor, v: Tensor, scale: float, window: int) -> Tensor:
    """Differentiable causal sliding-window attention on [B,S,H,D] (any strides with a contiguous last dim)."""
    return torch.ops.lightning_ffpa.fa4_fwd(q, k, v, float(scale), int(window))[0]


def fa4_varlen_attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int, scale: float,
                         window: int) -> Tensor:
    """Differentiable causal sliding-window attention over packed THD documents."""
    return torch.ops.lightning_ffpa.fa4_varlen_fwd(q, k, v, cu_seqlens, int(max_seqlen), float(scale), int(window))[0]


def _varlen_pairs(q: Tensor, cu: Tensor, max_seqlen: int) -> int:
    try:
        return sum((s1 - s0) ** 2 for s0, s1, _, _ in _segments(cu, cu))
    except Exception:  # noqa: BLE001 - meta/fake tensors have no values: the upper bound
        return q.shape[0] * max_seqlen


def _register_flop_formulas() -> None:
    from torch.utils.flop_counter import flop_registry, register_flop_formula

    def dense(q, k, *args, out_val=None, **kw):
        b, s, hq, d = q.shape
        return registry.attention_flops(b, s, k.shape[1], hq, d)

    def dense_bwd(do, q, k, *args, out_val=None, **kw):
        return 2 * dense(q, k)

    def varlen(q, k, v, cu, max_seqlen, *args, out_val=None, **kw):
        return registry.attention_flops(1, 1, _varlen_pairs(q, cu, max_seqlen), q.shape[1], q.shape[2])

    def varlen_bwd(do, q, k, v, o, lse, cu, max_seqlen, *args, out_val=None, **kw):
        return 2 * varlen(q, k, v, cu, max_seqlen)

    ops = torch.ops.lightning_ffpa
    for packet, formula in ((ops.fa4_fwd, dense), (ops.fa4_bwd, dense_bwd), (ops.fa4_varlen_fwd, varlen),
                            (ops.fa4_varlen_bwd, varlen_bwd)):
        if packet not in flop_registry:
            register_flop_formula(packet, get_raw=True)(formula)


_register_flop_formulas()

registry.register(registry.Kernel(
    name="fa4", head_dims=fa4_compat.HEAD_DIM_RANGE, head_dim_multiple=8, head_dim_rule=_head_dim_ok,
    dtypes=(torch.float16, torch.bfloat16),
    features=frozenset({"causal", "sliding_window", "gqa", "varlen", "lse"}), unavailable=_unavailable,
    forward_ops=lambda: (torch.ops.lightning_ffpa.fa4_fwd.default, torch.ops.lightning_ffpa.fa4_varlen_fwd.default),
    windowed=registry.Windowed(fa4_attention, fa4_varlen_attention),
    doc="flash-attn-4 (SM90/SM100, head_dim <= 256): causal sliding-window layers, dense and varlen"))
