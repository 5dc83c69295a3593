"""Flex block ops for the ring: the baseline the FFPA ring is measured against (benchmarks/context_parallel.py).

Owns: one ring block computed by ``flex_attention`` with a document-causal mask over the block's global
positions, returning its log-sum-exp, and that block's backward. Flex exposes no backward that takes an
external (globally merged) log-sum-exp, so ``bwd`` recomputes the block forward under autograd and
back-propagates the block's share of the merged output: ``o = sum_i w_i o_i`` with ``w_i = exp(lse_i - lse)``
gives ``d o_i = w_i do`` and ``d lse_i = w_i <do, o_i - o>``. That extra forward is part of the baseline's cost.
Does not own: the ring itself (``ring.py``) or the kernel options (``lightning_ffpa.attention.flex``).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import flex_attention

from lightning_ffpa.attention.flex import compiled_flex, kernel_options
from lightning_ffpa.attention.masks import build_block_mask
from lightning_ffpa.cp.plan import Block


def block_mask_mod(blk: Block):
    """Same document (not padding) and key not after query, in global positions."""
    q_pos, k_pos, q_doc, k_doc = blk.q_pos, blk.k_pos, blk.q_doc, blk.k_doc

    def document_causal(b, h, qi, ki):
        return (q_doc[b, qi] == k_doc[b, ki]) & (q_doc[b, qi] >= 0) & (k_pos[ki] <= q_pos[qi])

    return document_causal


class FlexBlockOps:
    """Ring block ops on [B, L, H, D] tensors through (compiled, on CUDA) flex_attention."""

    def __init__(self):
        self._flex = compiled_flex() if torch.cuda.is_available() else flex_attention
        self._masks: dict[int, object] = {}

    def _run(self, blk: Block, q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor]:
        key = id(blk)
        if key not in self._masks or self._masks[key][0] is not blk:
            bm = build_block_mask(block_mask_mod(blk), q.shape[0], q.shape[1], k.shape[1], q.device)
            self._masks = {key: (blk, bm)} if len(self._masks) > 64 else {**self._masks, key: (blk, bm)}
        bm = self._masks[key][1]
        o, lse = self._flex(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=bm, scale=scale,
                            enable_gqa=q.shape[2] != k.shape[2], return_lse=True,
                            kernel_options=kernel_options(q.shape[-1], q.dtype) if q.is_cuda else None)
        return o.transpose(1, 2), lse.float()  # (B, Lq, Hq, D), (B, Hq, Lq)

    def fwd(self, blk: Block, q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor]:
        """(o [B,Lq,Hq,D], lse [B,Hq,Lq]) of one block."""
        with torch.no_grad():
            return self._run(blk, q, k, v, scale)

    def bwd(self, blk: Block, do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor,
            scale: float) -> tuple[Tensor, Tensor, Tensor]:
        """(dq, dk, dv) of one block's share of the merged output (recomputes the block forward)."""
        q_, k_, v_ = (t.detach().requires_grad_() for t in (q, k, v))
        with torch.enable_grad():
            o_i, lse_i = self._run(blk, q_, k_, v_, scale)
            w = torch.exp(lse_i - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse))  # (B, H, Lq)
            w = torch.where(torch.isinf(lse_i), torch.zeros_like(w), w)
            w_t = w.transpose(1, 2).unsqueeze(-1)  # (B, Lq, H, 1)
            d_o = (w_t * do.float()).to(o_i.dtype)
            d_lse = w * (do.float() * (o_i.detach().float() - o.float())).sum(-1).transpose(1, 2)
            grads = torch.autograd.grad([o_i, lse_i], [q_, k_, v_], [d_o, d_lse.to(lse_i.dtype)], allow_unused=True)
        return tuple(torch.zeros_like(t) if g is None else g for g, t in zip(grads, (q, k, v)))
