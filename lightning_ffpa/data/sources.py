"""Where data rows come from: local files or Hugging Face `datasets`, as plain dict rows or text/chat records.

Owns: reading .txt (documents split at blank lines) and .jsonl without extra packages, and .json, .parquet
and .arrow files, folders of data files and hub dataset names through `datasets.load_dataset`; picking the
text or chat `messages` field of each row. Every failure names the option it came from. Does not own
tokenization (`documents.py`) or prompts (`prompts.py`).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
from collections.abc import Iterator
from typing import Any

from lightning_ffpa.errors import ConfigError, one_line

Record = str | list[dict[str, Any]]  # plain text, or a chat: messages {role, content, tool_calls, ...} whole
Row = dict[str, Any]

BUILTIN_EXTENSIONS = (".txt", ".jsonl")
DATASETS_BUILDERS = {".json": "json", ".parquet": "parquet", ".arrow": "arrow"}
DATASETS_HINT = "needs the `datasets` package: pip install 'lightning-ffpa[data]'"


def require_datasets(option: str, value: Any) -> None:
    """Fail early, naming `option`, when `datasets` is needed but not installed."""
    if importlib.util.find_spec("datasets") is None:
        raise ConfigError(option, value, DATASETS_HINT)


def check_file(path: str, option: str) -> None:
    """A readable local data file with a known extension, or one ConfigError naming `option`."""
    if not os.path.isfile(path):
        raise ConfigError(option, path, "does not exist or is not a file")
    ext = os.path.splitext(path)[1].lower()
    if ext not in BUILTIN_EXTENSIONS and ext not in DATASETS_BUILDERS:
        known = ", ".join((*BUILTIN_EXTENSIONS, *DATASETS_BUILDERS))
        raise ConfigError(option, path, f"must end in one of {known}, not {ext!r}")
    if ext in DATASETS_BUILDERS:
        require_datasets(option, path)


def check_dataset_config(dataset: str | None, config: str | None, option: str) -> None:
    """A configuration name applies to a `dataset` only: with a local file it would be ignored."""
    if config is not None and dataset is None:
        raise ConfigError(option, config, "names a configuration of `dataset`; a local file has none")


def check_split(path: str | None, split: str, option: str) -> None:
    """A split other than "train" needs `datasets`: the built-in .txt/.jsonl readers read the whole file."""
    if path is not None and split != "train" and os.path.splitext(path)[1].lower() in BUILTIN_EXTENSIONS:
        raise ConfigError(
            option, split, f"applies to `dataset` and .json/.parquet/.arrow files; {path!r} is read whole"
        )


def read_text_documents(path: str, option: str) -> list[str]:
    """The documents of a .txt file: paragraphs separated by blank lines."""
    with _utf8(path, option) as f:
        return [p.strip() for p in re.split(r"\n\s*\n", f.read()) if p.strip()]


@contextlib.contextmanager
def _utf8(path: str, option: str) -> Iterator[Any]:
    """`path` opened as UTF-8 text; a byte that is not UTF-8 is one error naming the option and the file."""
    try:
        with open(path, encoding="utf-8") as f:
            yield f
    except UnicodeDecodeError as err:
        raise ConfigError(option, path, f"is not UTF-8 text (it holds the byte {err.object[err.start]:#04x}); "
                          "convert it, e.g. with iconv") from err


def _read_jsonl(path: str, option: str) -> list[tuple[int, Row]]:
    """(line number, object) of every non-blank line."""
    rows = []
    with _utf8(path, option) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(option, path, f"line {lineno} is not valid JSON: {e}") from e
            if not isinstance(obj, dict):
                raise ConfigError(option, path, f"line {lineno} is not a JSON object")
            rows.append((lineno, obj))
    return rows


def load_rows(source: str, option: str, config: str | None = None, split: str = "train") -> list[Row]:
    """Rows of a local .jsonl/.json/.parquet/.arrow file, or of `datasets.load_dataset(source, config)[split]`.

    `source` that is not a file is handed to `load_dataset` as is: a hub name or a folder of data files.
    """
    ext = os.path.splitext(source)[1].lower() if os.path.isfile(source) else None
    if ext == ".jsonl":
        return [row for _, row in _read_jsonl(source, option)]
    require_datasets(option, source)
    import datasets

    try:
        if ext is not None:
            data = datasets.load_dataset(DATASETS_BUILDERS[ext], data_files=source, split=split)
        else:
            data = datasets.load_dataset(source, config, split=split)
    except Exception as e:  # one line naming the option; the cause stays chained for --debug
        what = f"split {split!r}" + (f" of config {config!r}" if config else "")
        value = split if option.endswith("_split") else source  # the option named is the split's, or the source's
        raise ConfigError(option, value, f"datasets.load_dataset could not load {what} of {source!r}: "
                          f"{one_line(e)}") from e
    return data.to_list()


def _is_message(m: Any) -> bool:
    """A dict with a string `role` and a string `content`; `content` may be null or absent beside another field
    (an assistant's `tool_calls`), as in Hugging Face's and OpenAI's chats."""
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        return False
    others = any(v is not None for k, v in m.items() if k not in ("role", "content"))
    return isinstance(m.get("content"), str) or (m.get("content") is None and others)


def _chat(value: Any) -> list[dict[str, Any]] | None:
    # each message goes to the chat template whole: `tool_calls`, `name`, `tool_call_id` are what it renders
    ok = isinstance(value, list) and value and all(_is_message(m) for m in value)
    return [dict(m) for m in value] if ok else None


def record_of(row: Row, where: str, option: str, source: str, text_field: str, messages_field: str) -> Record:
    """The text (`text_field`) or chat (`messages_field`) of one row; `where` locates it in errors."""
    if isinstance(row.get(text_field), str):
        return row[text_field]
    if messages_field in row and row[messages_field] is not None:
        chat = _chat(row[messages_field])
        if chat is None:
            raise ConfigError(
                option, source, f"{where}: `{messages_field}` must be a non-empty list of messages {{role: str, "
                "content: str}, `content` null or absent only beside other fields (tool_calls)"
            )
        return chat
    fields = ", ".join(sorted(row)) or "none"
    raise ConfigError(
        option, source, f"{where} needs a string `{text_field}` or a list `{messages_field}` (its fields: {fields})"
    )


def _check_not_both(row: Row, where: str, option: str, source: str, text_field: str, messages_field: str) -> None:
    """A row with a text and a chat is the user's choice to make: the text is learned whole, the chat on its
    assistant turns only. A null (a parquet column the row lacks) is no value."""
    if text_field != messages_field and row.get(text_field) is not None and row.get(messages_field) is not None:
        raise ConfigError(option, source, f"{where} has both `{text_field}` and `{messages_field}`: remove one (a text "
                          "is learned whole, a chat on its assistant turns only), or point `text_field` or "
                          "`messages_field` at another field")


def read_records(source: str, option: str, *args: Any, **kwargs: Any) -> list[Record]:
    """Text or chat records of a local file or a `datasets` source (`read_located_records`' arguments); an empty
    source is an error."""
    return [r for _, r in read_located_records(source, option, *args, **kwargs)]


def read_located_records(
    source: str,
    option: str,
    config: str | None = None,
    split: str = "train",
    text_field: str = "text",
    messages_field: str = "messages",
) -> list[tuple[str, Record]]:
    """`read_records`, each record with where it is (`line 3`, `row 3`, `paragraph 3`), for errors found later."""
    ext = os.path.splitext(source)[1].lower() if os.path.isfile(source) else None
    if ext == ".txt":
        records: list[tuple[str, Record]] = [
            (f"paragraph {n}", d) for n, d in enumerate(read_text_documents(source, option), 1)]
    else:
        located = (
            [(f"line {n}", r) for n, r in _read_jsonl(source, option)]
            if ext == ".jsonl"
            else [(f"row {n}", r) for n, r in enumerate(load_rows(source, option, config, split), 1)]
        )
        for where, row in located:
            _check_not_both(row, where, option, source, text_field, messages_field)
        records = [(w, record_of(r, w, option, source, text_field, messages_field)) for w, r in located]
    if not records:
        raise ConfigError(option, source, "holds no documents (the file or split is empty)")
    return records
