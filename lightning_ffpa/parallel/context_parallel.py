"""Context-parallel (CP) batch sharding with head-tail load balancing, and the loss reduction over CP.

Owns: which tokens a CP rank holds (chunks ``r`` and ``2cp-1-r`` of ``2cp`` equal chunks, so causal work is
balanced), the consistent sharding of input ids / position ids / labels / document ids, the ``RingLayout``
that the ring attention reads (global document ids, rank-uniform on the CP group), and the CP loss reduction.
Does not own: the ring attention itself (``attention/ring.py``) or the device mesh (``parallel/strategy.py``).

Interface for the LightningModule's ``training_step`` when CP > 1 (every CP rank holds the same full batch)::

    cp_group, cp_rank, cp_size = cp_group_info(mesh["context_parallel"])
    shard = shard_batch(batch, cp_rank, cp_size)   # dict of local tensors + "ring_layout"
    out = model(input_ids=shard["input_ids"], position_ids=shard["position_ids"],
                ring_layout=shard["ring_layout"])  # HF forwards the kwarg down to the attention function
    loss_sum = F.cross_entropy(out.logits.flatten(0, 1).float(), shard["shift_labels"].flatten(),
                               ignore_index=-100, reduction="sum")
    loss = cp_loss_reduce(loss_sum, shard["num_tokens"], cp_group)  # value: global mean over the CP group

``shift_labels`` are already shifted (target of position t is label t+1, taken *before* sharding, because a
chunk boundary is not a sequence boundary): never shift them again. Padding (``attention_mask == 0``) and
packing (``document_ids``) become one document id per token, -1 for padding; tokens attend only within their
own document, on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

IGNORE_INDEX = -100


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


def shard_batch(batch: dict[str, Tensor], cp_rank: int, cp_size: int) -> dict[str, Any]:
    """Shard a full-length batch to `cp_rank` (head-tail): input_ids, position_ids, shift_labels, document_ids.

    Reads ``input_ids`` (B, S) and optionally ``labels``, ``position_ids``, ``attention_mask``,
    ``document_ids``. Returns local tensors of length 2S/(2cp), ``num_tokens`` (local supervised targets)
    and ``ring_layout`` (pass it to the model forward as ``ring_layout=``).
    """
    input_ids = batch["input_ids"]
    b, s = input_ids.shape
    check_seq_len(s, cp_size)
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank={cp_rank} is outside the context-parallel group of size {cp_size}")
    device = input_ids.device
    attention_mask = batch.get("attention_mask")
    labels = batch.get("labels")
    if labels is None:
        labels = input_ids.clone()
        if attention_mask is not None:
            labels = labels.masked_fill(attention_mask == 0, IGNORE_INDEX)
    # Shift before sharding: the target of the last token of a chunk lives in the next chunk.
    shift_labels = torch.cat([labels[:, 1:], labels.new_full((b, 1), IGNORE_INDEX)], dim=1)
    position_ids = batch.get("position_ids")
    if position_ids is None:
        position_ids = torch.arange(s, device=device).expand(b, s)
    docs = normalize_document_ids(batch.get("document_ids"), attention_mask, (b, s))
    # Padding never predicts anything: keeps the loss identical to the unsharded masked loss.
    shift_labels = shift_labels.masked_fill(docs.to(device) < 0, IGNORE_INDEX)

    idx = shard_index(s, cp_rank, cp_size, device=device)
    local_labels = shift_labels[:, idx]
    layout = RingLayout(document_ids=docs, cp_rank=cp_rank, cp_size=cp_size)
    return {
        "input_ids": input_ids[:, idx],
        "position_ids": position_ids[:, idx],
        "shift_labels": local_labels,
        "document_ids": docs[:, idx.cpu()].to(device),
        "num_tokens": (local_labels != IGNORE_INDEX).sum(),
        "ring_layout": layout,
    }


def unshard(local: Tensor, cp_rank: int, cp_size: int, group: dist.ProcessGroup | None = None,
            dim: int = 1) -> Tensor:
    """All-gather per-rank shards (along `dim`) back into global sequence order (tests, logging)."""
    parts = [torch.empty_like(local) for _ in range(cp_size)]
    dist.all_gather(parts, local.contiguous(), group=group)
    s = local.shape[dim] * cp_size
    out = torch.empty(*local.shape[:dim], s, *local.shape[dim + 1:], dtype=local.dtype, device=local.device)
    for r, part in enumerate(parts):
        out.index_copy_(dim, shard_index(s, r, cp_size, device=local.device), part)
    return out


def cp_group_info(cp_mesh_or_group: Any) -> tuple[dist.ProcessGroup, int, int]:
    """(group, cp_rank, cp_size) from a 1-D CP DeviceMesh (e.g. ``mesh["context_parallel"]``) or a group."""
    group = cp_mesh_or_group.get_group() if hasattr(cp_mesh_or_group, "get_group") else cp_mesh_or_group
    return group, dist.get_rank(group), dist.get_world_size(group)


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
