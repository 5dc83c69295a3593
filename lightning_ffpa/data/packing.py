"""Greedy packing of token documents into fixed-length rows.

Owns: concatenating documents in order into rows of exactly `max_seq_length` tokens, with `position_ids`
restarting at 0 per document, per-token `document_ids` (0..n-1 within a row, -1 on padding) and labels
that never predict across a document boundary. Does not own attention: consumers must use `document_ids`
to keep documents apart (a plain causal mask would let them attend to each other).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lightning_ffpa.data.documents import IGNORE_INDEX, Document

PackedRow = dict[str, torch.Tensor]


def pack_documents(docs: Sequence[Document], max_seq_length: int, pad_id: int) -> list[PackedRow]:
    """Fill rows in document order; a document that does not fit the rest of a row starts a new row."""
    rows: list[PackedRow] = []
    current: list[Document] = []
    used = 0
    for doc in docs:
        n = len(doc.input_ids)
        if n > max_seq_length:
            raise ValueError(f"document of {n} tokens exceeds `data.max_seq_length={max_seq_length}`")
        if used + n > max_seq_length:
            rows.append(_make_row(current, max_seq_length, pad_id))
            current, used = [], 0
        current.append(doc)
        used += n
    if current:
        rows.append(_make_row(current, max_seq_length, pad_id))
    return rows


def _make_row(docs: Sequence[Document], length: int, pad_id: int) -> PackedRow:
    input_ids = torch.full((length,), pad_id, dtype=torch.long)
    labels = torch.full((length,), IGNORE_INDEX, dtype=torch.long)
    position_ids = torch.zeros(length, dtype=torch.long)
    document_ids = torch.full((length,), -1, dtype=torch.long)
    start = 0
    for k, doc in enumerate(docs):
        n = len(doc.input_ids)
        input_ids[start : start + n] = torch.tensor(doc.input_ids)
        labels[start : start + n] = torch.tensor(doc.labels)
        # the model shifts labels: label[t] is predicted from token t-1, which belongs to the previous document
        labels[start] = IGNORE_INDEX
        position_ids[start : start + n] = torch.arange(n)
        document_ids[start : start + n] = k
        start += n
    return {
        "input_ids": input_ids,
        "labels": labels,
        "position_ids": position_ids,
        "document_ids": document_ids,
    }
