"""Mask mods (index functions ``(b, h, q, kv) -> bool``) and BlockMask / dense-mask builders.

Factories return named closures so BlockMasks and logs say what they hold. This file owns mask
*construction* only, for the training backend (``backend.py`` decides which layer gets which mask) and the
rollout engine (``rollout/masks.py`` builds its logical per-layer-kind masks from ``generate_causal``). The
ring's per-block document-causal mod works on global positions and lives with it (``cp/flex_blocks.py``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, and_masks, create_mask

MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]


def _named(fn: MaskMod, name: str) -> MaskMod:
    fn.__name__ = name
    return fn


def generate_causal(q_len: int | None = None, kv_len: int | None = None, *, window: int | None = None) -> MaskMod:
    """Causal mask, bottom-right aligned when q_len and kv_len differ (query i sees kv <= i + kv_len - q_len);
    with `window`, only the last `window` keys including the query's own (HF Gemma's sliding convention)."""
    shift = 0 if q_len is None or kv_len is None else kv_len - q_len
    suffix = f"_shift{shift}" if shift else ""
    if window is None:

        def causal(b, h, q_idx, kv_idx):
            return kv_idx <= q_idx + shift

        return _named(causal, f"causal{suffix}")

    def sliding_window(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx + shift) & (q_idx + shift - kv_idx < window)

    return _named(sliding_window, f"sliding_window_{window}{suffix}")


def generate_sliding_window(window: int) -> MaskMod:
    """Causal sliding window of `window` keys including the query's own (HF Gemma convention)."""
    return generate_causal(window=window)


def generate_padding(padding_mask: Tensor) -> MaskMod:
    """Keys allowed by a 2D bool padding mask ``[B, KV]`` (True = real token)."""

    def padding(b, h, q_idx, kv_idx):
        return padding_mask[b, kv_idx]

    return _named(padding, "padding")


def generate_document(doc_ids_q: Tensor, doc_ids_kv: Tensor | None = None) -> MaskMod:
    """Only same-document pairs, from per-token document ids ``[B, S]`` (packed sequences)."""
    doc_kv = doc_ids_q if doc_ids_kv is None else doc_ids_kv

    def document(b, h, q_idx, kv_idx):
        return doc_ids_q[b, q_idx] == doc_kv[b, kv_idx]

    return _named(document, "document")


def with_offsets(mod: MaskMod, q_offset: int, kv_offset: int) -> MaskMod:
    """Shift indices so a mod written for absolute positions works on a [q_offset:, kv_offset:] slice."""
    if not q_offset and not kv_offset:
        return mod

    def offset(b, h, q_idx, kv_idx):
        return mod(b, h, q_idx + q_offset, kv_idx + kv_offset)

    return _named(offset, f"{getattr(mod, '__name__', 'mask')}_offset")


def combine(*mods: MaskMod | None) -> MaskMod:
    """AND of the given mods (None entries are skipped)."""
    kept = [m for m in mods if m is not None]
    return kept[0] if len(kept) == 1 else and_masks(*kept)


# Mask elements evaluated at once while building a BlockMask (bools; intermediates stay a small multiple).
_CHUNK_ELEMENTS = 1 << 26


def build_block_mask(mod: MaskMod, batch: int, q_len: int, kv_len: int, device: torch.device | str,
                     block_size: int = 128) -> BlockMask:
    """A BlockMask over all heads, from the mod evaluated eagerly in chunks of query rows.

    Not `create_block_mask(_compile=True)`: compiling mask creation took minutes of the first 16k step on a
    fresh machine (docs/performance.md), while the eager pass is one elementwise sweep of the mask per batch.
    Chunking keeps memory bounded at long lengths. The result equals `create_block_mask`'s (tested)."""
    device = torch.device(device)
    n_kv = -(-kv_len // block_size)
    rows = max(1, _CHUNK_ELEMENTS // (batch * n_kv * block_size * block_size)) * block_size
    partial, full = [], []
    for start in range(0, q_len, rows):
        n = min(rows, q_len - start)
        dense = create_mask(with_offsets(mod, start, 0), batch, 1, n, kv_len, device=device)
        pad_q, pad_kv = -n % block_size, n_kv * block_size - kv_len
        dense = torch.nn.functional.pad(dense, (0, pad_kv, 0, pad_q))  # padding is masked out, as torch does
        blocks = dense.view(batch, 1, -1, block_size, n_kv, block_size).sum((3, 5), dtype=torch.int32)
        partial.append((blocks > 0) & (blocks < block_size * block_size))
        full.append(blocks == block_size * block_size)
    kv_num, kv_idx = _ordered(torch.cat(partial, dim=2))
    full_num, full_idx = _ordered(torch.cat(full, dim=2))
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=block_size, mask_mod=mod,
                                    seq_lengths=(q_len, kv_len))


def _ordered(blocks: Tensor) -> tuple[Tensor, Tensor]:
    """Per query block: how many KV blocks are set, and their indices first (stable order, as torch lists them)."""
    blocks = blocks.to(torch.int32)
    indices = torch.argsort(blocks, dim=-1, descending=True, stable=True)
    return blocks.sum(-1, dtype=torch.int32), indices.to(torch.int32)


def dense_mask(mod: MaskMod, batch: int, q_len: int, kv_len: int, device: torch.device | str) -> Tensor:
    """A mod materialised as a bool mask ``[B, 1, Q, KV]`` (the eager/SDPA fallbacks' form)."""
    return create_mask(mod, batch, 1, q_len, kv_len, device=torch.device(device))


def dense_from_block_mask(block_mask: BlockMask, device: torch.device) -> Tensor:
    """Materialise a BlockMask as a bool mask ``[B, 1|H, Q, KV]`` (used by the eager/SDPA fallbacks)."""
    b, h, _, _ = block_mask.shape
    q_len, kv_len = block_mask.seq_lengths
    return create_mask(block_mask.mask_mod, b, h, q_len, kv_len, device=device)


def dense_causal_padding(padding_mask: Tensor | None, q_len: int, kv_len: int, causal: bool,
                         device: torch.device) -> Tensor | None:
    """Bool mask ``[B|1, 1, Q, KV]`` from bottom-right causality and a 2D padding mask, or None if neither."""
    mask = None
    if causal:
        mask = (torch.arange(kv_len, device=device)[None, :]
                <= torch.arange(q_len, device=device)[:, None] + (kv_len - q_len))[None, None]
    if padding_mask is not None:
        pad = padding_mask[:, None, None, -kv_len:].to(device=device, dtype=torch.bool)
        mask = pad if mask is None else mask & pad
    return mask
