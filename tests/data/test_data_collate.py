"""Padding collate and packing: masks, -100 labels, position/document ids, no cross-document labels."""

import pytest
import torch

from lightning_ffpa.data import IGNORE_INDEX, Document, PackedCollate, PadCollate, pack_documents

PAD = 99


def _row(ids, labels=None):
    ids = torch.tensor(ids)
    return {"input_ids": ids, "labels": ids.clone() if labels is None else torch.tensor(labels)}


def test_pad_collate_right_pads_and_masks():
    batch = PadCollate(pad_id=PAD)([_row([1, 2, 3]), _row([4, 5], [-100, 5]), _row([6, 7, 8, 9, 10])])
    assert set(batch) == {"input_ids", "labels", "attention_mask"}
    assert all(v.dtype == torch.long and v.shape == (3, 5) for v in batch.values())
    assert batch["input_ids"].tolist() == [[1, 2, 3, PAD, PAD], [4, 5, PAD, PAD, PAD], [6, 7, 8, 9, 10]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1]]
    assert batch["labels"].tolist() == [[1, 2, 3, -100, -100], [-100, 5, -100, -100, -100], [6, 7, 8, 9, 10]]


def test_pad_collate_rounds_up_to_the_multiple_within_the_longest_row_and_the_cap():
    rows = [_row([1, 2, 3]), _row([4, 5, 6, 7, 8])]
    batch = PadCollate(pad_id=PAD, multiple=4)(rows)
    assert batch["input_ids"].shape == (2, 8) and batch["attention_mask"].sum().item() == 8
    assert batch["input_ids"][1].tolist() == [4, 5, 6, 7, 8, PAD, PAD, PAD]
    assert PadCollate(pad_id=PAD, multiple=4, max_length=6)(rows)["input_ids"].shape == (2, 6)  # capped
    assert PadCollate(pad_id=PAD, multiple=4, max_length=4)(rows)["input_ids"].shape == (2, 5)  # never cut
    lengths = {PadCollate(pad_id=PAD, multiple=4, max_length=16)([_row(list(range(n)))])["input_ids"].shape[1]
               for n in range(1, 17)}
    assert lengths == {4, 8, 12, 16}


def test_packing_ids_and_boundaries():
    docs = [
        Document([10, 11, 12], [10, 11, 12]),
        Document([20, 21], [-100, 21]),
        Document([30, 31, 32, 33], [30, 31, 32, 33]),
        Document([40], [40]),
    ]
    rows = pack_documents(docs, max_seq_length=6, pad_id=PAD)
    # greedy in order: [doc0 doc1] (5) | doc2 does not fit -> new row [doc2 doc3] (5)
    assert len(rows) == 2
    r0, r1 = rows
    assert r0["input_ids"].tolist() == [10, 11, 12, 20, 21, PAD]
    assert r0["position_ids"].tolist() == [0, 1, 2, 0, 1, 0]
    assert r0["document_ids"].tolist() == [0, 0, 0, 1, 1, -1]
    assert r1["document_ids"].tolist() == [0, 0, 0, 0, 1, -1]
    assert r1["position_ids"].tolist() == [0, 1, 2, 3, 0, 0]
    # first token of every document never gets a label (it would be predicted from the previous document)
    assert r0["labels"].tolist() == [-100, 11, 12, -100, 21, -100]
    assert r1["labels"].tolist() == [-100, 31, 32, 33, -100, -100]
    batch = PackedCollate()(rows)
    assert set(batch) == {"input_ids", "labels", "position_ids", "document_ids"}
    assert all(v.dtype == torch.long and v.shape == (2, 6) for v in batch.values())


def test_packing_never_predicts_across_documents():
    g = torch.Generator().manual_seed(0)
    docs = []
    for _ in range(40):
        n = int(torch.randint(1, 9, (1,), generator=g))
        ids = torch.randint(0, 50, (n,), generator=g).tolist()
        docs.append(Document(ids, list(ids)))
    rows = pack_documents(docs, max_seq_length=16, pad_id=PAD)
    total = 0
    for r in rows:
        doc_ids, labels, pos = r["document_ids"], r["labels"], r["position_ids"]
        real = doc_ids >= 0
        total += int(real.sum())
        # shifted pairs (t-1 -> t): a label counts only when both tokens are in the same document
        used = labels[1:] != IGNORE_INDEX
        assert torch.all(doc_ids[1:][used] == doc_ids[:-1][used])
        assert torch.all(labels[~real] == IGNORE_INDEX)
        # positions restart at 0 on each document start
        starts = real & torch.cat([torch.tensor([True]), doc_ids[1:] != doc_ids[:-1]])
        assert torch.all(pos[starts] == 0)
        assert torch.all(pos[real][1:][~starts[real][1:]] == pos[real][:-1][~starts[real][1:]] + 1)
    assert total == sum(len(d.input_ids) for d in docs)  # nothing lost


def test_packing_rejects_overlong_document():
    with pytest.raises(ValueError, match=r"data\.max_seq_length=4"):
        pack_documents([Document([1] * 5, [1] * 5)], max_seq_length=4, pad_id=PAD)
