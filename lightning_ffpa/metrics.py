"""torchmetrics for language modelling: token-weighted loss and perplexity, reduced across ranks."""

from __future__ import annotations

import torch
from torchmetrics import Metric


class TokenPerplexity(Metric):
    """exp(mean NLL per token), weighting each batch's mean loss by its number of real tokens."""

    full_state_update = False

    def __init__(self) -> None:
        super().__init__()
        self.add_state("nll_sum", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("tokens", default=torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")

    def update(self, mean_loss: torch.Tensor, n_tokens: torch.Tensor) -> None:
        self.nll_sum += mean_loss.detach().double() * n_tokens
        self.tokens += n_tokens

    def compute(self) -> torch.Tensor:
        return torch.exp(self.nll_sum / self.tokens.clamp(min=1)).float()
