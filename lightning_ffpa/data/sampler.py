"""The train sampler: a `DistributedSampler` that can skip the part of an epoch a checkpoint already saw.

Owns: per-rank, (seed, epoch)-determined index order and a one-shot skip for mid-epoch resume. Being a
`DistributedSampler`, Lightning neither replaces nor wraps it and calls `set_epoch` at every epoch start.
Does not own knowing how far training got (the datamodule reads that from the trainer).
"""

from __future__ import annotations

from collections.abc import Iterator

from torch.utils.data import Dataset, DistributedSampler


class ResumableSampler(DistributedSampler):
    """`DistributedSampler(shuffle=True)` whose next pass over `epoch` can start `num_samples` in."""

    def __init__(self, dataset: Dataset, num_replicas: int, rank: int, seed: int) -> None:
        super().__init__(
            dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed, drop_last=False
        )
        self._skip: tuple[int, int] | None = None  # (epoch, samples of this rank already trained on)

    def skip_once(self, epoch: int, num_samples: int) -> None:
        """Make the next pass over `epoch` drop its first `num_samples` indices (a resumed mid-epoch run).

        Also moves the sampler to that epoch (to the next one when `epoch` was done): Lightning starts the
        loader's iterator before its own `set_epoch`, and with worker processes that iterator draws its indices
        right away."""
        if num_samples >= len(self):  # the epoch was done: the next pass is the next epoch, whole
            self.set_epoch(epoch + 1)
            self._skip = None
            return
        self.set_epoch(epoch)
        self._skip = (epoch, num_samples)

    def __iter__(self) -> Iterator[int]:
        indices = list(super().__iter__())
        if self._skip is not None and self._skip[0] == self.epoch:
            indices = indices[self._skip[1] :]
        self._skip = None  # one-shot: a checkpoint from another epoch never trims this one
        return iter(indices)
