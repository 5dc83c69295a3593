"""Mock data for benchmarks: random token rows of one fixed length, like NeMo's mock dataset.

Owns: `MockDataset` (row i is a pure function of (seed, i)) and `MockDataModule`. Does not own real text.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset

from lightning_ffpa.data.base import SeededDataModule, require_at_least
from lightning_ffpa.data.collate import PadCollate


class MockDataset(Dataset):
    """`num_samples` rows of `seq_length` uniform tokens in [0, vocab_size); labels equal the inputs."""

    def __init__(self, num_samples: int, seq_length: int, vocab_size: int, seed: int) -> None:
        self.num_samples, self.seq_length, self.vocab_size, self.seed = (
            num_samples,
            seq_length,
            vocab_size,
            seed,
        )

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < self.num_samples:
            raise IndexError(index)
        # per-index stream, so shuffle order and worker count never change a row; numpy's SeedSequence
        # mixes (seed, index) fully, while torch's CPU generator keeps only 32 bits of its seed
        rng = np.random.default_rng([self.seed, index])
        ids = torch.from_numpy(rng.integers(0, self.vocab_size, self.seq_length, dtype=np.int64))
        return {"input_ids": ids, "labels": ids.clone()}


class MockDataModule(SeededDataModule):
    """Random fixed-length token batches (`input_ids`, `labels`, all-ones `attention_mask`)."""

    def __init__(
        self,
        vocab_size: int = 512,
        seq_length: int = 128,
        num_samples: int = 1024,
        num_val_samples: int = 0,
        batch_size: int = 8,
        seed: int = 0,
        num_workers: int = 0,
    ) -> None:
        """
        Args:
            vocab_size: Tokens are drawn from [0, vocab_size); at most the model's vocabulary size.
            seq_length: Tokens per row (every row has this length).
            num_samples: Number of training rows.
            num_val_samples: Number of validation rows (0: no validation).
            batch_size: Rows per batch on each data-parallel rank.
            seed: Seed of the token values and of the shuffle order (with the epoch).
            num_workers: DataLoader worker processes.
        """
        super().__init__(batch_size=batch_size, num_workers=num_workers, seed=seed)
        require_at_least(1, vocab_size=vocab_size, seq_length=seq_length, num_samples=num_samples)
        require_at_least(0, num_val_samples=num_val_samples)
        self.vocab_size = vocab_size
        self.seq_length = seq_length
        self.max_seq_length = seq_length  # the name the module checks against max_position_embeddings
        self.num_samples = num_samples
        self.num_val_samples = num_val_samples

    def setup(self, stage: str | None = None) -> None:
        """Check the batch size against the training rows (before the model is built)."""
        self.check_batch_size(self.num_samples)

    def num_train_rows(self) -> int:
        """`num_samples`: the rows exist without reading anything."""
        return self.num_samples

    def train_dataloader(self):
        """Shuffled (seed, epoch) loader over the training rows."""
        ds = MockDataset(self.num_samples, self.seq_length, self.vocab_size, self.seed)
        return self._loader(ds, PadCollate(pad_id=0), train=True)

    def val_dataloader(self):
        """Sequential loader over separate validation rows, or [] when `num_val_samples=0`."""
        if self.num_val_samples == 0:
            return self.no_rows()
        ds = MockDataset(self.num_val_samples, self.seq_length, self.vocab_size, self.seed + 1)
        return self._loader(ds, PadCollate(pad_id=0), train=False)
