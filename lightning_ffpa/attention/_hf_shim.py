"""The one place that touches private or version-dependent transformers surfaces (checked on 5.17 and 5.24).

Everything the attention backend needs from transformers goes through here, so a transformers
upgrade breaks this file and nothing else.
"""

from __future__ import annotations

import transformers
from packaging.version import Version
from transformers import AttentionInterface
from transformers.masking_utils import (
    ALL_MASK_ATTENTION_FUNCTIONS,
    AttentionMaskInterface,
    prepare_padding_mask,
)

# Private helpers, identical in 5.17 and 5.24 (transformers/modeling_flash_attention_utils.py).
from transformers.modeling_flash_attention_utils import _pad_input, _unpad_input, _upad_input

MIN_TRANSFORMERS = "5.13"  # SDPA GQA fix for head_dim > 256 (transformers PR #46960)

__all__ = [
    "ALL_MASK_ATTENTION_FUNCTIONS",
    "model_attention",
    "PACKED_KWARGS",
    "check_version",
    "pad",
    "prepare_padding_mask",
    "register_attention",
    "register_mask",
    "registered_attention",
    "registered_mask",
    "unpad",
]

# FlashAttentionKwargs that carry packed-sequence boundaries (DataCollatorWithFlattening).
PACKED_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "cu_seqlens_q", "cu_seqlens_k")


def check_version() -> None:
    """Fail early on transformers older than the Gemma4/SDPA fixes this backend relies on."""
    if Version(transformers.__version__).release < Version(MIN_TRANSFORMERS).release:
        raise RuntimeError(f"lightning_ffpa's 'ffpa' attention needs transformers>={MIN_TRANSFORMERS}, "
                           f"found {transformers.__version__}")


def register_attention(name: str, fn) -> None:
    """Register an attention function globally (ALL_ATTENTION_FUNCTIONS)."""
    AttentionInterface.register(name, fn)


def register_mask(name: str, fn) -> None:
    """Register a mask function globally (ALL_MASK_ATTENTION_FUNCTIONS); without it every layer gets mask None."""
    AttentionMaskInterface.register(name, fn)


def registered_attention(name: str):
    """The attention function registered under `name`, or None."""
    return AttentionInterface._global_mapping.get(name)


def attention_names() -> set[str]:
    """Every attention implementation name registered with transformers."""
    return set(AttentionInterface._global_mapping)


def model_attention(model) -> str | None:
    """The attention implementation a model runs now (set at build or by `set_attn_implementation`)."""
    return getattr(getattr(model, "config", None), "_attn_implementation", None)


def registered_mask(name: str):
    """The mask function registered under `name`, or None."""
    return AttentionMaskInterface._global_mapping.get(name)


def unpad(query, key, value, padding_mask, q_len: int):
    """[B,S,H,D] q/k/v + 2D bool mask -> THD tensors, q indices, (cu_q, cu_k), (max_q, max_k)."""
    return _upad_input(query, key, value, padding_mask, q_len, _unpad_input)


def pad(hidden, indices, batch: int, seqlen: int):
    """THD -> [B,S,...] with zeros at padded positions."""
    return _pad_input(hidden, indices, batch, seqlen)
