"""Batch collation: right padding for unpacked rows, stacking for packed rows.

Owns: turning a list of per-row tensors into the batch dict the LightningModule consumes:
unpacked -> `input_ids`, `labels` (-100 on padding), `attention_mask` (1 real / 0 pad, long);
packed -> `input_ids`, `labels`, `position_ids`, `document_ids`. Does not own tokenization or packing.
Collators are classes (not closures) so they pickle into dataloader worker processes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lightning_ffpa.data.documents import IGNORE_INDEX

Row = dict[str, torch.Tensor]


class PadCollate:
    """Right-pad `input_ids`/`labels` to the longest row of the batch, rounded up to `multiple` (at most
    `max_length`, never below the longest row), and build the 2D attention mask. Rounding bounds how many
    distinct batch lengths a run sees: each compiles the model's kernels once."""

    def __init__(self, pad_id: int, multiple: int = 1, max_length: int | None = None) -> None:
        self.pad_id, self.multiple, self.max_length = pad_id, multiple, max_length

    def __call__(self, rows: Sequence[Row]) -> dict[str, torch.Tensor]:
        longest = max(len(r["input_ids"]) for r in rows)
        length = -(-longest // self.multiple) * self.multiple
        if self.max_length is not None:
            length = max(longest, min(length, self.max_length))
        input_ids = torch.full((len(rows), length), self.pad_id, dtype=torch.long)  # (B, S)
        labels = torch.full((len(rows), length), IGNORE_INDEX, dtype=torch.long)  # (B, S)
        attention_mask = torch.zeros((len(rows), length), dtype=torch.long)  # (B, S)
        for i, r in enumerate(rows):
            n = len(r["input_ids"])
            input_ids[i, :n] = r["input_ids"]
            labels[i, :n] = r["labels"]
            attention_mask[i, :n] = 1
        return {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask}


class PackedCollate:
    """Stack packed rows (all already `max_seq_length` long)."""

    keys = ("input_ids", "labels", "position_ids", "document_ids")

    def __call__(self, rows: Sequence[Row]) -> dict[str, torch.Tensor]:
        return {k: torch.stack([r[k] for r in rows]) for k in self.keys}  # each (B, S)
