"""Tokenizers for the data modules: a byte-level fallback and loading a Hugging Face tokenizer.

Owns: `ByteTokenizer`, `load_tokenizer(spec)` (a local folder or a hub id, through `AutoTokenizer`),
`tokenizer_digest` (what a checkpoint records of its tokenizer), the plain chat format used when a tokenizer has
no chat template, and `apply_template`, which turns a chat template's failures into the user's errors. Does not
own turning documents into training rows (see `documents.py`) or batching.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from typing import Any

from lightning_ffpa.errors import ConfigError, InputError, one_line

BYTE_TOKENIZER = "byte"


def format_plain_chat(messages: Sequence[dict[str, Any]], add_generation_prompt: bool = False) -> str:
    """Render messages as ``"<role>: <content>\\n"`` lines (the format for tokenizers without a template); a
    message's other fields (`tool_calls`, ...) follow its content as JSON."""
    text = "".join(f"{m['role']}: {_plain_content(m)}\n" for m in messages)
    if add_generation_prompt:
        text += "assistant: "
    return text


def _plain_content(message: dict[str, Any]) -> str:
    # null fields are left out: a parquet or arrow chat has every message's fields in every message
    others = {k: v for k, v in message.items() if k not in ("role", "content") and v is not None}
    parts = [message.get("content") or "", json.dumps(others, ensure_ascii=False) if others else ""]
    return " ".join(p for p in parts if p)


def render_chat(tokenizer: Any, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = False,
                option: str = "data.init_args.tokenizer") -> str:
    """A chat as text: by the tokenizer's chat template; the byte tokenizer's plain `role: content` lines. A
    Hugging Face tokenizer without a template is refused (transformers refuses it too): a format of our own
    would be one the model meets nowhere else, nor at inference from the exported tokenizer."""
    if getattr(tokenizer, "chat_template", None):
        return apply_template(tokenizer, messages, option, tokenize=False, add_generation_prompt=add_generation_prompt)
    if isinstance(tokenizer, ByteTokenizer):
        return format_plain_chat(messages, add_generation_prompt)
    raise ConfigError(option, getattr(tokenizer, "name_or_path", type(tokenizer).__name__),
                      "has no chat template, and the data holds chats: give the tokenizer one (`chat_template.jinja` "
                      "in its folder, or `chat_template` in tokenizer_config.json), or give the data as text")


class ChatTemplateError(InputError):
    """A chat the tokenizer's chat template refused (its `raise_exception`) or failed on; the caller says which
    record of which source it was (`record`, set by `tokenize_records`)."""

    def __init__(self, message: str, record: int | None = None) -> None:
        super().__init__(message)
        self.record = record


def apply_template(tokenizer: Any, messages: Sequence[dict[str, Any]], option: str = "data.init_args.tokenizer",
                   **kwargs: Any) -> Any:
    """`tokenizer.apply_chat_template(messages, **kwargs)`, its template's failures as the user's errors: a template
    that is not Jinja is the tokenizer's (`ConfigError` naming `option`); a chat it refuses, the data's
    (`ChatTemplateError`). Both were a jinja2 traceback."""
    import jinja2

    try:
        return tokenizer.apply_chat_template(messages, **kwargs)
    except jinja2.TemplateSyntaxError as e:
        raise ConfigError(option, getattr(tokenizer, "name_or_path", type(tokenizer).__name__),
                          f"its chat template is not valid Jinja (template line {e.lineno}): {e.message}") from e
    except jinja2.TemplateError as e:  # `raise_exception(...)` raises the base class; others are render failures
        how = "refused it" if type(e) is jinja2.TemplateError else f"failed on it ({type(e).__name__})"
        raise ChatTemplateError(f"the chat template of `{option}` {how}: {one_line(e)}") from e


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
        messages: Sequence[dict[str, Any]],
        tokenize: bool = True,
        add_generation_prompt: bool = False,
    ) -> list[int] | str:
        """Plain ``"<role>: content"`` chat format, as text or ids (HF-style signature)."""
        text = format_plain_chat(messages, add_generation_prompt)
        return self.encode(text) if tokenize else text


