"""Shared loader plumbing for the data modules: seeded, epoch-deterministic, distributed-aware sampling.

Owns: building train/val DataLoaders and the datamodule `state_dict` (seed + epoch) used on resume.
The train sampler is a `DistributedSampler` built from the trainer's own `distributed_sampler_kwargs`
(data-parallel size and rank; 1 and 0 without a parallel strategy), so Lightning leaves it in place and
calls `set_epoch` each epoch: the order is a pure function of (seed, epoch), which a resumed run repeats.
Validation loaders are plain sequential ones that Lightning shards itself. Does not own the datasets.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler


class SeededDataModule(pl.LightningDataModule):
    """Base for the data modules; subclasses provide the datasets and the collate function."""

    def __init__(self, batch_size: int, num_workers: int, seed: int) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"`data.batch_size={batch_size}` must be >= 1")
        if num_workers < 0:
            raise ValueError(f"`data.num_workers={num_workers}` must be >= 0")
        if seed < 0:
            raise ValueError(f"`data.seed={seed}` must be >= 0")
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.seed = seed
        self._train_sampler: DistributedSampler | None = None

    def _replicas(self) -> dict[str, int]:
        trainer = self.trainer  # None when used outside a Trainer (tests, scripts)
        kwargs = trainer.distributed_sampler_kwargs if trainer is not None else None
        return (
            {"num_replicas": kwargs["num_replicas"], "rank": kwargs["rank"]}
            if kwargs
            else {"num_replicas": 1, "rank": 0}
        )

    def _loader(self, dataset: Dataset, collate: Callable, train: bool) -> DataLoader:
        sampler = None
        if train:
            sampler = DistributedSampler(
                dataset, shuffle=True, seed=self.seed, drop_last=False, **self._replicas()
            )
            self._train_sampler = sampler
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            sampler=sampler,
            shuffle=False,
            collate_fn=collate,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
            pin_memory=torch.cuda.is_available(),
        )

    def state_dict(self) -> dict[str, Any]:
        """Seed and current epoch: with them the train order of a resumed run is the original one."""
        epoch = self._train_sampler.epoch if self._train_sampler is not None else 0
        return {"seed": self.seed, "epoch": epoch}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Refuse a different seed (the order would silently change); the fit loop restores the epoch."""
        if state_dict.get("seed") != self.seed:
            raise ValueError(
                f"checkpoint was written with `data.seed={state_dict.get('seed')}` but this run has "
                f"`data.seed={self.seed}`; resume with the same seed to keep the data order"
            )
        if self._train_sampler is not None:
            self._train_sampler.set_epoch(int(state_dict.get("epoch", 0)))
