"""Tokenizers for the data modules: a byte-level fallback and loading a local Hugging Face tokenizer.

Owns: `ByteTokenizer`, `load_tokenizer(spec)` and the plain chat format used when a tokenizer has no chat
template. Does not own turning documents into training rows (see `documents.py`) or batching.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

BYTE_TOKENIZER = "byte"


def format_plain_chat(messages: Sequence[dict[str, str]], add_generation_prompt: bool = False) -> str:
    """Render messages as ``"<role>: <content>\\n"`` lines (the format for tokenizers without a template)."""
    text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
    if add_generation_prompt:
        text += "assistant: "
    return text


class ByteTokenizer:
    """UTF-8 byte tokenizer: ids 0..255 are bytes, then pad, bos and eos (259 ids, fits the tiny vocab 512).

    It mimics the small part of the Hugging Face tokenizer surface the data modules use, so one code path
    serves both.
    """

    num_byte_tokens = 256
    pad_token_id = 256
    bos_token_id = 257
    eos_token_id = 258
    chat_template = None  # no template: chats use `format_plain_chat`

    @property
    def vocab_size(self) -> int:
        """Number of ids (bytes + specials)."""
        return self.num_byte_tokens + 3

    def __len__(self) -> int:
        return self.vocab_size

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Bytes of `text`; with `add_special_tokens`, wrapped in bos ... eos."""
        ids = list(text.encode("utf-8"))
        if add_special_tokens:
            ids = [self.bos_token_id, *ids, self.eos_token_id]
        return ids

    def decode(self, ids: Sequence[int] | Any, skip_special_tokens: bool = True) -> str:
        """Text of the byte ids; specials are dropped (`skip_special_tokens`) or shown as ``<pad>`` etc."""
        names = {self.pad_token_id: "<pad>", self.bos_token_id: "<bos>", self.eos_token_id: "<eos>"}
        out, buf = [], bytearray()
        for i in (int(x) for x in ids):
            if i < self.num_byte_tokens:
                buf.append(i)
                continue
            out.append(buf.decode("utf-8", errors="replace"))
            buf = bytearray()
            if not skip_special_tokens:
                out.append(names.get(i, f"<unk:{i}>"))
        out.append(buf.decode("utf-8", errors="replace"))
        return "".join(out)

    def apply_chat_template(
        self,
        messages: Sequence[dict[str, str]],
        tokenize: bool = True,
        add_generation_prompt: bool = False,
    ) -> list[int] | str:
        """Plain ``"<role>: content"`` chat format, as text or ids (HF-style signature)."""
        text = format_plain_chat(messages, add_generation_prompt)
        return self.encode(text) if tokenize else text


def load_tokenizer(spec: str) -> Any:
    """`"byte"` gives `ByteTokenizer`; anything else must be a local directory for `AutoTokenizer`."""
    if spec == BYTE_TOKENIZER:
        return ByteTokenizer()
    if not os.path.isdir(spec):
        raise FileNotFoundError(
            f"`data.tokenizer={spec!r}` is not a local tokenizer directory; give a folder written by "
            f"`save_pretrained` or {BYTE_TOKENIZER!r} for the byte-level tokenizer"
        )
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(spec)
    except Exception as e:  # re-raise with the option named; the cause stays chained
        raise ValueError(f"`data.tokenizer={spec!r}` could not be loaded by AutoTokenizer: {e}") from e


def pad_id_of(tokenizer: Any) -> int:
    """Id used for padding: pad, else eos (pad positions are masked out of loss and attention anyway)."""
    for name in ("pad_token_id", "eos_token_id"):
        value = getattr(tokenizer, name, None)
        if value is not None:
            return int(value)
    raise ValueError("`data.tokenizer` has neither a pad nor an eos token; padding needs one of them")
