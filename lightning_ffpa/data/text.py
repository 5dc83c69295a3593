"""Text data: local files or Hugging Face datasets, tokenized into padded or packed training rows.

Owns: `TextDataModule` (option validation, train/val split, choosing padding vs packing, saying how chats
were labelled) and `TokenDataset`. Reading lives in `sources.py`, tokenizing in `documents.py`, packing in
`packing.py`, batching in `collate.py`. Checking `max_seq_length` against the model is the
LightningModule's job; it reads `datamodule.max_seq_length` and `datamodule.vocab_size`.
"""

from __future__ import annotations

import os
import random
from dataclasses import asdict

import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.utils.data import Dataset

from lightning_ffpa.data.base import SeededDataModule, option, require_at_least
from lightning_ffpa.data.collate import PackedCollate, PadCollate
from lightning_ffpa.data.documents import Document, TokenizeStats, tokenize_records
from lightning_ffpa.data.packing import pack_documents
from lightning_ffpa.data.sources import (
    check_dataset_config,
    check_file,
    check_split,
    read_located_records,
    require_datasets,
)
from lightning_ffpa.data.tokenizer import ChatTemplateError, load_tokenizer, pad_id_of, tokenizer_digest
from lightning_ffpa.errors import ConfigError

VAL_FRACTION = 0.05  # the default hold-out; another value beside a validation source would be ignored
PAD_TO_MULTIPLE_OF = 256  # unpacked batches only: packed rows are max_seq_length long
SHAKESPEARE_PATH = os.path.join(os.path.dirname(os.path.dirname(__file__)), "assets", "shakespeare.txt")


class TokenDataset(Dataset):
    """Rows as dicts of 1D LongTensors (unpacked: input_ids/labels; packed: plus position/document ids)."""

    def __init__(self, rows: list[dict[str, torch.Tensor]]) -> None:
        self.rows = rows

    @classmethod
    def from_documents(cls, docs: list[Document]) -> TokenDataset:
        """One row per document."""
        return cls(
            [
                {
                    "input_ids": torch.tensor(d.input_ids, dtype=torch.long),
                    "labels": torch.tensor(d.labels, dtype=torch.long),
                }
                for d in docs
            ]
        )

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return self.rows[index]


