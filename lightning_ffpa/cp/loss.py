"""The loss reduction over the context-parallel group: a global token mean whose gradient suits FSDP's mean.

Owns only that reduction. Does not own the loss itself (``lightning_ffpa.loss``) or the sharding that
produced the per-rank sums (``sharding.py``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["cp_loss_reduce"]


def cp_loss_reduce(loss_sum: Tensor, num_tokens: Tensor | int, group: dist.ProcessGroup | None = None,
                   grad_scale: float | None = None) -> Tensor:
    """Global token-mean loss over the CP group; its gradient assumes the strategy averages grads over CP.

    The returned value is ``sum_r loss_sum_r / sum_r num_tokens_r`` on every rank. Its gradient on rank r is
    ``grad_scale * d(loss_sum_r) / N`` with ``grad_scale`` defaulting to the CP size, so that FSDP2's mean
    reduce-scatter over the (dp x cp) mesh yields exactly the gradient of the global mean. Pass
    ``grad_scale=1.0`` if your gradient reduction *sums* over the CP group.
    """
    cp_size = dist.get_world_size(group)
    scale = float(cp_size if grad_scale is None else grad_scale)
    counts = torch.as_tensor(num_tokens, device=loss_sum.device, dtype=torch.float32).detach().clone()
    total = loss_sum.detach().float().clone()
    both = torch.stack([total, counts.reshape(())])
    dist.all_reduce(both, group=group)
    total, n = both[0], both[1].clamp_min(1.0)
    # value == total / n; gradient == scale * d(loss_sum) / n (the detached term carries the other ranks).
    local = loss_sum.float() * scale
    return (local + (total - local.detach())) / n
