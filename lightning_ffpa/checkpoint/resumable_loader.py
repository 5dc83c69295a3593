"""A train DataLoader that resumes in the middle of an epoch at the exact batch it stopped at.

Why: Lightning restores the loops (step, epoch, batch index) but restarts a plain DataLoader at the first
batch of the epoch, so a mid-epoch resume would train on batches 0..k-1 of the epoch a second time and never
see the last k (Lightning only warns: "your dataloader is not resumable"). Lightning saves and restores any
train loader that has `state_dict`/`load_state_dict` (`fit_loop.state_dict["combined_loader"]`); this one
records (epoch, batches handed out) and, on restore, makes its sampler start the epoch after those batches,
skipping indices only, so no sample is loaded twice or missed.

Owns: `ResumableSampler` (a `DistributedSampler` that can start part-way) and `ResumableDataLoader`.
Does not own datasets, collation or the shuffle order itself (that is `DistributedSampler`'s (seed, epoch)).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

from torch.utils.data import DataLoader, Dataset, DistributedSampler


class ResumableSampler(DistributedSampler):
    """`DistributedSampler` whose next epoch can begin after `start` of this rank's samples."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._skip: tuple[int, int] | None = None  # (epoch, samples of that epoch to skip), used once
        self.last_start = 0  # samples skipped by the latest `__iter__`

    def skip_in_epoch(self, epoch: int, num_samples: int) -> None:
        """Make the next iteration over `epoch` start at this rank's `num_samples`-th sample."""
        self._skip = (epoch, num_samples)

    def __iter__(self) -> Iterator[int]:
        start = 0
        if self._skip is not None:
            # only the epoch that was interrupted starts late; if Lightning moved on to the next epoch
            # (checkpoint written on the last batch), that epoch starts at 0
            epoch, num_samples = self._skip
            start = num_samples if epoch == self.epoch else 0
            self._skip = None
        self.last_start = start
        return itertools.islice(super().__iter__(), start, None)


class _CountingIterator:
    """Wraps the DataLoader's iterator and counts the batches it has handed to the fit loop."""

    def __init__(self, inner: Iterator, loader: ResumableDataLoader) -> None:
        self.inner, self.loader, self.started = inner, loader, False

    def __iter__(self) -> _CountingIterator:
        return self

    def __next__(self) -> Any:
        batch = next(self.inner)
        if not self.started:
            # the sampler decides the start when it is first drawn from, so read it after the first batch
            self.started = True
            self.loader._batches = self.loader.sampler.last_start // self.loader.batch_size
        self.loader._batches += 1
        return batch

    def __len__(self) -> int:
        return len(self.inner)


class ResumableDataLoader(DataLoader):
    """DataLoader that Lightning treats as stateful: it saves (epoch, batches served) and resumes there."""

    def __init__(self, dataset: Dataset, *, sampler: ResumableSampler, batch_size: int = 1, **kwargs: Any) -> None:
        """Same arguments as `DataLoader`; `sampler` must be a `ResumableSampler` (it does the skipping)."""
        if not isinstance(sampler, ResumableSampler):
            raise TypeError(f"ResumableDataLoader needs a ResumableSampler, got {type(sampler).__name__}")
        if kwargs.get("drop_last"):
            raise ValueError("ResumableDataLoader: drop_last=True is not supported (a partial last batch is kept)")
        super().__init__(dataset, sampler=sampler, batch_size=batch_size, **kwargs)
        self._batches = 0

    def __iter__(self) -> _CountingIterator:
        self._batches = 0
        return _CountingIterator(super().__iter__(), self)

    def state_dict(self) -> dict[str, Any]:
        """Epoch of the sampler, batches served in it, and the sizes that give those batches their meaning."""
        return {
            "epoch": self.sampler.epoch,
            "batches": self._batches,
            "batch_size": self.batch_size,
            "num_replicas": self.sampler.num_replicas,
            "num_samples": self.sampler.num_samples,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume in `state["epoch"]` after `state["batches"]`; refuse if the batch geometry changed."""
        for key, option in (("batch_size", "data.batch_size"), ("num_replicas", "data-parallel size"),
                            ("num_samples", "dataset size per rank")):
            if state[key] != getattr(self if key == "batch_size" else self.sampler, key):
                now = getattr(self if key == "batch_size" else self.sampler, key)
                raise ValueError(
                    f"cannot resume the data position: the checkpoint was written with {option}={state[key]} "
                    f"but this run has {option}={now}; resume with the same value (or from an end-of-epoch "
                    "checkpoint)"
                )
        self.sampler.set_epoch(state["epoch"])
        self.sampler.skip_in_epoch(state["epoch"], state["batches"] * self.batch_size)
        self._batches = state["batches"]
