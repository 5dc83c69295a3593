"""torchmetrics for language modelling: token-weighted loss and perplexity, reduced across ranks."""

from __future__ import annotations

import torch
from torchmetrics import Metric


class TokenMeanLoss(Metric):
    """Mean NLL per token over every batch seen: each batch's mean loss weighted by its number of real tokens
    (a mean of batch means would weigh a row of few labelled tokens, a short chat answer, as much as a long one)."""

    full_state_update = False

    def __init__(self) -> None:
        super().__init__()
        self.add_state("nll_sum", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("tokens", default=torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")

    def update(self, mean_loss: torch.Tensor, n_tokens: torch.Tensor) -> None:
        self.nll_sum += mean_loss.detach().double() * n_tokens
        self.tokens += n_tokens

    def _mean(self) -> torch.Tensor:
        return self.nll_sum / self.tokens.clamp(min=1)

    def compute(self) -> torch.Tensor:
        return self._mean().float()


class TokenPerplexity(TokenMeanLoss):
    """exp(mean NLL per token): exactly exp of `TokenMeanLoss` over the same batches."""

    def compute(self) -> torch.Tensor:
        return torch.exp(self._mean()).float()


def total_grad_norm(parameters) -> torch.Tensor | None:
    """The L2 norm of all gradients together (what clipping by norm compares), the same on every rank.

    FSDP2's gradients are DTensor shards: each device mesh's are reduced with one all-reduce (expert-parallel
    stacks live on a mesh of their own, so one stack of norms over every mesh would not do). None without gradients.
    """
    from torch.distributed.tensor import DTensor

    by_mesh: dict[object, list[torch.Tensor]] = {}
    for p in parameters:
        if p.grad is not None:
            by_mesh.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p.grad)
    squares = []
    for grads in by_mesh.values():
        # in fp32: bf16 gradients' norms came out rounded to bf16 (31.25, 28.125 on an H100); a sharded gradient's
        # norm is a partial one, and stacking them keeps it partial until `full_tensor` (one collective per mesh)
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32)
                                                     for g in grads]))
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
        squares.append(norm.float().square())
    return torch.stack(squares).sum().sqrt() if squares else None
