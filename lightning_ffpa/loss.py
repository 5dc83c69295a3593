"""Causal-LM cross-entropy for large vocabularies, honouring Gemma4's final logit softcap.

Owns the loss math only: `linear_cross_entropy` (chunked, never materialises the full [N, V] fp32
logits), an optional liger-kernel path, and `plain_causal_lm_loss` (the reference HF computes).
Shifting labels and choosing which hidden states to feed belong to the LightningModule.

Why the chunked path computes gradients inside forward: the lm_head matmul at V=262144 is a large
share of a Gemma4 step. Computing d(loss)/d(logits) per chunk while the chunk's logits are live costs
3 matmuls (logits, grad_hidden, grad_weight; 2 when the head is frozen, as under LoRA), the same as the
plain loss, while a recompute-in-backward design costs 4. Memory stays O(chunk_size * V) for the logits
plus one [V, H] gradient buffer (none for a frozen head). The
gradients are scaled by the incoming grad_output in backward, so they are exact for any upstream
scalar multiplier (loss scaling, accumulation).
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

from lightning_ffpa import compile_fallbacks

# Labels with this value take no loss (torch's and HF's convention); the one definition the package uses.
IGNORE_INDEX = -100

__all__ = ["linear_cross_entropy", "plain_causal_lm_loss"]


def plain_causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, softcap: float | None = None,
                         ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Reference: softcap the logits in fp32 and take the mean CE over non-ignored (already shifted) labels."""
    logits = logits.float()
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=ignore_index)


def _chunk_loss_and_grad(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor, scale: torch.Tensor,
                         softcap: float | None, ignore_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed CE of one chunk and d(mean loss)/d(logits) for it, in the hidden dtype.

    In-place ops keep eager memory at two (C, V) fp32 buffers; compiled, inductor fuses them.
    """
    valid = y != ignore_index
    y_safe = torch.where(valid, y, torch.zeros_like(y))[:, None]  # (C, 1)
    logits = (h @ w.t()).float()  # (C, V)
    if softcap is not None:
        t = logits.div_(softcap).tanh_()  # reuses the logits buffer
        z = t * softcap
    else:
        t, z = None, logits
    lse = torch.logsumexp(z, dim=-1)  # (C,)
    loss_sum = ((lse - z.gather(1, y_safe).squeeze(1)) * valid).sum()
    grad = z.sub_(lse[:, None]).exp_()  # softmax, in z's buffer
    grad.scatter_add_(1, y_safe, torch.full_like(lse[:, None], -1.0))  # - one_hot(y)
    grad.mul_((valid.to(grad.dtype) * scale)[:, None])
    if t is not None:
        grad.mul_(t.mul_(t).neg_().add_(1.0))  # d/dx [c * tanh(x / c)] = 1 - tanh^2
    return loss_sum, grad.to(h.dtype)


_COMPILED_CHUNK = None


def _chunk_fn(compile: bool):
    global _COMPILED_CHUNK
    if not compile:
        return _chunk_loss_and_grad
    if _COMPILED_CHUNK is None:
        # dynamic=False: chunk shapes repeat (all chunks but the last share one shape).
        compile_fallbacks.prepare()
        _COMPILED_CHUNK = torch.compile(_chunk_loss_and_grad, dynamic=False)
    return _COMPILED_CHUNK


class _ChunkedLinearCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, softcap, chunk_size, ignore_index, compile):
        n_valid = (labels != ignore_index).sum()
        scale = 1.0 / n_valid.clamp(min=1).to(torch.float32)
        # A frozen head (LoRA elsewhere) needs no weight gradient: no (V, H) buffer, no third matmul per chunk
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        fn = _chunk_fn(compile)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros_like(weight) if need_w else None
        for start in range(0, hidden.shape[0], chunk_size):
            h = hidden[start:start + chunk_size]
            loss_sum, g = fn(h, weight, labels[start:start + chunk_size], scale, softcap, ignore_index)
            total += loss_sum
            if need_h:
                torch.mm(g, weight, out=grad_h[start:start + chunk_size])  # (C, H)
            if need_w:
                grad_w.addmm_(g.t(), h)  # (V, H), accumulated in the weight dtype
            del loss_sum, g  # before the next chunk's logits: one chunk's buffers alive at a time
        ctx.save_for_backward(grad_h, grad_w)
        return total * scale

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w = ctx.saved_tensors
        gh = grad_h * grad_out.to(grad_h.dtype) if grad_h is not None else None
        gw = grad_w * grad_out.to(grad_w.dtype) if grad_w is not None else None
        return gh, gw, None, None, None, None, None


def _liger_loss(hidden, weight, labels, softcap, ignore_index):
    try:
        from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss
    except ImportError as e:
        raise ImportError(
            "`impl='liger'` needs liger-kernel: `pip install lightning-ffpa[liger]` (or use impl='chunked')"
        ) from e
    fn = LigerFusedLinearCrossEntropyLoss(ignore_index=ignore_index, softcap=softcap, reduction="mean")
    return fn(weight, hidden, labels)


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                         softcap: float | None = None, chunk_size: int = 4096, ignore_index: int = IGNORE_INDEX,
                         impl: Literal["chunked", "liger"] = "chunked",
                         compile: bool | None = None) -> torch.Tensor:
    """Mean CE of softcap(hidden @ weight.T) over non-ignored labels, without full fp32 logits.

    hidden: (N, H); weight: (V, H); labels: (N,) already shifted. `compile=None` compiles the per-chunk
    math on CUDA and runs it eagerly elsewhere. A batch with no valid label returns 0.
    """
    if hidden.dim() != 2 or weight.dim() != 2 or labels.dim() != 1:
        raise ValueError(f"linear_cross_entropy wants hidden (N,H), weight (V,H), labels (N,); got "
                         f"{tuple(hidden.shape)}, {tuple(weight.shape)}, {tuple(labels.shape)}")
    if hidden.shape[0] != labels.shape[0] or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"linear_cross_entropy shape mismatch: hidden {tuple(hidden.shape)}, "
                         f"weight {tuple(weight.shape)}, labels {tuple(labels.shape)}")
    if chunk_size <= 0:
        raise ValueError(f"`chunk_size={chunk_size}` must be positive")
    if impl == "liger":
        return _liger_loss(hidden, weight, labels, softcap, ignore_index)
    if impl != "chunked":
        raise ValueError(f"`impl={impl!r}` is not one of 'chunked', 'liger'")
    if compile is None:
        compile = hidden.is_cuda
    return _ChunkedLinearCE.apply(hidden, weight, labels, softcap, chunk_size, ignore_index, compile)
