"""Token log-probabilities (and entropies) of the sampled tokens, straight from final hidden states through the
lm_head in token chunks, with Gemma4's final logit softcap and the rollout temperature: the (tokens x vocab)
logits never exist, forward or backward.

Owns `chunked_token_logprobs` (the autograd Function) and `policy_token_logprobs` (which hidden states are
scored: only positions whose next token is a completion token). Does not own the model forward
(`hidden_states.py`) or the loss (`rl/grpo.py`). `full_token_logprobs` is the full-logits reference.

Why recompute in backward (unlike `loss.py`, which computes its gradient inside forward): a log-prob's
upstream gradient is one number per token, known only in backward, so d/d(hidden) and d/d(weight) cannot be
formed in forward without keeping (tokens x vocab) state. Forward keeps the per-token log-sum-exp; backward
redoes each chunk's logits (one matmul) and frees them before the next chunk: memory O(chunk x vocab).
"""

from __future__ import annotations

import torch
from torch import nn

from lightning_ffpa.hidden_states import causal_lm_hidden_states, head_operands


def _chunk_logits(h: torch.Tensor, w: torch.Tensor, softcap: float | None, temperature: float,
                  keep_tanh: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(C, V) fp32 scaled logits z = softcap(h w^T) / temperature, in one buffer; with `keep_tanh` (backward)
    also tanh(.) of the softcap in a second."""
    logits = (h @ w.t()).float()  # (C, V)
    t = None
    if softcap is not None:
        logits.div_(softcap).tanh_()
        if keep_tanh:
            t = logits.clone()
        logits.mul_(softcap)
    return logits.div_(temperature), t


class _ChunkedTokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, softcap, temperature, chunk_size):
        m = hidden.shape[0]
        logp = torch.empty(m, dtype=torch.float32, device=hidden.device)
        entropy = torch.empty(m, dtype=torch.float32, device=hidden.device)
        lse = torch.empty(m, dtype=torch.float32, device=hidden.device)
        for s in range(0, m, chunk_size):
            z, _ = _chunk_logits(hidden[s:s + chunk_size], weight, softcap, temperature)  # (C, V)
            c_lse = torch.logsumexp(z, -1)  # (C,)
            lse[s:s + chunk_size] = c_lse
            logp[s:s + chunk_size] = z.gather(1, labels[s:s + chunk_size, None])[:, 0] - c_lse
            # H = lse - sum_v p_v z_v, with p = exp(z - lse) in a second (C, V) buffer
            entropy[s:s + chunk_size] = c_lse - (z - c_lse[:, None]).exp_().mul_(z).sum(-1)
            del z  # before the next chunk's logits: one chunk's buffers alive at a time
        ctx.save_for_backward(hidden, weight, labels, lse)
        ctx.softcap, ctx.temperature, ctx.chunk_size = softcap, temperature, chunk_size
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, labels, lse = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros_like(weight) if need_w else None
        for s in range(0, hidden.shape[0], ctx.chunk_size):
            h = hidden[s:s + ctx.chunk_size]
            z, t = _chunk_logits(h, weight, ctx.softcap, ctx.temperature, keep_tanh=True)  # (C, V)
            g = grad_logp[s:s + ctx.chunk_size].float()  # (C,)
            # d logp / d z = onehot(y) - softmax(z); in z's buffer
            dz = z.sub_(lse[s:s + ctx.chunk_size, None]).exp_().mul_(-g[:, None])
            dz.scatter_add_(1, labels[s:s + ctx.chunk_size, None], g[:, None])
            dz.div_(ctx.temperature)
            if t is not None:
                dz.mul_(t.mul_(t).neg_().add_(1.0))  # d/dx [c tanh(x / c)] = 1 - tanh^2
            dz = dz.to(hidden.dtype)
            if need_h:
                torch.mm(dz, weight.to(hidden.dtype), out=grad_h[s:s + ctx.chunk_size])  # (C, H)
            if need_w:
                grad_w.addmm_(dz.t().to(weight.dtype), h.to(weight.dtype))  # (V, H)
            del z, t, dz  # before the next chunk's logits and tanh: one chunk's buffers alive at a time
        return grad_h, grad_w, None, None, None, None


def chunked_token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                           softcap: float | None = None, temperature: float = 1.0,
                           chunk_size: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """log softmax(softcap(hidden @ weight^T) / temperature)[label] and the entropy of that distribution, per
    row: hidden (M, H), weight (V, H), labels (M,) -> (M,), (M,) fp32. The entropy carries no gradient."""
    if hidden.dim() != 2 or weight.dim() != 2 or labels.shape != hidden.shape[:1]:
        raise ValueError(f"chunked_token_logprobs wants hidden (M,H), weight (V,H), labels (M,); got "
                         f"{tuple(hidden.shape)}, {tuple(weight.shape)}, {tuple(labels.shape)}")
    if chunk_size < 1:
        raise ValueError(f"`chunk_size={chunk_size}` must be >= 1")
    return _ChunkedTokenLogprobs.apply(hidden, weight, labels, softcap, float(temperature), chunk_size)


def full_token_logprobs(model: nn.Module, batch: dict, temperature: float = 1.0) -> torch.Tensor:
    """Reference: log p(token t | < t) for t >= 1, (N, L-1), from the model's full logits (HF applies the
    softcap), at the rollout temperature."""
    # use_cache=False: a KV cache would grow again in every activation-checkpoint recompute.
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                   use_cache=False).logits[:, :-1].float()
    return torch.log_softmax(logits / temperature, -1).gather(2, batch["input_ids"][:, 1:, None])[..., 0]


def policy_token_logprobs(model: nn.Module, lm_head: nn.Module, batch: dict, softcap: float | None,
                          temperature: float = 1.0, chunk_size: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, L-1) log-probs and entropies of the completion tokens (0 elsewhere), scoring only the positions whose
    next token is a completion token.

    `model` is the module given to `parallelize` when sharded (its root hook gathers the lm_head, as for the
    SFT loss); `lm_head.weight` is read after that forward: under FSDP2 the gathered weight is another tensor
    than the sharded parameter the module held before it.
    """
    hidden = causal_lm_hidden_states(model, input_ids=batch["input_ids"],
                                     attention_mask=batch["attention_mask"])[:, :-1]  # (N, L-1, H)
    mask = batch["completion_mask"][:, 1:].bool()  # (N, L-1)
    labels = batch["input_ids"][:, 1:][mask]  # (M,)
    logp, entropy = chunked_token_logprobs(*head_operands(lm_head, hidden[mask]), labels, softcap=softcap,
                                           temperature=temperature, chunk_size=chunk_size)
    out = hidden.new_zeros(mask.shape, dtype=torch.float32).masked_scatter(mask, logp)
    ent = hidden.new_zeros(mask.shape, dtype=torch.float32).masked_scatter(mask, entropy)
    return out, ent
