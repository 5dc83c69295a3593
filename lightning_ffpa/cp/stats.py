"""`RingStats`: what the CP ring ran, counted once per forward, and the exchanges a checkpoint recompute repeats.

Owns what one ring count means. Does not own what is counted: ``ring.py`` (blocks, K/V shifts) and ``sliding.py``
(halo, all-gather, local-call path) call ``ran`` and ``exchanged``.

What one count means, as for the dispatch counters (``lightning_ffpa.attention.counters``): work of a *forward*
pass. The forward that activation checkpointing re-runs during backward is not counted again, so ``selective`` and
``full`` report the same block counts. Its communication is not free, though: the recompute runs the ring's K/V
shifts and the sliding halo again (SAC saves the FFPA kernel forward, not the P2P), so each exchange the recompute
repeats is counted under its own key, ``recompute_<key>``.
"""

from __future__ import annotations

from collections import Counter

from lightning_ffpa._compat.torch import in_backward

__all__ = ["RECOMPUTE", "RingStats"]

RECOMPUTE = "recompute_"  # the prefix of the exchanges a checkpoint recompute repeats


class RingStats(Counter):
    """Counts per key (a plain Counter to read); add to it through `ran` and `exchanged`."""

    def ran(self, key: str, n: int = 1) -> None:
        """Count work of a forward (a block, a local-call path); a checkpoint recompute adds nothing."""
        if not in_backward():
            self[key] += n

    def exchanged(self, key: str, n: int = 1) -> None:
        """Count a communication: as `key` in a forward, as `recompute_<key>` when a checkpoint recompute repeats it."""
        self[RECOMPUTE + key if in_backward() else key] += n
