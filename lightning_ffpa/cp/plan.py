"""Ring plan: which (query chunk, key chunk) blocks each ring step computes, and with which kernel call.

Owns: for a ``RingLayout`` (head-tail chunks, global document ids), the per-step list of ``Block`` s a rank runs
on the K/V it holds at that step -- dense (no documents or padding inside the block), varlen (packed documents:
one segment per query run, keys restricted to the same document), or nothing. Built once per batch on the host
and cached on the layout, so the per-layer ring does no host syncs. Does not own: communication or kernels.

Head-tail facts used (rank r holds chunks a=r, b=2cp-1-r; at step i it holds K/V of src=(r-i) mod cp):
- step 0: (q=a, k=a) causal and (q=b, k=a|b) causal, bottom-right aligned;
- src < r: both query chunks see the first K/V chunk fully, the second not at all;
- src > r: only query chunk b sees both K/V chunks, fully.
So every step costs one C x 2C block: the load balance head-tail sharding buys.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_ffpa.cp.layout import RingLayout


@dataclass
class Block:
    """One attention call: local queries [q0, q1) against held keys [k0, k1)."""

    q0: int
    q1: int
    k0: int
    k1: int
    causal: bool
    kind: str  # "dense" | "varlen" | "empty"
    cu_q: Tensor | None = None  # int32 (segments+1,)
    cu_k: Tensor | None = None
    max_q: int = 0
    max_k: int = 0
    k_index: Tensor | None = None  # rows of the flattened (B*(k1-k0)) keys to gather; None = all, in order
    # Global positions [L] and documents [B, L] of the block's queries and keys (mask-based ops, e.g. Flex).
    q_pos: Tensor | None = None
    k_pos: Tensor | None = None
    q_doc: Tensor | None = None
    k_doc: Tensor | None = None


def step_blocks(rank: int, step: int, cp: int, chunk: int) -> list[tuple[int, int, int, int, bool]]:
    """(q0, q1, k0, k1, causal) ranges for `rank` at ring `step`, before looking at documents."""
    src = (rank - step) % cp
    c = chunk
    if step == 0:
        return [(0, c, 0, c, True), (c, 2 * c, 0, 2 * c, True)]
    if src < rank:
        return [(0, 2 * c, 0, c, False)]
    return [(c, 2 * c, 0, 2 * c, False)]


def _runs(row: list[int]) -> list[tuple[int, int, int]]:
    """Maximal runs (start, end, doc) of equal document ids in one row."""
    runs, start = [], 0
    for i in range(1, len(row) + 1):
        if i == len(row) or row[i] != row[start]:
            runs.append((start, i, row[start]))
            start = i
    return runs


def plan_block(q_docs: Tensor, k_docs: Tensor, q0: int, q1: int, k0: int, k1: int, causal: bool,
               device: torch.device) -> Block:
    """Segment one block by document: each query run sees the keys of its own document (contiguous)."""
    b = q_docs.shape[0]
    lk = k1 - k0
    seg_q, seg_k, k_rows = [], [], []
    dense = True
    for row in range(b):
        qrow, krow = q_docs[row].tolist(), k_docs[row].tolist()
        runs = _runs(qrow)
        dense &= len(runs) == 1 and runs[0][2] >= 0 and all(d == runs[0][2] for d in krow)
        for s, e, d in runs:
            ks = ke = 0
            if d >= 0:
                hits = [j for j, x in enumerate(krow) if x == d]
                if hits:
                    ks, ke = hits[0], hits[-1] + 1
                    if ke - ks != len(hits):  # documents are runs of global positions; this is a layout bug
                        raise AssertionError(f"document {d} is not contiguous in a key block")
                    k_rows.append(torch.arange(row * lk + ks, row * lk + ke))
            seg_q.append(e - s)
            seg_k.append(ke - ks)
    if dense:
        return Block(q0, q1, k0, k1, causal, "dense")
    if sum(seg_k) == 0:
        return Block(q0, q1, k0, k1, causal, "empty")
    k_index = torch.cat(k_rows)
    if k_index.numel() == b * lk and torch.equal(k_index, torch.arange(b * lk)):
        k_index = None
    cu = lambda lens: torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)  # noqa: E731
    return Block(q0, q1, k0, k1, causal, "varlen", cu_q=cu(seg_q).to(device), cu_k=cu(seg_k).to(device),
                 max_q=max(seg_q), max_k=max(seg_k),
                 k_index=None if k_index is None else k_index.to(device))


def ring_plan(layout: RingLayout, device: torch.device) -> list[list[Block]]:
    """Blocks per ring step for this rank, cached on the layout (one host pass per batch)."""

    def build() -> list[list[Block]]:
        cp, r, c = layout.cp_size, layout.cp_rank, layout.chunk_len
        q_docs, q_pos = layout.local_document_ids(r), layout.positions(r)
        steps = []
        for i in range(cp):
            src = (r - i) % cp
            k_docs, k_pos = layout.local_document_ids(src), layout.positions(src)
            blocks = []
            for q0, q1, k0, k1, causal in step_blocks(r, i, cp, c):
                blk = plan_block(q_docs[:, q0:q1], k_docs[:, k0:k1], q0, q1, k0, k1, causal, device)
                if blk.kind != "empty":
                    blk.q_pos, blk.k_pos = q_pos[q0:q1].to(device), k_pos[k0:k1].to(device)
                    blk.q_doc, blk.k_doc = q_docs[:, q0:q1].to(device), k_docs[:, k0:k1].to(device)
                blocks.append(blk)
            steps.append(blocks)
        return steps

    return layout.cached(("ring_plan", str(device)), build)
