"""Packed documents at CP=1: per-token document ids -> FFPA varlen ``cu_seqlens`` and document-aware masks.

Owns ``PackedDocuments`` (one per batch: segments over the flattened ``[B*S]`` tokens, their ``cu_seqlens``
and the masks built from them), ``packed_inputs`` (the model-forward kwargs ``Gemma4LM.compute_loss`` passes
for a packed batch) and ``check_packing`` (which ``attn_implementation`` values keep documents apart).
Does not own routing (``backend.py``) or the CP > 1 ring, which carries documents in ``RingLayout``.

A segment is a maximal run of tokens of one document in one row; a run of padding (document id -1) is a
segment of its own, so padding never mixes with a document and its (unused) outputs stay finite.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

from lightning_ffpa._compat import transformers as hf_compat
from lightning_ffpa.attention import masks
from lightning_ffpa.errors import ConfigError

__all__ = ["POSITION_IDS_IMPLEMENTATIONS", "PackedDocuments", "check_packing", "packed_inputs"]

# HF implementations whose masks split packed rows by `position_ids` resets (transformers.masking_utils
# `find_packed_sequence_indices`, used when no 2D attention_mask and no cache are given; 5.17 and 5.24).
POSITION_IDS_IMPLEMENTATIONS = ("sdpa", "eager", "flex_attention")
HONOURING = ("ffpa", *POSITION_IDS_IMPLEMENTATIONS)


@dataclass(eq=False)
class PackedDocuments:
    """Document segments of one packed batch, passed to the model forward as ``documents=``."""

    segment_ids: Tensor
    """(B, S) int64: one id per segment, unique over the whole batch (rows never share a segment)."""
    cu_seqlens: Tensor
    """(N + 1,) int32 segment boundaries over the flattened B*S tokens (the FFPA varlen contract)."""
    max_seqlen: int
    """Length of the longest segment."""
    _masks: dict[Any, Any] = field(default_factory=dict, repr=False)

    @property
    def shape(self) -> tuple[int, int]:
        """(B, S) of the batch these segments cover."""
        return tuple(self.segment_ids.shape)

    @classmethod
    def from_starts(cls, starts: Tensor) -> PackedDocuments:
        """From a (B, S) bool tensor that is True where a new segment starts (row starts are added)."""
        starts = starts.clone()
        starts[:, 0] = True
        flat = starts.reshape(-1)
        segment_ids = (flat.long().cumsum(0) - 1).view(starts.shape)
        bounds = torch.cat([flat.nonzero().squeeze(1), flat.new_tensor([flat.numel()], dtype=torch.long)])
        cu = bounds.to(torch.int32)
        return cls(segment_ids, cu, int((bounds[1:] - bounds[:-1]).max()))  # one host sync per batch

    @classmethod
    def from_document_ids(cls, document_ids: Tensor, attention_mask: Tensor | None = None) -> PackedDocuments:
        """From per-token document ids (B, S) with -1 on padding (``data.PackedCollate``); 0s in a 2D mask pad too."""
        docs = document_ids.long()
        if attention_mask is not None:
            docs = docs.masked_fill(attention_mask == 0, -1)
        starts = torch.zeros_like(docs, dtype=torch.bool)
        starts[:, 1:] = docs[:, 1:] != docs[:, :-1]
        return cls.from_starts(starts)

    @classmethod
    def from_position_ids(cls, position_ids: Tensor) -> PackedDocuments:
        """From (B, S) position ids: a segment starts wherever the position does not grow by 1 (HF's rule)."""
        starts = torch.zeros_like(position_ids, dtype=torch.bool)
        starts[:, 1:] = position_ids[:, 1:] - position_ids[:, :-1] != 1
        return cls.from_starts(starts)

    def mask_mod(self, window: int | None = None) -> masks.MaskMod:
        """Causal (or causal sliding-window) AND same segment."""
        base = masks.generate_causal() if window is None else masks.generate_sliding_window(window)
        return masks.combine(base, masks.generate_document(self.segment_ids))

    def block_mask(self, window: int | None, device: torch.device) -> BlockMask:
        """The Flex mask for a layer with this window (None: full causal), built once per batch."""
        return self._cached(masks.build_block_mask, window, device)

    def dense_mask(self, window: int | None, device: torch.device) -> Tensor:
        """The same mask as a bool tensor (B, 1, S, S) for the SDPA/eager fallbacks, built once per batch."""
        return self._cached(masks.dense_mask, window, device)

    def _cached(self, build, window: int | None, device: torch.device):
        key = (build.__name__, window, str(device))
        if key not in self._masks:
            b, s = self.shape
            self._masks[key] = build(self.mask_mod(window), b, s, s, device)
        return self._masks[key]

def check_packing(attn_implementation: str, pack: bool, option: str = "model.attn_implementation") -> None:
    """Raise ConfigError (naming `option`, the one that chose the attention) when packed rows meet an attention that
    would let their documents see each other."""
    if pack and attn_implementation not in HONOURING:
        raise ConfigError(option, attn_implementation,
                          f"cannot keep packed documents apart (`data.pack=true`); use one of {list(HONOURING)} "
                          "or set `data.pack=false`")


def packed_inputs(batch: dict[str, Tensor], attn_implementation: str | Any) -> dict[str, Any]:
    """Extra model-forward kwargs that keep the documents of a packed batch apart (empty if not packed).

    `attn_implementation` is a name or an HF model (then the implementation it runs now). "ffpa" gets ``documents=`` (varlen full layers, document-aware Flex sliding layers). HF's own
    implementations split rows by ``position_ids`` resets, so those must be present and agree.
    """
    document_ids = batch.get("document_ids")
    if document_ids is None:
        return {}
    if not isinstance(attn_implementation, str):
        config = getattr(attn_implementation, "config", None)
        attn_implementation = None if config is None else hf_compat.config_attn_implementation(config)
    check_packing(attn_implementation, True)
    attention_mask = batch.get("attention_mask")
    if attn_implementation == "ffpa":
        return {"documents": PackedDocuments.from_document_ids(document_ids, attention_mask)}
    position_ids = batch.get("position_ids")
    if attention_mask is not None or position_ids is None:
        raise ValueError(f"packed batch for attn_implementation={attn_implementation!r}: HF splits documents by "
                         "`position_ids` restarting at 0 with no `attention_mask`; this batch has "
                         f"position_ids={'absent' if position_ids is None else 'present'}, "
                         f"attention_mask={'present' if attention_mask is not None else 'absent'}")
    by_docs = PackedDocuments.from_document_ids(document_ids).segment_ids
    by_pos = PackedDocuments.from_position_ids(position_ids).segment_ids
    real = document_ids >= 0
    # Every document boundary must be a position reset (HF then splits there); padding may split further.
    same_doc = real[:, 1:] & (by_docs[:, 1:] == by_docs[:, :-1])
    doc_start = real[:, 1:] & (by_docs[:, 1:] != by_docs[:, :-1])
    pos_start = by_pos[:, 1:] != by_pos[:, :-1]
    if bool((doc_start & ~pos_start).any() | (same_doc & pos_start).any()):
        raise ValueError("packed batch: `position_ids` do not restart exactly where `document_ids` change, so "
                         f"attn_implementation={attn_implementation!r} would mix documents; use 'ffpa' or fix the data")
    return {}
