"""Local text data: a .txt or .jsonl file tokenized into padded or packed training rows.

Owns: `TextDataModule` (option validation, train/val split, choosing padding vs packing) and
`TokenDataset`. Parsing and tokenizing live in `documents.py`, packing in `packing.py`, batching in
`collate.py`. Checking `max_seq_length` against the model is the LightningModule's job; it reads
`datamodule.max_seq_length` and `datamodule.vocab_size`.
"""

from __future__ import annotations

import os
import random
from dataclasses import asdict

import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.utils.data import Dataset

from lightning_ffpa.data.base import SeededDataModule, require_at_least
from lightning_ffpa.data.collate import PackedCollate, PadCollate
from lightning_ffpa.data.documents import Document, read_records, tokenize_records
from lightning_ffpa.data.packing import pack_documents
from lightning_ffpa.data.tokenizer import load_tokenizer, pad_id_of

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
    """Train on a local .txt (documents split at blank lines) or .jsonl (`text` or chat `messages`) file."""

    def __init__(
        self,
        train_file: str = SHAKESPEARE_PATH,
        val_file: str | None = None,
        val_fraction: float = 0.05,
        tokenizer: str = "byte",
        max_seq_length: int = 256,
        batch_size: int = 8,
        pack: bool = False,
        num_workers: int = 0,
        seed: int = 0,
    ) -> None:
        """
        Args:
            train_file: Training data, a .txt or .jsonl file (default: the shipped Shakespeare sample).
            val_file: Validation data file; if unset, `val_fraction` of the training documents is held out.
            val_fraction: Share of training documents held out for validation when `val_file` is unset (0: none).
            tokenizer: "byte" for the byte-level tokenizer, or a local directory for `AutoTokenizer`.
            max_seq_length: Longest row in tokens; longer documents are cut into windows of this length.
            batch_size: Rows per batch on each data-parallel rank.
            pack: Pack documents greedily into rows of `max_seq_length` with position and document ids.
            num_workers: DataLoader worker processes.
            seed: Seed of the train/val split and of the shuffle order (with the epoch).
        """
        super().__init__(batch_size=batch_size, num_workers=num_workers, seed=seed)
        # cheap checks first, before any reading or tokenizing
        if not os.path.isfile(train_file):
            raise FileNotFoundError(f"`data.train_file={train_file!r}` does not exist or is not a file")
        if val_file is not None and not os.path.isfile(val_file):
            raise FileNotFoundError(f"`data.val_file={val_file!r}` does not exist or is not a file")
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"`data.val_fraction={val_fraction}` must be in [0, 1)")
        require_at_least(2, max_seq_length=max_seq_length)
        self.train_file, self.val_file, self.val_fraction = train_file, val_file, val_fraction
        self.max_seq_length = max_seq_length
        self.pack = pack
        self.tokenizer = load_tokenizer(tokenizer)
        self.vocab_size = len(self.tokenizer)
        self.pad_id = pad_id_of(self.tokenizer)
        self.stats: dict[str, dict[str, int]] = {}
        self._train: TokenDataset | None = None
        self._val: TokenDataset | None = None

    def setup(self, stage: str | None = None) -> None:
        """Read, tokenize, split and (optionally) pack; runs once per process."""
        if self._train is not None:
            return
        train_docs = self._documents(self.train_file, "data.train_file")
        if self.val_file is not None:
            val_docs = self._documents(self.val_file, "data.val_file")
        else:
            train_docs, val_docs = self._split(train_docs)
        self._train, self._val = self._dataset(train_docs), self._dataset(val_docs)
        rank_zero_info(
            f"TextDataModule: {len(self._train)} train / {len(self._val)} val rows "
            f"(pack={self.pack}, max_seq_length={self.max_seq_length}); {self.stats}"
        )

    def _documents(self, path: str, option: str) -> list[Document]:
        records = read_records(path, option)
        docs, stats = tokenize_records(records, self.tokenizer, self.max_seq_length)
        self.stats[option] = asdict(stats)
        if stats.num_chat_unmasked:
            rank_zero_warn(
                f"`{option}`: {stats.num_chat_unmasked} chats render differently turn by turn "
                "under this chat template; all their tokens are labelled (user turns included)"
            )
        if not docs:
            raise ValueError(
                f"`{option}={path!r}` has no document with a token to learn from "
                f"({stats.num_dropped_unlabelled} dropped: too short or no assistant turn)"
            )
        return docs

    def _split(self, docs: list[Document]) -> tuple[list[Document], list[Document]]:
        if self.val_fraction == 0.0:
            return docs, []
        num_val = max(1, round(len(docs) * self.val_fraction))
        if num_val >= len(docs):
            raise ValueError(
                f"`data.val_fraction={self.val_fraction}` leaves no training document out of "
                f"{len(docs)} in `data.train_file={self.train_file!r}`"
            )
        order = list(range(len(docs)))
        random.Random(self.seed).shuffle(order)  # same split on every rank and every run with this seed
        val_idx = set(order[:num_val])
        return (
            [d for i, d in enumerate(docs) if i not in val_idx],
            [d for i, d in enumerate(docs) if i in val_idx],
        )

    def _dataset(self, docs: list[Document]) -> TokenDataset:
        if self.pack:
            return TokenDataset(pack_documents(docs, self.max_seq_length, self.pad_id))
        return TokenDataset.from_documents(docs)

    def _collate(self):
        return PackedCollate() if self.pack else PadCollate(self.pad_id)

    def train_dataloader(self):
        """Shuffled (seed, epoch) loader over the training rows."""
        self.setup()
        return self._loader(self._train, self._collate(), train=True)

    def val_dataloader(self):
        """Sequential loader over the validation rows, or [] when there are none."""
        self.setup()
        if not len(self._val):
            return []
        return self._loader(self._val, self._collate(), train=False)
