"""Checkpoint plumbing: version shims for reading plain `.ckpt` files and DCP folders.

Owns how our tools read checkpoints. Does not own when checkpoints are written (Lightning's
`ModelCheckpoint`), the data position (`lightning_ffpa.data.sampler`) or the HF export (`lightning_ffpa.export`).
"""
