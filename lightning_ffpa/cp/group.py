"""The context-parallel process group: who this rank is in it, its ring neighbours, and one ring shift.

Owns turning a CP DeviceMesh or process group into (group, rank, size) and the P2P send-to-next /
receive-from-previous step the rings are built from. Does not own what travels (``ring.py``, ``sliding.py``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["RingGroup", "cp_group_info"]


def cp_group_info(cp_mesh_or_group: Any) -> tuple[dist.ProcessGroup, int, int]:
    """(group, cp_rank, cp_size) from a 1-D CP DeviceMesh (e.g. ``strategy.parallel_dims.cp_mesh``) or a group."""
    group = cp_mesh_or_group.get_group() if hasattr(cp_mesh_or_group, "get_group") else cp_mesh_or_group
    return group, dist.get_rank(group), dist.get_world_size(group)


class RingGroup:
    """The CP process group plus the global ranks of this rank's ring neighbours."""

    def __init__(self, group: dist.ProcessGroup | None):
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size) if group is not None else (
            (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size) if group is not None else (
            (self.rank - 1) % self.size)

    def global_rank(self, group_rank: int) -> int:
        """Global rank of `group_rank` in the CP group."""
        return dist.get_global_rank(self.group, group_rank) if self.group is not None else group_rank

    def shift(self, send: Tensor, tag: int = 0) -> tuple[Tensor, list]:
        """Start sending `send` to the next rank and receiving the previous rank's tensor; wait() the works."""
        if self.size == 1:  # a ring of one: the tensor is already home
            return send, []
        recv = torch.empty_like(send)
        ops = [dist.P2POp(dist.isend, send.contiguous(), self.next, self.group, tag),
               dist.P2POp(dist.irecv, recv, self.prev, self.group, tag)]
        return recv, dist.batch_isend_irecv(ops)
