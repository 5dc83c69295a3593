"""Page pools: the full layers' page table and, for sliding-window layers, a second one under the same slots.

Owns what the scheduler asks of pages across both tables: admission (`can_admit`/`admit`), a decode step's
growth (`can_reserve_all`/`reserve_all`), recompute preemption (`can_reserve`/`reserve`, `erase`), and the pool
counts the engine reports. It does not choose what runs (`scheduler.py`), build masks (`masks.py`) nor hold
KV tensors (`kv_cache.py`).

Sliding layers read only their window, so their table releases the pages behind it (`PageTable(window=...)`)
and hands them to other sequences: a sequence's KV in those layers is O(window) pages, while the full layers'
table grows with its length as before. A sequence runs only when both pools have room for it, and a
preempted one gives back pages in both. Releases are host-side and reach the device tables at the next
`flush`, which is stream-ordered after any step already queued, so a step in flight still reads the pages
it was issued with.
"""

from __future__ import annotations

import torch

from lightning_ffpa.rollout.page_table import PageTable


class PagePools:
    """The full table and an optional sliding table, allocated and freed together by slot."""

    def __init__(self, full: PageTable, sliding: PageTable | None = None) -> None:
        """`full`: every layer's table, or the full layers' one beside `sliding` (the sliding layers', with a
        window). The two must have the same slots and logical blocks."""
        if sliding is not None and (sliding.num_slots, sliding.max_blocks_per_slot, sliding.page_size) != (
                full.num_slots, full.max_blocks_per_slot, full.page_size):
            raise ValueError("the sliding page table must have the full table's slots, blocks and page size")
        self.full = full
        self.sliding = sliding
        self.tables = [full] if sliding is None else [full, sliding]

    # ---- counts -------------------------------------------------------------------------------
    @property
    def page_size(self) -> int:
        """Tokens per page (both tables)."""
        return self.full.page_size

    @property
    def max_blocks_per_slot(self) -> int:
        """Logical blocks of a slot: `max_seq_len // page_size`."""
        return self.full.max_blocks_per_slot

    @property
    def num_free_slots(self) -> int:
        """Slots available for admission (slot 0 excluded)."""
        return self.full.num_free_slots

    def fits_alone(self, num_tokens: int) -> bool:
        """Whether one sequence of `num_tokens` positions fits every pool with nothing else running."""
        return all(t.num_new_pages(None, num_tokens) <= t.num_pages - 1 for t in self.tables)

    # ---- admission ----------------------------------------------------------------------------
    def can_admit(self, num_tokens: int) -> bool:
        """Whether a free slot and both pools have room for a prompt of `num_tokens` tokens and its first
        decode write (a sliding table may hold one more page for the prompt than after that write)."""
        return self.num_free_slots > 0 and all(
            t.can_reserve(None, num_tokens) and t.can_reserve(None, num_tokens + 1) for t in self.tables)

    def admit(self, num_tokens: int) -> int:
        """Take a slot in every table and reserve a prompt of `num_tokens` tokens; returns the slot."""
        slot = self.full.allocate_slot()
        if self.sliding is not None:
            self.sliding.allocate_this_slot(slot)
        self.reserve(slot, num_tokens)
        return slot

    # ---- growth -------------------------------------------------------------------------------
    def can_reserve(self, slot: int, num_tokens: int) -> bool:
        """Whether `slot` can grow to `num_tokens` positions in every pool."""
        return all(t.can_reserve(slot, num_tokens) for t in self.tables)

    def reserve(self, slot: int, num_tokens: int) -> None:
        """Grow `slot` to `num_tokens` positions in every pool (sliding: releasing what left the window)."""
        for t in self.tables:
            t.reserve(slot, num_tokens)

    def release_all(self, items: list[tuple[int, int]]) -> None:
        """Give back what each (slot, num_tokens) no longer reads: always safe, and it makes room first."""
        for t in self.tables:
            if t.window is not None:
                for slot, n in items:
                    t.release(slot, n)

    def can_reserve_all(self, items: list[tuple[int, int]]) -> bool:
        """Whether every (slot, num_tokens) can grow at once, counting the pages the others release."""
        for t in self.tables:
            if any(t.num_pages_for(n) > t.max_blocks_per_slot for _, n in items):
                return False
            if sum(t.num_new_pages(slot, n) for slot, n in items) > t.num_free_pages:
                return False
        return True

    def reserve_all(self, items: list[tuple[int, int]]) -> None:
        """Grow every (slot, num_tokens): every release first, so one row's new page can be another's old one."""
        self.release_all(items)
        for slot, n in items:
            self.reserve(slot, n)

    def erase(self, slot: int) -> None:
        """Free `slot` and its pages in every pool."""
        for t in self.tables:
            t.erase(slot)

    # ---- engine -------------------------------------------------------------------------------
    def flush(self) -> None:
        """Apply pending host changes of every table to its device tensors."""
        for t in self.tables:
            t.flush()

    def restart(self) -> None:
        """Fresh slot and page order in every table (no-op while any slot is owned; `PageTable.restart`)."""
        for t in self.tables:
            t.restart()

    def scramble(self, generator: torch.Generator) -> None:
        """Shuffle every table's free pages: the layout of an engine that has run a while (tests, benchmarks)."""
        for t in self.tables:
            t.scramble(generator)

    def check_invariants(self) -> None:
        """Assert every table's host and device state agree, and both own the same slots (test helper: syncs)."""
        for t in self.tables:
            t.check_invariants()
        if self.sliding is not None:
            assert self.full.owned_slots == self.sliding.owned_slots, "the tables own different slots"

    def stats(self) -> dict[str, int]:
        """Peak pages in use (all sequences, and the most one sequence held) per pool, and sliding pages released
        behind the window, since the tables were made (`RolloutEngine.stats`)."""
        out = {"kv_pages_peak": self.full.peak_pages, "kv_pages_per_seq_peak": self.full.peak_pages_per_slot,
               "sliding_pages_peak": 0, "sliding_pages_per_seq_peak": 0, "sliding_pages_recycled": 0}
        if self.sliding is not None:
            out.update(sliding_pages_peak=self.sliding.peak_pages,
                       sliding_pages_per_seq_peak=self.sliding.peak_pages_per_slot,
                       sliding_pages_recycled=self.sliding.num_recycled)
        return out
