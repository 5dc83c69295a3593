"""Checkpoint plumbing: atomic writes, sharded (DCP) folders, the run-directory lock, version shims for reading.

Owns how checkpoints are written (`atomic`: temporary name + rename, disk-space pre-flight;
`sharded`: per-rank DCP folders, optionally in the background), checkpoints without a LoRA's frozen base and
the digest a resume checks (`frozen`), the save of the step a fit ends at (`final`), the run-directory lock
(`lock`), where checkpoints go by default (`paths`) and how our tools read them (the private torch/Lightning
readers live in `lightning_ffpa._compat`). Does not own when periodic checkpoints are written or how many are kept (Lightning's `ModelCheckpoint`), the data position
(`lightning_ffpa.data.sampler`) or the HF export (`lightning_ffpa.export`).
"""

from lightning_ffpa.checkpoint.atomic import AtomicCheckpointIO
from lightning_ffpa.checkpoint.final import FinalCheckpoint
from lightning_ffpa.checkpoint.lock import RunLock

__all__ = ["AtomicCheckpointIO", "FinalCheckpoint", "RunLock"]
