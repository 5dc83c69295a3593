"""Head-tail context-parallel layout: which tokens a CP rank holds, and the `RingLayout` the ring attention reads.

Owns: the split of a sequence into ``2cp`` equal chunks, rank ``r`` holding chunks ``r`` and ``2cp-1-r`` (so causal
work is balanced), the per-row document ids (-1 = padding) and `RingLayout` (global document ids, rank-uniform on
the CP group, plus a per-batch cache for plans and masks). Does not own: cutting a batch into shards
(``sharding.py``), communication (``group.py``) or attention (``ring.py``, ``sliding.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

__all__ = ["RingLayout", "check_seq_len", "normalize_document_ids", "shard_index"]


def shard_index(seq_len: int, cp_rank: int, cp_size: int, device: torch.device | str | None = None) -> Tensor:
    """Global token positions held by `cp_rank`: chunk `cp_rank` then chunk `2*cp_size-1-cp_rank`."""
    check_seq_len(seq_len, cp_size)
    chunk = seq_len // (2 * cp_size)
    head = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk, device=device)
    tail_start = (2 * cp_size - 1 - cp_rank) * chunk
    return torch.cat([head, torch.arange(tail_start, tail_start + chunk, device=device)])


def check_seq_len(seq_len: int, cp_size: int) -> None:
    """Raise one clear error when `seq_len` cannot be split into 2*cp equal chunks."""
    if cp_size < 1:
        raise ValueError(f"`context_parallel_size={cp_size}` must be >= 1")
    if seq_len % (2 * cp_size) != 0:
        raise ValueError(
            f"sequence length {seq_len} is not divisible by 2 * context_parallel_size = {2 * cp_size}: "
            f"set `data.max_seq_length` to a multiple of {2 * cp_size} (or change `context_parallel_size`)"
        )


def normalize_document_ids(document_ids: Tensor | None, attention_mask: Tensor | None,
                           shape: tuple[int, int]) -> Tensor:
    """Per-row run ids (0, 1, 2, ... in sequence order) with -1 for padding, so ids are monotone along a row."""
    b, s = shape
    pad = torch.zeros(b, s, dtype=torch.bool)
    if attention_mask is not None:
        pad |= attention_mask.detach().cpu().reshape(b, s) == 0
    if document_ids is None:
        return torch.where(pad, -1, 0).long()
    docs = document_ids.detach().cpu().reshape(b, s).long()
    pad |= docs < 0
    # A new run starts wherever the id changes; padding breaks runs too, so equal ids on both sides of a pad
    # are still two documents (what the unsharded mask would also do with packed sequence ids).
    change = torch.ones(b, s, dtype=torch.bool)
    change[:, 1:] = (docs[:, 1:] != docs[:, :-1]) | pad[:, 1:] | pad[:, :-1]
    runs = torch.cumsum(change.long(), dim=1) - 1
    return torch.where(pad, -1, runs)


@dataclass
class RingLayout:
    """What every CP rank knows about the batch: global document ids and its own place in the ring."""

    document_ids: Tensor  # (B, S) int64 on CPU, global order, -1 = padding; identical on every CP rank
    cp_rank: int
    cp_size: int
    _cache: dict[Any, Any] = field(default_factory=dict, repr=False)

    @property
    def seq_len(self) -> int:
        """Global sequence length S."""
        return self.document_ids.shape[1]

    @property
    def chunk_len(self) -> int:
        """Length C of one of the 2*cp chunks; each rank holds 2C tokens."""
        return self.seq_len // (2 * self.cp_size)

    def chunk_ids(self, rank: int | None = None) -> tuple[int, int]:
        """The two global chunk indices held by `rank` (default: this rank)."""
        r = self.cp_rank if rank is None else rank
        return r, 2 * self.cp_size - 1 - r

    def positions(self, rank: int | None = None) -> Tensor:
        """Global positions of the 2C local tokens of `rank` (default: this rank)."""
        r = self.cp_rank if rank is None else rank
        return shard_index(self.seq_len, r, self.cp_size)

    def local_document_ids(self, rank: int | None = None) -> Tensor:
        """(B, 2C) document ids of `rank`'s local tokens (CPU)."""
        return self.document_ids[:, self.positions(rank)]

    def cached(self, key: Any, build):
        """Memoize per-batch plans (ring blocks, sliding masks) so every layer reuses them."""
        if key not in self._cache:
            self._cache[key] = build()
        return self._cache[key]
