"""Block masks for paged rollouts: the logical causal/sliding mask, its per-step physical slice, and
the document-causal mask for packed prefill.

Owns mask construction only. It reads the page table's device tensors but never changes them, and it
does not run attention (`attention.py`).

Decode: one logical `BlockMask` per layer kind (full, sliding) is built once over
[max_seq_len x max_seq_len] with KV blocks of `kv_block` tokens, a divisor of the page. Each step slices the
row block of every sequence's current position and maps its logical KV blocks to physical blocks through the
page table (block j of a row lives in page table[j // r] at sub-block j % r, r = pages' blocks), so sliding
layers only list the blocks inside their window, and a row's last page is read only up to its newest token's
block: flex's decode kernel reads whole KV blocks.
"""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import BlockMask

from lightning_ffpa._compat.torch import block_mask_from_kv_blocks
from lightning_ffpa.attention.masks import build_block_mask, generate_causal

PREFILL_BLOCK = 128  # packed prefill is padded to a multiple of this (flex's default sparse block)


def logical_block_mask(max_seq_len: int, kv_block: int, window: int | None, device) -> BlockMask:
    """The one logical mask per layer kind that every decode step slices."""
    return build_block_mask(generate_causal(window=window), 1, max_seq_len, max_seq_len, device, block_size=kv_block)


def generate_paged_decode(owner: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor, page_size: int,
                          window: int | None):
    """Physical-space mask for one decode token per row: own pages, causal, inside the window."""

    def paged_decode(b, h, q_idx, kv_idx):
        block = owner[slots[b], kv_idx // page_size]  # -1 when this row's slot does not own the page
        pos = block * page_size + kv_idx % page_size
        ok = (block >= 0) & (pos <= positions[b])
        if window is not None:
            ok = ok & (positions[b] - pos < window)
        return ok

    paged_decode.__name__ = "paged_decode" if window is None else f"paged_decode_sliding_{window}"
    return paged_decode


def _to_physical(num: torch.Tensor, idx: torch.Tensor, rows: torch.Tensor, per_page: int, num_blocks: int):
    """Map logical KV block indices (B, n) through page-table rows (B, max_pages) to physical blocks
    (B, num_blocks): block j is sub-block j % per_page of page rows[j // per_page]."""
    idx = idx.long()
    blocks = torch.gather(rows, 1, idx // per_page) * per_page + idx % per_page  # (B, n)
    out = torch.zeros(idx.shape[0], num_blocks, dtype=torch.int32, device=idx.device)
    n = min(blocks.shape[1], num_blocks)  # a slot never owns more than num_pages - 1 pages
    out[:, :n] = blocks[:, :n]
    return num.to(torch.int32).view(-1, 1, 1), out.view(-1, 1, 1, num_blocks)


def decode_block_mask(logical: BlockMask, table: torch.Tensor, owner: torch.Tensor, slots: torch.Tensor,
                      positions: torch.Tensor, page_size: int, kv_block: int, window: int | None) -> BlockMask:
    """Slice `logical` (KV blocks of `kv_block` tokens) at each row's position block and convert it to physical
    blocks (graph-capturable)."""
    per_page = page_size // kv_block
    num_blocks = owner.shape[1] * per_page
    qblk = (positions // kv_block).long()  # (B,)
    rows = table[slots.long()]  # (B, max_pages)
    kv_num, kv_idx = _to_physical(logical.kv_num_blocks[0, 0, qblk], logical.kv_indices[0, 0, qblk], rows,
                                  per_page, num_blocks)
    full_num = full_idx = None
    if logical.full_kv_num_blocks is not None:
        full_num, full_idx = _to_physical(logical.full_kv_num_blocks[0, 0, qblk],
                                          logical.full_kv_indices[0, 0, qblk], rows, per_page, num_blocks)
    return block_mask_from_kv_blocks(
        kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=(kv_block, kv_block),
        mask_mod=generate_paged_decode(owner, slots, positions, page_size, window),
        seq_lengths=(1, owner.shape[1] * page_size), compute_q_blocks=False,
    )


def generate_document_causal(doc: torch.Tensor, pos: torch.Tensor, window: int | None):
    """Packed-prefill mask: same document (padding is -1 and sees nothing), causal, inside the window."""

    def document_causal(b, h, q_idx, kv_idx):
        ok = (doc[q_idx] == doc[kv_idx]) & (doc[q_idx] >= 0) & (kv_idx <= q_idx)
        if window is not None:
            ok = ok & (pos[q_idx] - pos[kv_idx] < window)
        return ok

    document_causal.__name__ = "document_causal" if window is None else f"document_causal_sliding_{window}"
    return document_causal


def prefill_block_mask(doc: torch.Tensor, pos: torch.Tensor, window: int | None,
                       block: int = PREFILL_BLOCK) -> BlockMask:
    """Document-causal mask over a packed sequence, built per block without an S x S dense pass.

    Documents are contiguous and positions restart at 0 per document, so query q reads
    [q - min(pos[q], window - 1), q]; a query block lists the KV blocks covering the union.
    """
    S = doc.shape[0]
    if S % block:
        raise ValueError(f"packed prefill length {S} is not a multiple of {block}")
    nb = S // block
    q = torch.arange(S, device=doc.device)
    back = pos if window is None else pos.clamp(max=window - 1)
    valid = doc >= 0
    big = torch.iinfo(torch.int64).max
    lo = torch.where(valid, q - back, big).view(nb, block).amin(1)
    hi = torch.where(valid, q, -1).view(nb, block).amax(1)
    has = hi >= 0
    lo_b = torch.where(has, lo // block, 0)
    num = torch.where(has, hi // block - lo_b + 1, 0)
    idx = (lo_b[:, None] + torch.arange(nb, device=doc.device)[None]).clamp(max=nb - 1)
    return block_mask_from_kv_blocks(
        num.to(torch.int32).view(1, 1, nb), idx.to(torch.int32).view(1, 1, nb, nb), BLOCK_SIZE=block,
        mask_mod=generate_document_causal(doc, pos, window), seq_lengths=(S, S), compute_q_blocks=False,
    )
