"""Context-parallel batch sharding: cut a full-length batch into this rank's head-tail shard, and gather it back.

Owns the consistent sharding of input ids / position ids / labels / document ids and the ``RingLayout`` handed
to the model forward. Does not own which positions a rank holds (``layout.py``) or the loss reduction
(``loss.py``).

Interface for a LightningModule's ``training_step`` when CP > 1 (every CP rank holds the same full batch)::

    cp_group, cp_rank, cp_size = cp_group_info(trainer.strategy.parallel_dims.cp_mesh)
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

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_ffpa.cp.layout import RingLayout, check_seq_len, normalize_document_ids, shard_index
from lightning_ffpa.loss import IGNORE_INDEX

__all__ = ["IGNORE_INDEX", "shard_batch", "unshard"]  # IGNORE_INDEX re-exported: `lightning_ffpa.cp` has it


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
