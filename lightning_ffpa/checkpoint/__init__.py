"""Checkpoint plumbing: how our tools read plain `.ckpt` files and DCP folders.

Owns how our tools read checkpoints (the private torch/Lightning readers they call live in
`lightning_ffpa._compat`). Does not own when checkpoints are written (Lightning's `ModelCheckpoint`), the
data position (`lightning_ffpa.data.sampler`) or the HF export (`lightning_ffpa.export`).
"""