# what a tokenizer's `save_pretrained` writes (one at least): fast, config, sentencepiece, BPE vocab
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _looks_like_path(spec: str) -> bool:
    return spec.startswith(("/", "./", "../", "~")) or spec.count("/") > 1 or os.sep != "/" and os.sep in spec


def load_tokenizer(spec: str, option: str = "data.init_args.tokenizer") -> Any:
    """`"byte"` gives `ByteTokenizer`; else a local folder or a hub id for `AutoTokenizer.from_pretrained`.

    Every failure (no such folder, unknown id, no network and nothing cached) is one `ConfigError` naming
    `option` and the value.
    """
    if spec == BYTE_TOKENIZER:
        return ByteTokenizer()
    if not os.path.isdir(spec) and (_looks_like_path(spec) or os.path.exists(spec)):
        raise ConfigError(
            option, spec, f"is not a tokenizer folder (give a folder written by `save_pretrained`, a hub id, "
            f"or {BYTE_TOKENIZER!r} for the byte-level tokenizer)"
        )
    if os.path.isdir(spec) and not any(os.path.exists(os.path.join(spec, f)) for f in TOKENIZER_FILES):
        raise ConfigError(option, spec, f"holds no tokenizer files (none of {', '.join(TOKENIZER_FILES)}); give the "
                          "folder `save_pretrained` wrote the tokenizer to, a hub id, or 'byte'")
    from transformers import AutoTokenizer

    where = "the local folder" if os.path.isdir(spec) else "the Hugging Face hub (or its local cache)"
    try:
        tokenizer = AutoTokenizer.from_pretrained(spec)
    except Exception as e:  # one line naming the option; the cause stays chained for --debug
        raise ConfigError(option, spec, f"AutoTokenizer could not load it from {where}: {one_line(e)}") from e
    check_has_vocabulary(tokenizer, spec, option)
    return tokenizer


def check_has_vocabulary(tokenizer: Any, spec: str, option: str = "data.init_args.tokenizer") -> None:
    """A folder with only `tokenizer_config.json` (+ `special_tokens_map.json`) still loads: AutoTokenizer builds a
    tokenizer of the special tokens alone, which turns every document into one `<unk>` (or nothing)."""
    special = set(getattr(tokenizer, "all_special_ids", None) or [])
    if special and len(tokenizer) <= len(special):
        names = ", ".join(str(t) for t in getattr(tokenizer, "all_special_tokens", []))
        raise ConfigError(option, spec, f"has no vocabulary: its {len(tokenizer)} tokens are all special ({names}), "
                                        "so every document would become <unk>; the folder lacks the vocabulary file "
                                        "(tokenizer.json or tokenizer.model)")


def tokenizer_digest(tokenizer: Any) -> str:
    """A short digest of what token ids mean (the vocabulary and the special ids): a checkpoint records it, so a
    run that evaluates or resumes it with another tokenizer is refused, however either was spelled."""
    if isinstance(tokenizer, ByteTokenizer):
        return BYTE_TOKENIZER
    specials = [getattr(tokenizer, f"{n}_token_id", None) for n in ("bos", "eos", "pad")]
    vocab = json.dumps([sorted(tokenizer.get_vocab().items()), specials], ensure_ascii=False)
    return hashlib.sha256(vocab.encode()).hexdigest()[:16]


def pad_id_of(tokenizer: Any) -> int:
    """Id used for padding: pad, else eos (pad positions are masked out of loss and attention anyway)."""
    for name in ("pad_token_id", "eos_token_id"):
        value = getattr(tokenizer, name, None)
        if value is not None:
            return int(value)
    name = getattr(tokenizer, "name_or_path", type(tokenizer).__name__)
    raise ConfigError("data.init_args.tokenizer", name, "has neither a pad nor an eos token; padding needs one")