class TextDataModule(SeededDataModule):
    """Train on text or chats from a local .txt/.jsonl/.json/.parquet/.arrow file or a Hugging Face dataset
    (`datasets.load_dataset`: a hub name or a folder of data files, with a config and splits). A hub id also
    works for `tokenizer`. Chats (`messages_field`) are rendered by the tokenizer's chat template and learn
    the assistant's tokens alone (not the role header the generation prompt adds) when the template marks
    them with `{% generation %}` or renders every turn the same in each prefix of the chat (the stock Gemma4
    template does), else every token; setup logs which. A tokenizer without a chat template is refused for
    chats (the byte tokenizer writes `role: content` lines). Composes with `pack`. A
    `batch_size` larger than the training rows (after packing) is an error at setup.
    """

    def __init__(
        self,
        train_file: str | None = None,
        val_file: str | None = None,
        dataset: str | None = None,
        dataset_config: str | None = None,
        train_split: str = "train",
        val_split: str | None = None,
        text_field: str = "text",
        messages_field: str = "messages",
        val_fraction: float = VAL_FRACTION,
        tokenizer: str = "byte",
        max_seq_length: int = 256,
        batch_size: int = 8,
        pack: bool = False,
        pad_to_multiple_of: int = PAD_TO_MULTIPLE_OF,
        num_workers: int = 0,
        seed: int = 0,
    ) -> None:
        """
        Args:
            train_file: Local training file: .txt (documents split at blank lines), .jsonl, or .json/.parquet/.arrow
                (through `datasets`); unset with no `dataset`: the shipped Shakespeare sample.
            val_file: Local validation file; if unset (and no `val_split`), `val_fraction` of the training documents.
            dataset: A Hugging Face hub dataset name, or a local folder of data files, for `datasets.load_dataset`.
            dataset_config: The `dataset`'s configuration name, if it has several (not with a local file).
            train_split: The split of `dataset` (or of a `datasets`-read file) to train on; slices like `train[:1000]` work.
            val_split: The split of `dataset` to validate on; unset holds out `val_fraction` of the training documents.
            text_field: Field of a row holding plain text.
            messages_field: Field of a row holding a chat (a list of {role, content} messages), rendered by the tokenizer's
                chat template; each message reaches it whole (`tool_calls`, `name`, ...).
            val_fraction: Share of training documents held out whole for validation when there is no val file or split (0: none; refused beside either).
            tokenizer: "byte" for the byte-level tokenizer, or a local folder or hub id for `AutoTokenizer`.
            max_seq_length: Longest row in tokens; longer documents are cut into windows of this length.
            batch_size: Rows per batch on each data-parallel rank.
            pack: Pack documents greedily into rows of `max_seq_length` with position and document ids, in
                document order; a document longer than a row is cut into full windows, and its last one shares a row
                only with what follows (the start-up line says how full the rows are).
            pad_to_multiple_of: Unpacked batches are padded to their longest row rounded up to this multiple (at most
                `max_seq_length`), so a run sees few distinct lengths: each new one compiles the layers and the
                attention kernels once, and the compiled Flex path refuses more than 64.
            num_workers: DataLoader worker processes.
            seed: Seed of the train/val split and of the shuffle order (with the epoch).
        """
        super().__init__(batch_size=batch_size, num_workers=num_workers, seed=seed)
        # cheap checks first, before any reading or tokenizing
        if dataset is not None and train_file is not None:
            raise ConfigError(option("dataset"), dataset, "give either `dataset` or `train_file`, not both")
        if dataset is None and train_file is None:
            train_file = SHAKESPEARE_PATH
        if train_file is not None:
            check_file(train_file, option("train_file"))
            check_split(train_file, train_split, option("train_split"))
        if val_file is not None:
            check_file(val_file, option("val_file"))
        if dataset is not None:
            require_datasets(option("dataset"), dataset)
        if val_split is not None and dataset is None:
            raise ConfigError(option("val_split"), val_split, "needs `dataset` (a local file has one split)")
        if val_split is not None and val_file is not None:
            raise ConfigError(option("val_split"), val_split, "give either `val_split` or `val_file`, not both")
        check_dataset_config(dataset, dataset_config, option("dataset_config"))
        _check_read_options(train_file, val_file, dataset, text_field, messages_field, pack, pad_to_multiple_of)
        if not 0.0 <= val_fraction < 1.0:
            raise ConfigError(option("val_fraction"), val_fraction, "must be in [0, 1)")
        if val_fraction != VAL_FRACTION and (val_file is not None or val_split is not None):
            given = "val_file" if val_file is not None else "val_split"
            raise ConfigError(option("val_fraction"), val_fraction, f"holds out training documents only without a "
                              f"validation source; `{given}` gives the validation rows here; leave `val_fraction` unset")
        require_at_least(2, max_seq_length=max_seq_length)
        require_at_least(1, pad_to_multiple_of=pad_to_multiple_of)
        self.train_file, self.val_file, self.val_fraction = train_file, val_file, val_fraction
        self.dataset, self.dataset_config = dataset, dataset_config
        self.train_split, self.val_split = train_split, val_split
        self.text_field, self.messages_field = text_field, messages_field
        self.max_seq_length = max_seq_length
        self.pack = pack
        self.pad_to_multiple_of = pad_to_multiple_of
        self.tokenizer_spec = tokenizer  # what the checkpoint records for the export's tokenizer files
        self.tokenizer = load_tokenizer(tokenizer)
        self.tokenizer_digest = tokenizer_digest(self.tokenizer)  # recorded too: evaluate/resume with the same one
        self.vocab_size = len(self.tokenizer)
        self.pad_id = pad_id_of(self.tokenizer)
        self.stats: dict[str, dict[str, int]] = {}
        self._train: TokenDataset | None = None
        self._val: TokenDataset | None = None

    def setup(self, stage: str | None = None) -> None:
        """Read, tokenize, split and (optionally) pack; runs once per process. Checks the batch size."""
        if self._train is None:
            if self.dataset is not None:
                train_docs = self._documents(self.dataset, "dataset", self.train_split)
            else:
                train_docs = self._documents(self.train_file, "train_file", self.train_split)
            if self.val_file is not None:
                val_docs = self._documents(self.val_file, "val_file", "train")
            elif self.val_split is not None:
                val_docs = self._documents(self.dataset, "val_split", self.val_split)
            else:
                train_docs, val_docs = self._split(train_docs)
            self._train, self._val = self._dataset(train_docs), self._dataset(val_docs)
            rank_zero_info(
                f"TextDataModule: {len(self._train)} train / {len(self._val)} val rows "
                f"(pack={self.pack}, max_seq_length={self.max_seq_length}{self._fill(train_docs)}); {self.stats}"
            )
        if stage in (None, "fit"):  # validate/test/predict never batch the training rows
            self.check_batch_size(len(self._train))

    def _documents(self, source: str, name: str, split: str) -> list[Document]:
        opt = option(name)
        located = read_located_records(
            source, opt, self.dataset_config, split, text_field=self.text_field, messages_field=self.messages_field
        )
        try:
            docs, stats = tokenize_records([r for _, r in located], self.tokenizer, self.max_seq_length)
        except ChatTemplateError as err:  # the record's place in its source, as other bad rows are named
            raise ConfigError(opt, source, f"{located[err.record][0]}: {err}") from err
        self.stats[opt] = asdict(stats)
        self._report_chat_labels(opt, stats)
        if not docs:
            raise ConfigError(
                opt, source, f"has no document with a token to learn from ({stats.num_dropped_empty} empty, "
                f"{stats.num_dropped_unlabelled} too short or without an assistant turn)"
            )
        if stats.num_dropped_empty:
            rank_zero_info(f"`{opt}`: {stats.num_dropped_empty} of {stats.num_records} records "
                           f"{_verb(stats.num_dropped_empty, 'is an empty text', 'are empty texts')}, not trained on")
        return docs

    def _report_chat_labels(self, opt: str, stats: TokenizeStats) -> None:
        """Say once per source which tokens of its chats are learned."""
        if stats.num_chat_generation_masked:
            rank_zero_info(
                f"`{opt}`: {_count(stats.num_chat_generation_masked, 'chat learns', 'chats learn')} the assistant "
                "tokens only, as marked by the chat template's {% generation %} blocks"
            )
        if stats.num_chat_prefix_masked:
            how = ("the template has no {% generation %} marks; its turns render the same in every prefix"
                   if getattr(self.tokenizer, "chat_template", None) else
                   "as the byte tokenizer's plain `role: content` lines: it has no chat template")
            rank_zero_info(
                f"`{opt}`: {_count(stats.num_chat_prefix_masked, 'chat learns', 'chats learn')} the assistant tokens "
                f"only, found by rendering the chat prefix by prefix ({how})"
            )
        if stats.num_chat_header_learned:
            rank_zero_info(
                f"`{opt}`: in {stats.num_chat_header_learned} of them an assistant turn is learned from the end of "
                "the turn before it, its role header (if it has one) too: the turn opens the chat, or the "
                "template's generation prompt does not render as its start"
            )
        if stats.num_chat_split:
            rank_zero_warn(
                f"`{opt}`: {_count(stats.num_chat_split, 'chat is', 'chats are')} longer than "
                f"`{option('max_seq_length')}={self.max_seq_length}` and {_verb(stats.num_chat_split, 'was', 'were')} "
                "cut into windows; each window after the first is learned without the turns before it (windows "
                "with no assistant token are dropped); raise max_seq_length to keep chats whole"
            )
        if stats.num_chat_unmasked:
            rank_zero_warn(
                f"`{opt}`: {_count(stats.num_chat_unmasked, 'chat renders', 'chats render')} differently turn by "
                "turn under this chat template, which has no {% generation %} marks; all "
                f"{_verb(stats.num_chat_unmasked, 'its', 'their')} tokens are learned (user turns too)"
            )

    def num_train_rows(self) -> int | None:
        """Training rows (packed rows with `pack`) once `setup` has read the data."""
        return None if self._train is None else len(self._train)

    def _split(self, docs: list[Document]) -> tuple[list[Document], list[Document]]:
        """Hold out `val_fraction` of the records whole: a record cut into windows lands on one side only."""
        if self.val_fraction == 0.0:
            return docs, []
        records = sorted({d.record for d in docs})
        num_val = max(1, round(len(records) * self.val_fraction))
        if num_val >= len(records):
            raise ConfigError(
                option("val_fraction"), self.val_fraction, f"leaves no training document out of {len(records)}"
            )
        random.Random(self.seed).shuffle(records)  # same split on every rank and every run with this seed
        val_records = set(records[:num_val])
        return (
            [d for d in docs if d.record not in val_records],
            [d for d in docs if d.record in val_records],
        )

    def _fill(self, docs: list[Document]) -> str:
        """What packing achieved: tokens over the rows' room (a long document's last window packs only with what
        follows it, so data of mostly long documents packs little)."""
        if not self.pack or not len(self._train):
            return ""
        fill = sum(len(d.input_ids) for d in docs) / (len(self._train) * self.max_seq_length)
        return f", {len(docs)} pieces packed {fill:.0%} full"

    def _dataset(self, docs: list[Document]) -> TokenDataset:
        if self.pack:
            return TokenDataset(pack_documents(docs, self.max_seq_length, self.pad_id))
        return TokenDataset.from_documents(docs)

    def _collate(self):
        return PackedCollate() if self.pack else PadCollate(self.pad_id, self.pad_to_multiple_of, self.max_seq_length)

    def train_dataloader(self):
        """Shuffled (seed, epoch) loader over the training rows."""
        self.setup("fit")
        return self._loader(self._train, self._collate(), train=True)

    def val_dataloader(self):
        """Sequential loader over the validation rows, or [] when there are none."""
        self.setup("validate")
        if not len(self._val):
            return self.no_rows()
        return self._loader(self._val, self._collate(), train=False)


