"""Token-exact gradients under gradient accumulation and data parallelism.

Lightning divides each micro-batch's loss by `accumulate_grad_batches` and the strategies average gradients over
the ranks, so a per-micro-batch mean loss weighs every micro-batch equally, whatever its number of labelled
tokens (padding, the tail of a packed bin, masked prompts). The step's true objective is the mean over all of
its labelled tokens. `TokenWeights` gets it without knowing the window's token count in advance: each micro-batch
backpropagates its summed loss (times `SUM_SCALE`), its local token count is kept, and once the window's last
backward is done the gradients are multiplied by ``A * W / (N * SUM_SCALE)`` (A micro-batches, W ranks, N labelled
tokens summed over both). With one micro-batch on one rank the mean loss is already exact and none of this runs.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from lightning_ffpa._compat import torch as torch_compat

# The summed loss is backpropagated times this constant (a power of two: exact), which the step's scale divides
# out again; it keeps the gradients near a mean loss's size for fp16's loss scaler and float8's casts.
SUM_SCALE = 2.0 ** -12


class TokenWeights:
    """One optimizer step's labelled-token count, and the gradient scale it gives."""

    def __init__(self) -> None:
        self._count: torch.Tensor | None = None

    @staticmethod
    def needed(trainer: Any) -> bool:
        """More than one micro-batch or rank per step; otherwise the micro-batch's mean is exact and the pass over
        the gradients (and its all-reduce) is skipped."""
        return trainer.accumulate_grad_batches > 1 or trainer.world_size > 1

    def add(self, n_tokens: torch.Tensor) -> None:
        """Count one micro-batch's labelled tokens (this rank's; under CP its own shard)."""
        n = n_tokens.detach().to(torch.float32)
        self._count = n if self._count is None else self._count + n

    @staticmethod
    def loss(mean: torch.Tensor, nll_sum: torch.Tensor) -> torch.Tensor:
        """The value to backpropagate: the mean's value (what logs and callbacks read), the summed loss's gradient."""
        summed = nll_sum * SUM_SCALE
        return mean.detach() + (summed - summed.detach())

    def scale_grads(self, trainer: Any, params: Iterable[nn.Parameter]) -> None:
        """Turn the window's accumulated gradients into the gradient of the mean over its labelled tokens."""
        if self._count is None:  # no training_step counted (a subclass's own step): leave the gradients alone
            return
        total = trainer.strategy.reduce(self._count.clone(), reduce_op="sum")
        self._count = None
        scale = float(trainer.accumulate_grad_batches * trainer.world_size / SUM_SCALE) / total.clamp(min=1.0)
        torch_compat.scale_local_grads_([p.grad for p in params if p.grad is not None], scale)

    def reset(self) -> None:
        """Forget a window that ended without its last backward (an interrupted fit)."""
        self._count = None
