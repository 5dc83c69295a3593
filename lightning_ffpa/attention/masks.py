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
from torch.nn.attention.flex_attention import BlockMask, and_masks, create_block_mask, create_mask

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


def build_block_mask(mod: MaskMod, batch: int, q_len: int, kv_len: int, device: torch.device | str,
                     block_size: int = 128) -> BlockMask:
    """A BlockMask over all heads; mask creation is compiled on CUDA and eager (vmap) elsewhere."""
    device = torch.device(device)
    return create_block_mask(mod, B=batch, H=None, Q_LEN=q_len, KV_LEN=kv_len, device=device,
                             BLOCK_SIZE=block_size, _compile=device.type == "cuda")


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
