"""Checkpoint plumbing: exact mid-epoch data position, checkpoint reading, version shims for DCP.

Owns what a checkpoint holds beyond Lightning's own loops (the data position) and how our tools read
checkpoints (plain `.ckpt` files and DCP folders). Does not own when checkpoints are written
(Lightning's `ModelCheckpoint`) or the HF export (`lightning_ffpa.export`).
"""

from lightning_ffpa.checkpoint.resumable_loader import ResumableDataLoader, ResumableSampler

__all__ = ["ResumableDataLoader", "ResumableSampler"]
