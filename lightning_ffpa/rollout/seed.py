"""Seeding each rollout from where it is in the run, so a resumed run samples what the uninterrupted one did.

Why: Lightning checkpoints hold no random state, and a resumed run starts its random streams again from
`seed_everything`. Sampling from those streams, the first rollout after a resume repeated the noise of the
run's first rollout instead of continuing. Here each rollout draws from a seed that is a pure function of
(the run's seed, epoch, batch, step, rank), and the run's own random state is put back after it, so rollouts
neither depend on nor move the training's random stream.

Owns: that seed and the context that applies it. Does not own sampling (`sampler.py`).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch


def run_seed() -> int:
    """The seed `seed_everything` gave this run (Lightning keeps it in `PL_GLOBAL_SEED`), else 0."""
    value = os.environ.get("PL_GLOBAL_SEED", "")
    return int(value) if value.lstrip("-").isdigit() else 0


def rollout_seed(base: int, epoch: int, batch_idx: int, step: int, rank: int) -> int:
    """A 63-bit seed for the rollout of one batch on one rank."""
    key = f"{base}/{epoch}/{batch_idx}/{step}/{rank}".encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:8], "little") >> 1


@contextmanager
def seeded(device: torch.device, seed: int) -> Iterator[None]:
    """Seed the default generators of the CPU and of `device` for the block, then put their states back.

    The engine samples from the device's default generator: a captured CUDA graph can replay no other."""
    cuda = device.type == "cuda"
    index = (device.index if device.index is not None else torch.cuda.current_device()) if cuda else None
    with torch.random.fork_rng(devices=[index] if cuda else []):
        torch.default_generator.manual_seed(seed)
        if cuda:
            torch.cuda.default_generators[index].manual_seed(seed)
        yield
