"""Shared loader plumbing for the data modules: seeded, epoch-deterministic, distributed-aware sampling.

Owns: building train/val DataLoaders and the datamodule `state_dict` used on resume.
The train sampler (`ResumableSampler`, a `DistributedSampler`) is built from the trainer's own
`distributed_sampler_kwargs` (data-parallel size and rank; 1 and 0 without a parallel strategy), so
Lightning leaves it in place and calls `set_epoch` each epoch: the order is a pure function of
(seed, epoch). The state records seed, epoch, the batches this epoch already trained on and whether that
was all of it, so a run resumed mid-epoch continues with the next unseen batch instead of replaying the epoch
from its start, and one resumed at an epoch's end starts the next epoch whole, at any batch size.
A checkpoint written after the fit loop ended resumes at the batch after its last one (`resume.py`).
Validation loaders are plain sequential ones that Lightning shards itself. Does not own the datasets.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.trainer.states import TrainerFn
from torch.utils.data import DataLoader, Dataset

from lightning_ffpa.data.resume import continue_after_fit_end, loaded_loops_state, start_next_epoch
from lightning_ffpa.data.sampler import ResumableSampler
from lightning_ffpa.errors import NOT_GIVEN, ConfigError


def option(name: str) -> str:
    """A data option as users spell it in YAML and on the command line."""
    return f"data.init_args.{name}"


def require_at_least(minimum: int, **values: int) -> None:
    """Raise one error naming the first `data.init_args.<option>` below `minimum`."""
    for name, value in values.items():
        if value < minimum:
            raise ConfigError(option(name), value, f"must be >= {minimum}")

NOT_RESUMABLE_WARNING = "You're resuming from a checkpoint that ended before the epoch ended"
NO_ROWS_WARNING = "Total length of `list` across ranks is zero"  # Lightning, on a stage's [] loader


class SeededDataModule(pl.LightningDataModule):
    """Base for the data modules; subclasses provide the datasets and the collate function."""

    def __init__(self, batch_size: int, num_workers: int, seed: int) -> None:
        super().__init__()
        require_at_least(1, batch_size=batch_size)
        require_at_least(0, num_workers=num_workers, seed=seed)
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.seed = seed
        self._train_sampler: ResumableSampler | None = None
        self._pending_skip: tuple[int, int] | None = None  # (epoch, samples per rank) from a checkpoint

    def _replicas(self) -> dict[str, int]:
        trainer = self.trainer  # None when used outside a Trainer (tests, scripts)
        kwargs = trainer.distributed_sampler_kwargs if trainer is not None else None
        return (
            {"num_replicas": kwargs["num_replicas"], "rank": kwargs["rank"]}
            if kwargs
            else {"num_replicas": 1, "rank": 0}
        )

    def check_before_fit(self) -> None:
        """Read the data now (`setup` reads once per process), so the row-count checks fail before `fit`
        writes any file; Lightning's own `setup` call then repeats only the checks, with the trainer's ranks."""
        self.setup("fit")

    def no_rows(self) -> list:
        """The loader of a stage without rows: [] (Lightning runs no batch of it), without Lightning's warning that
        asks whether that was meant (it was: the options hold out nothing)."""
        warnings.filterwarnings("ignore", message=NO_ROWS_WARNING)
        return []

    def check_batch_size(self, num_rows: int) -> None:
        """Refuse a batch larger than one data-parallel rank's share of the `num_rows` training rows."""
        replicas = self._replicas()["num_replicas"]
        per_rank = -(-num_rows // replicas)  # DistributedSampler pads each rank up to ceil(n / replicas)
        if self.batch_size > per_rank:
            rows = f"{num_rows} row{'s' if num_rows != 1 else ''}"
            where = f", {per_rank} on each of {replicas} data-parallel ranks" if replicas > 1 else ""
            raise ConfigError(
                option("batch_size"),
                self.batch_size,
                f"larger than the training set ({rows}{where}); lower the batch size or add data",
            )

    def _loader(self, dataset: Dataset, collate: Callable, train: bool) -> DataLoader:
        sampler = None
        if train:
            sampler = ResumableSampler(dataset, seed=self.seed, **self._replicas())
            self._train_sampler = sampler
            self._apply_skip()
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

    def _batches_done(self) -> int:
        """Train batches of the current epoch already processed (Lightning's own per-epoch counter)."""
        if self.trainer is None:
            return 0
        return int(self.trainer.fit_loop.epoch_loop.batch_progress.current.processed)

    def _epoch_done(self) -> bool:
        """Whether the current epoch has trained its last batch, by Lightning's own count: an epoch that
        `limit_train_batches` ends early is done although its sampler has samples left."""
        if self.trainer is None:
            return False
        progress = self.trainer.fit_loop.epoch_loop.batch_progress
        done = progress.current.processed
        return done > 0 and (progress.is_last_batch or done >= self.trainer.num_training_batches)

    def _apply_skip(self) -> None:
        if self._pending_skip is not None and self._train_sampler is not None:
            self._train_sampler.skip_once(*self._pending_skip)
            self._pending_skip = None

    def state_dict(self) -> dict[str, Any]:
        """Seed, epoch and samples done in it per rank: enough to continue on the next unseen batch."""
        epoch = self._train_sampler.epoch if self._train_sampler is not None else 0
        return {
            "seed": self.seed,
            "epoch": epoch,
            "samples_done": self._batches_done() * self.batch_size,  # per rank
            "num_replicas": self._replicas()["num_replicas"],
            "batch_size": self.batch_size,
            "epoch_samples": len(self._train_sampler) if self._train_sampler is not None else None,
            "epoch_done": self._epoch_done(),
        }

    @staticmethod
    def saved_epoch_done(state_dict: dict[str, Any]) -> bool:
        """Whether the checkpoint's epoch had trained its last batch; older checkpoints say it by their samples."""
        if "epoch_done" in state_dict:
            return bool(state_dict["epoch_done"])
        samples_done, epoch_samples = int(state_dict.get("samples_done", 0)), state_dict.get("epoch_samples")
        return bool(samples_done) and epoch_samples is not None and samples_done >= epoch_samples

    def _epoch_batches(self, state_dict: dict[str, Any]) -> int:
        """This run's train batches an epoch on one rank (the loader's length; `limit_train_batches` only lowers it)."""
        rows = self.num_train_rows()
        replicas = self._replicas()["num_replicas"]
        per_rank = -(-rows // replicas) if rows is not None else state_dict.get("epoch_samples") or 1
        return -(-per_rank // self.batch_size)

    def resume_conflict(self, state_dict: dict[str, Any], num_replicas: int) -> tuple[str, Any, str] | None:
        """Why this data cannot continue the checkpoint's epoch on `num_replicas` data-parallel ranks, as
        (option, value, reason), or None. Also run by the pre-flight, before any process starts."""
        if state_dict.get("seed") != self.seed:
            return (option("seed"), self.seed, f"the checkpoint was written with seed {state_dict.get('seed')}; "
                    "resume with the same seed to keep the data order")
        samples_done = int(state_dict.get("samples_done", 0))
        saved_replicas, saved_batch = state_dict.get("num_replicas", 1), state_dict.get("batch_size")
        epoch_samples = state_dict.get("epoch_samples")
        if not samples_done or self.saved_epoch_done(state_dict):
            return None  # an epoch-end checkpoint: the next epoch is dealt afresh
        if saved_replicas != num_replicas:
            ranks = f"{saved_replicas} data-parallel rank{'s' if saved_replicas != 1 else ''}"
            return ("trainer.devices", NOT_GIVEN, f"the checkpoint stopped mid-epoch on {ranks}, this run "
                    f"has {num_replicas} (`trainer.devices` x `trainer.num_nodes` / the strategy's "
                    "`context_parallel_size`): the rest of that epoch cannot be "
                    "re-sharded; resume on the same data-parallel size or from an epoch-end checkpoint")
        rows = self.num_train_rows()
        if epoch_samples is not None and rows is not None:
            per_rank = -(-rows // num_replicas)  # a DistributedSampler's share (padded up, as saved)
            if per_rank != epoch_samples:
                return ("data", NOT_GIVEN, f"the training set has {rows} rows now ({per_rank} per data-parallel "
                        f"rank) but the checkpoint's epoch had {epoch_samples} per rank: the data changed since "
                        "(file, max_seq_length, packing or the val split), so the rest of that epoch cannot be "
                        "found; resume with the same data, or from an epoch-end checkpoint")
        if saved_batch is not None and saved_batch != self.batch_size:
            # Lightning resumes the epoch by its count of batches, in the new size: samples would be lost or repeated
            return (option("batch_size"), self.batch_size, f"the checkpoint stopped mid-epoch with batch_size "
                    f"{saved_batch}; resume with that batch size, or from an epoch-end checkpoint")
        return None

    def num_train_rows(self) -> int | None:
        """Training rows once the data is read (`setup`), else None; subclasses say where they keep them."""
        return None

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Refuse what `resume_conflict` names; skip the batches the checkpoint trained on. Only `fit` resumes the
        training data: `validate`, `test` and `predict` from a mid-epoch checkpoint read it at any batch size."""
        fn = getattr(getattr(self.trainer, "state", None), "fn", None)
        if fn is not None and fn != TrainerFn.FITTING:
            return
        conflict = self.resume_conflict(state_dict, self._replicas()["num_replicas"])
        if conflict is not None:
            raise ConfigError(*conflict)
        samples_done, epoch = int(state_dict.get("samples_done", 0)), int(state_dict.get("epoch", 0))
        epoch_done = self.saved_epoch_done(state_dict)
        loops = loaded_loops_state(self.trainer) if self.trainer is not None else None
        if loops is not None:  # Lightning restores its loops from this dict right after
            if epoch_done:
                start_next_epoch(loops, self._epoch_batches(state_dict))
            else:
                continue_after_fit_end(loops)
        # a done epoch: the next one whole (its batch count may differ from the checkpoint's)
        self._pending_skip = (epoch + 1, 0) if epoch_done else (epoch, samples_done)
        self._apply_skip()
        if samples_done:
            # Lightning looks for a stateful DataLoader only; the skip above is what resumes this epoch
            warnings.filterwarnings("ignore", message=NOT_RESUMABLE_WARNING)
