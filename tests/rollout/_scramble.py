"""Scrambled page pools for the rollout engine tests: every `generate` starts from shuffled free lists, so pages
are far from consecutive in both pools (the full layers' and the sliding layers'). Builds no engine or model."""

from __future__ import annotations

import torch


def scrambled(eng, seed: int = 0):
    """`eng`, whose page pools are shuffled (by a generator seeded `seed`) at every restart."""
    g = torch.Generator().manual_seed(seed)
    restart = eng.pages.restart

    def scrambled_restart():
        restart()
        eng.pages.scramble(g)

    eng.pages.restart = scrambled_restart
    return eng
