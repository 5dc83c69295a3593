"""Turning text and chat records into token documents.

Owns: tokenizing each record into `(input_ids, labels)` and splitting documents longer than
`max_seq_length`. Chats are labelled on the assistant's tokens only when that can be done exactly: from
the chat template's `{% generation %}` marks (`return_assistant_tokens_mask`), or, for templates without
them (the stock Gemma4 template among them, where `return_assistant_tokens_mask` is all zeros), by
rendering growing prefixes of the chat when the template renders earlier turns the same way every time: an
assistant turn's tokens run from the end of the prefix before it rendered with the generation prompt (so
the role header the prompt adds is not learned, as with the marks) to the end of the prefix that ends with
it. Otherwise every token of the chat is learned. `TokenizeStats` counts which way each chat went. Does
not own reading files (`sources.py`), padding, packing or loaders.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lightning_ffpa.data.sources import Record, read_records
from lightning_ffpa.data.tokenizer import ChatTemplateError, apply_template, render_chat
from lightning_ffpa.loss import IGNORE_INDEX

__all__ = ["IGNORE_INDEX", "Document", "Record", "TokenizeStats", "read_records", "tokenize_records"]

GENERATION_BLOCK = re.compile(r"\{%-?\s*generation\s*-?%\}")


@dataclass
class Document:
    """One tokenized document (or one window of a long one): ids and labels of equal length (labels -100 where
    no loss is taken)."""

    input_ids: list[int]
    labels: list[int]
    record: int = 0  # index of the record it came from: the windows of one record stay on one side of a split


@dataclass
class TokenizeStats:
    """Counts of what tokenization had to change, so nothing is dropped or relabelled silently."""

    num_records: int = 0
    num_split: int = 0  # documents longer than max_seq_length, cut into windows
    num_dropped_unlabelled: int = 0  # windows with no token to learn from
    num_dropped_empty: int = 0  # texts with nothing but whitespace (they would train on bos -> eos alone)
    num_chat_generation_masked: int = 0  # chats labelled on the template's {% generation %} tokens
    num_chat_prefix_masked: int = 0  # chats labelled on the tokens each assistant message added
    num_chat_unmasked: int = 0  # chats whose template is not prefix-stable: all tokens labelled
    num_chat_header_learned: int = 0  # prefix-labelled chats where an assistant turn's role header is learned
    # too (the turn opens the chat, or the generation prompt does not render as the turn's start)
    num_chat_split: int = 0  # chats cut into windows: a window after the first lacks the turns before it


def has_generation_marks(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template marks assistant tokens with `{% generation %}`."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates: the default one renders chats
        template = template.get("default")
    return isinstance(template, str) and bool(GENERATION_BLOCK.search(template))


def tokenize_records(
    records: Sequence[Record], tokenizer: Any, max_seq_length: int
) -> tuple[list[Document], TokenizeStats]:
    """Tokenize, split to windows of at most `max_seq_length`, drop windows with nothing to learn. A chat the
    template refuses raises `ChatTemplateError` carrying its index in `records`."""
    stats = TokenizeStats(num_records=len(records))
    docs: list[Document] = []
    masked = has_generation_marks(tokenizer)
    for index, rec in enumerate(records):
        if isinstance(rec, str) and not rec.strip():
            stats.num_dropped_empty += 1
            continue
        try:
            doc = _tokenize(rec, tokenizer, masked, stats)
        except ChatTemplateError as err:  # the caller knows where record `index` came from
            raise ChatTemplateError(str(err), record=index) from err
        windows = _split(doc, max_seq_length, index)
        stats.num_split += len(windows) > 1
        stats.num_chat_split += len(windows) > 1 and not isinstance(rec, str)
        for w in windows:
            # labels[0] is never used: the model predicts token t from tokens < t
            if any(lab != IGNORE_INDEX for lab in w.labels[1:]):
                docs.append(w)
            else:
                stats.num_dropped_unlabelled += 1
    return docs, stats


def _tokenize(rec: Record, tokenizer: Any, masked: bool, stats: TokenizeStats) -> Document:
    if isinstance(rec, str):
        return _tokenize_text(rec, tokenizer)
    if masked:
        doc = _tokenize_chat_marked(rec, tokenizer)
        stats.num_chat_generation_masked += 1
        return doc
    return _tokenize_chat(rec, tokenizer, stats)


def _wrap(tokenizer: Any, ids: list[int]) -> list[int]:
    bos, eos = getattr(tokenizer, "bos_token_id", None), getattr(tokenizer, "eos_token_id", None)
    if bos is not None and (not ids or ids[0] != bos):
        ids = [bos, *ids]
    if eos is not None and (not ids or ids[-1] != eos):
        ids = [*ids, eos]
    return ids


def _tokenize_text(text: str, tokenizer: Any) -> Document:
    ids = _wrap(tokenizer, list(tokenizer.encode(text, add_special_tokens=False)))
    return Document(ids, list(ids))


def _render(tokenizer: Any, messages: list[dict[str, Any]], add_generation_prompt: bool = False) -> list[int]:
    return list(tokenizer.encode(render_chat(tokenizer, messages, add_generation_prompt), add_special_tokens=False))


def _finish_chat(tokenizer: Any, ids: list[int], labels: list[int], last_role: str) -> Document:
    """Add bos/eos where the template did not; the eos is learned only after an assistant turn."""
    wrapped = _wrap(tokenizer, ids)
    if wrapped[:1] != ids[:1]:  # a bos was prepended
        labels = [IGNORE_INDEX, *labels]
    if len(labels) < len(wrapped):  # an eos was appended
        labels.append(wrapped[-1] if last_role == "assistant" else IGNORE_INDEX)
    return Document(wrapped, labels)


def _tokenize_chat_marked(messages: list[dict[str, Any]], tokenizer: Any) -> Document:
    """Label exactly the tokens the template renders inside `{% generation %}` blocks."""
    out = apply_template(tokenizer, messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    ids = [int(i) for i in out["input_ids"]]
    labels = [i if m else IGNORE_INDEX for i, m in zip(ids, out["assistant_masks"])]
    return _finish_chat(tokenizer, ids, labels, messages[-1]["role"])


def _tokenize_chat(messages: list[dict[str, Any]], tokenizer: Any, stats: TokenizeStats) -> Document:
    """`_tokenize_prefixes`, where the template renders the chat's prefixes: one that renders only whole chats
    (say, ending on an assistant turn) is the tokenizer's limit, not the chat's fault."""
    try:
        return _tokenize_prefixes(messages, tokenizer, stats)
    except ChatTemplateError as err:
        _render(tokenizer, messages)  # the chat itself refused: that error, naming the data's line
        raise ChatTemplateError(f"{err} (on a prefix of the chat: the whole chat renders, but finding the "
                                "assistant's tokens without `{% generation %}` marks in the template renders each "
                                "prefix; mark the assistant's content with them)") from err


def _tokenize_prefixes(messages: list[dict[str, Any]], tokenizer: Any, stats: TokenizeStats) -> Document:
    """Render growing prefixes of the chat; an assistant message's span is what it adds after the generation
    prompt (the role header is the prompt's); every other token is unlabelled."""
    ids: list[int] = []
    labels: list[int] = []
    header_learned = False
    for i, msg in enumerate(messages):
        cur = _render(tokenizer, messages[: i + 1])
        if cur[: len(ids)] != ids:  # template rewrites earlier turns: cannot attribute tokens to messages
            stats.num_chat_unmasked += 1
            full = _wrap(tokenizer, _render(tokenizer, messages))
            return Document(full, list(full))
        start = len(ids)
        if msg["role"] == "assistant" and i == 0:
            # An empty chat does not render under every template: the turn keeps its header, not the bos.
            bos = getattr(tokenizer, "bos_token_id", None)
            start = int(bos is not None and cur[:1] == [bos])
            header_learned = True
        elif msg["role"] == "assistant":
            prompt = _render(tokenizer, messages[:i], add_generation_prompt=True)
            if len(prompt) > len(ids) and prompt[: len(ids)] == ids and cur[: len(prompt)] == prompt:
                start = len(prompt)
            else:
                header_learned = True
        labels += [IGNORE_INDEX] * (start - len(ids))
        labels += cur[start:] if msg["role"] == "assistant" else [IGNORE_INDEX] * (len(cur) - start)
        ids = cur
    stats.num_chat_prefix_masked += 1
    stats.num_chat_header_learned += header_learned
    return _finish_chat(tokenizer, ids, labels, messages[-1]["role"])


def _split(doc: Document, max_len: int, record: int) -> list[Document]:
    n = len(doc.input_ids)
    return [
        Document(doc.input_ids[s : s + max_len], doc.labels[s : s + max_len], record) for s in range(0, n, max_len)
    ]