def _verb(num: int, one: str, many: str) -> str:
    """The word that agrees with `num`: `one` for 1, else `many`."""
    return one if num == 1 else many


def _count(num: int, one: str, many: str) -> str:
    """`num` and its noun (and verb) in agreement: "1 chat is", "2 chats are"."""
    return f"{num} {_verb(num, one, many)}"


def _check_read_options(train_file: str | None, val_file: str | None, dataset: str | None, text_field: str,
                        messages_field: str, pack: bool, pad_to_multiple_of: int) -> None:
    """Refuse an option the rest of the data options leave unread (it would be ignored without a word)."""
    plain = [f for f in (train_file, val_file) if f is not None]
    if dataset is None and plain and all(str(f).endswith(".txt") for f in plain):
        for name, value, default in (("text_field", text_field, "text"), ("messages_field", messages_field,
                                                                            "messages")):
            if value != default:
                raise ConfigError(option(name), value, "names a field of records (.jsonl, .json, ...); a .txt file's "
                                                       "documents are its paragraphs, so leave it unset")
    if pack and pad_to_multiple_of != PAD_TO_MULTIPLE_OF:
        raise ConfigError(option("pad_to_multiple_of"), pad_to_multiple_of, "pads unpacked batches; packed rows are "
                                                                            "`max_seq_length` long already, so leave "
                                                                            "it unset (or set pack false)")
