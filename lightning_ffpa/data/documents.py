"""Reading local data files into token documents.

Owns: parsing .txt (blank-line separated documents) and .jsonl (`text` or chat `messages` per line),
tokenizing each record into `(input_ids, labels)` with -100 on non-assistant chat tokens, and splitting
documents longer than `max_seq_length`. Does not own padding, packing or loaders.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lightning_ffpa.data.tokenizer import format_plain_chat

IGNORE_INDEX = -100
Record = str | list[dict[str, str]]  # plain text, or a chat as a list of {role, content}


@dataclass
class Document:
    """One tokenized document: ids and labels of equal length (labels -100 where no loss is taken)."""

    input_ids: list[int]
    labels: list[int]


@dataclass
class TokenizeStats:
    """Counts of what tokenization had to change, so nothing is dropped or relabelled silently."""

    num_records: int = 0
    num_split: int = 0  # documents longer than max_seq_length, cut into windows
    num_dropped_unlabelled: int = 0  # windows with no token to learn from
    num_chat_unmasked: int = 0  # chats whose template is not prefix-stable: all tokens labelled


def read_records(path: str, option: str) -> list[Record]:
    """Records of a .txt (split at blank lines) or .jsonl file; errors name `option` and the file."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"`{option}={path!r}` does not exist or is not a file")
    ext = os.path.splitext(path)[1].lower()
    with open(path, encoding="utf-8") as f:
        raw = f.read()
    if ext == ".txt":
        records: list[Record] = [p.strip() for p in re.split(r"\n\s*\n", raw) if p.strip()]
    elif ext == ".jsonl":
        records = [
            _parse_jsonl_line(line, path, n, option)
            for n, line in enumerate(raw.splitlines(), 1)
            if line.strip()
        ]
    else:
        raise ValueError(f"`{option}={path!r}` must end in .txt or .jsonl, not {ext!r}")
    if not records:
        raise ValueError(f"`{option}={path!r}` holds no documents (the file is empty or blank)")
    return records


def _parse_jsonl_line(line: str, path: str, lineno: int, option: str) -> Record:
    where = f"`{option}={path!r}` line {lineno}"
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where} is not valid JSON: {e}") from e
    if isinstance(obj, dict) and isinstance(obj.get("text"), str):
        return obj["text"]
    if isinstance(obj, dict) and isinstance(obj.get("messages"), list):
        msgs = obj["messages"]
        ok = all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in msgs
        )
        if ok and msgs:
            return [{"role": m["role"], "content": m["content"]} for m in msgs]
        raise ValueError(f"{where}: `messages` must be a non-empty list of {{role: str, content: str}}")
    raise ValueError(f"{where} needs a string `text` or a list `messages`")


def tokenize_records(
    records: Sequence[Record], tokenizer: Any, max_seq_length: int
) -> tuple[list[Document], TokenizeStats]:
    """Tokenize, split to windows of at most `max_seq_length`, drop windows with nothing to learn."""
    stats = TokenizeStats(num_records=len(records))
    docs: list[Document] = []
    for rec in records:
        doc = (
            _tokenize_chat(rec, tokenizer, stats) if isinstance(rec, list) else _tokenize_text(rec, tokenizer)
        )
        windows = _split(doc, max_seq_length)
        stats.num_split += len(windows) > 1
        for w in windows:
            # labels[0] is never used: the model predicts token t from tokens < t
            if any(lab != IGNORE_INDEX for lab in w.labels[1:]):
                docs.append(w)
            else:
                stats.num_dropped_unlabelled += 1
    return docs, stats


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


def _render(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, tokenize=False)
    else:
        text = format_plain_chat(messages)
    return list(tokenizer.encode(text, add_special_tokens=False))


def _tokenize_chat(messages: list[dict[str, str]], tokenizer: Any, stats: TokenizeStats) -> Document:
    """Render growing prefixes of the chat; the ids each message adds are labelled iff it is the assistant's."""
    ids: list[int] = []
    labels: list[int] = []
    for i, msg in enumerate(messages):
        cur = _render(tokenizer, messages[: i + 1])
        if cur[: len(ids)] != ids:  # template rewrites earlier turns: cannot attribute tokens to messages
            stats.num_chat_unmasked += 1
            full = _wrap(tokenizer, _render(tokenizer, messages))
            return Document(full, list(full))
        new = cur[len(ids) :]
        ids = cur
        labels += new if msg["role"] == "assistant" else [IGNORE_INDEX] * len(new)
    wrapped = _wrap(tokenizer, ids)
    if wrapped[:1] != ids[:1]:  # a bos was prepended
        labels = [IGNORE_INDEX, *labels]
    if len(labels) < len(wrapped):  # an eos was appended: learn it only after an assistant turn
        labels.append(wrapped[-1] if messages[-1]["role"] == "assistant" else IGNORE_INDEX)
    return Document(wrapped, labels)


def _split(doc: Document, max_len: int) -> list[Document]:
    n = len(doc.input_ids)
    return [
        Document(doc.input_ids[s : s + max_len], doc.labels[s : s + max_len]) for s in range(0, n, max_len)
    ]
