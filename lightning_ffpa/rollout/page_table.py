"""Page table: which physical KV page holds each logical block of each batch slot.

Owns slot and page bookkeeping (host side, so reserve/erase never wait on the device) and the two
device tables the attention masks read: `table[slot, logical_block] -> page` and
`owner[slot, page] -> logical_block` (-1 when the slot does not own the page).
It does not own the KV tensors (`kv_cache.py`) nor the masks built from these tables (`masks.py`).

Slot 0 and page 0 are reserved: padded batch rows use slot 0, and every unused table entry points
at page 0, so stray writes land in a page no real sequence ever reads.

A table made with a `window` serves sliding-window layers (the engine's second pool, `page_pools.py`): a slot
holds only the pages its next query still reads, [`keep_from`, end), and `reserve` gives the older ones back
to the free list, so a slot holds at most `window_pages` pages however long it grows. Blocks it no longer
holds point at page 0: a prefill's writes of tokens already out of the window land there, unread.
"""

from __future__ import annotations

import torch


def window_pages(window: int, page_size: int, kv_block: int) -> int:
    """Most pages one sequence holds in a sliding table: those spanning [`keep_from`, newest token] over every
    query position (the query's KV block decides how far back the decode mask reads)."""
    worst = 0
    for offset in range(0, page_size, kv_block):  # where a query block starts inside its page
        first = page_size * window + offset  # any start far from position 0, at this offset
        oldest = first - window + 1
        newest = first + kv_block - 1
        worst = max(worst, newest // page_size - oldest // page_size + 1)
    return worst


class PageTable:
    """Logical-block -> physical-page mapping for `num_slots` sequences over `num_pages` pages."""

    def __init__(self, num_pages: int, page_size: int, num_slots: int, max_blocks_per_slot: int,
                 device: torch.device | str = "cpu", window: int | None = None, kv_block: int = 1) -> None:
        """`window`: serve sliding-window layers of this window (pages behind it are released; None keeps every
        page); `kv_block`: the decode masks' KV block, whose query blocks set how far back a step reads."""
        if num_pages < 2:
            raise ValueError(f"`num_pages={num_pages}` must be >= 2 (page 0 is reserved for padding)")
        if num_slots < 2:
            raise ValueError(f"`num_slots={num_slots}` must be >= 2 (slot 0 is reserved for padding)")
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_slots = num_slots
        self.max_blocks_per_slot = max_blocks_per_slot
        self.window = window
        self.kv_block = kv_block
        self.device = torch.device(device)
        self.table = torch.zeros(num_slots, max_blocks_per_slot, dtype=torch.int32, device=self.device)
        self.owner = torch.full((num_slots, num_pages), -1, dtype=torch.int32, device=self.device)
        # Host-side truth; the device tables are written from it in one batched copy per `flush`.
        self._free_pages: list[int] = list(range(num_pages - 1, 0, -1))
        self._free_slots: list[int] = list(range(num_slots - 1, 0, -1))
        self._pages: dict[int, list[int]] = {}  # slot -> pages of its held blocks, in logical order
        self._first: dict[int, int] = {}  # slot -> logical block of its first held page
        # Keyed so the last write wins when a slot is erased and reused before one flush.
        self._pending_table: dict[tuple[int, int], int] = {}  # (slot, block) -> page
        self._pending_owner: dict[tuple[int, int], int] = {}  # (slot, page) -> block or -1
        # Counted for `RolloutEngine.stats`: pages released behind a window, and the peaks of pages in use.
        self.num_recycled = 0
        self.peak_pages = 0
        self.peak_pages_per_slot = 0

    # ---- counts -------------------------------------------------------------------------------
    @property
    def num_free_pages(self) -> int:
        """Pages not owned by any slot (page 0 excluded)."""
        return len(self._free_pages)

    @property
    def num_used_pages(self) -> int:
        """Pages owned by some slot."""
        return self.num_pages - 1 - len(self._free_pages)

    @property
    def num_free_slots(self) -> int:
        """Slots available for admission (slot 0 excluded)."""
        return len(self._free_slots)

    @property
    def owned_slots(self) -> set[int]:
        """Slots allocated now."""
        return set(self._pages)

    def num_pages_for(self, num_tokens: int) -> int:
        """Pages needed to hold `num_tokens` positions."""
        return -(-num_tokens // self.page_size)

    def num_pages_of(self, slot: int) -> int:
        """Pages owned by `slot`."""
        return len(self._pages.get(slot, ()))

    def pages_of(self, slot: int) -> list[int]:
        """Physical pages owned by `slot`, in logical order (from logical block `first_block_of(slot)`)."""
        return list(self._pages.get(slot, []))

    def first_block_of(self, slot: int) -> int:
        """Logical block of the first page `slot` holds (0 unless a window released older ones)."""
        return self._first.get(slot, 0)

    def keep_from(self, num_tokens: int) -> int:
        """First position a slot holding `num_tokens` positions still reads: its newest position's query block
        reaches `window - 1` tokens back from the block's start (0 without a window)."""
        if self.window is None or num_tokens <= 0:
            return 0
        query_block = (num_tokens - 1) // self.kv_block * self.kv_block
        return max(0, query_block - self.window + 1)

    def _span(self, slot: int | None, num_tokens: int) -> tuple[int, int, int]:
        """(first block to keep, end block, pages held now) for `slot` growing to `num_tokens` positions."""
        pages = self._pages.get(slot, []) if slot is not None else []
        held_first = self._first.get(slot, 0) if slot is not None else 0
        first = self.keep_from(num_tokens) // self.page_size
        end = max(self.num_pages_for(num_tokens), held_first + len(pages))
        return max(first, held_first), end, len(pages)  # a held span only moves forward

    # ---- slots --------------------------------------------------------------------------------
    def allocate_slot(self) -> int:
        """Take a free slot (never 0)."""
        if not self._free_slots:
            raise RuntimeError("no free batch slot; check `num_free_slots` before allocating")
        slot = self._free_slots.pop()
        self._pages[slot] = []
        self._first[slot] = 0
        return slot

    def allocate_this_slot(self, slot: int) -> None:
        """Take the free slot `slot` (a second table mirroring the first one's slot numbering)."""
        self._free_slots.remove(slot)
        self._pages[slot] = []
        self._first[slot] = 0

    def restart(self) -> None:
        """With no slot owned, hand out slots and pages again in a fresh table's order (no-op otherwise).

        A generation's page layout, and so the rounding of attention over the pool, then depends on its own
        sequences, not on earlier generations: a run resumed from a checkpoint samples bit for bit what the
        uninterrupted run did."""
        if not self._pages:
            self._free_pages = list(range(self.num_pages - 1, 0, -1))
            self._free_slots = list(range(self.num_slots - 1, 0, -1))

    # ---- pages --------------------------------------------------------------------------------
    def num_new_pages(self, slot: int | None, num_tokens: int) -> int:
        """Free pages `reserve(slot, num_tokens)` takes, net of the ones it releases (None: a new slot)."""
        first, end, held = self._span(slot, num_tokens)
        return end - first - held

    def can_reserve(self, slot: int | None, num_tokens: int) -> bool:
        """Whether `slot` (None: a new slot) can grow to hold `num_tokens` positions."""
        return (self.num_pages_for(num_tokens) <= self.max_blocks_per_slot
                and self.num_new_pages(slot, num_tokens) <= len(self._free_pages))

    def release(self, slot: int, num_tokens: int) -> None:
        """Give back the pages of `slot` that a slot of `num_tokens` positions no longer reads (windowed tables
        only; host-only until `flush`). Stream order keeps a step already queued reading the old pages."""
        pages = self._pages[slot]
        if not pages:
            return
        first = self.keep_from(num_tokens) // self.page_size
        held_first = self._first[slot]
        drop = min(max(first - held_first, 0), len(pages))
        for i, page in enumerate(pages[:drop]):
            self._pending_table[(slot, held_first + i)] = 0
            self._pending_owner[(slot, page)] = -1
        self._free_pages.extend(reversed(pages[:drop]))
        del pages[:drop]
        self._first[slot] = held_first + drop if pages else max(first, held_first)
        self.num_recycled += drop

    def reserve(self, slot: int, num_tokens: int) -> None:
        """Give `slot` the pages for positions [`keep_from(num_tokens)`, num_tokens), releasing older ones;
        host-only until `flush`."""
        need = self.num_pages_for(num_tokens)
        if need > self.max_blocks_per_slot:
            raise ValueError(f"{num_tokens} tokens exceed `max_seq_len`={self.max_blocks_per_slot * self.page_size}")
        self.release(slot, num_tokens)
        pages = self._pages[slot]
        if not pages:  # nothing held: start at the first block still read (a prompt longer than the window)
            self._first[slot] = max(self._first[slot], self.keep_from(num_tokens) // self.page_size)
        first = self._first[slot]
        if need - first - len(pages) > len(self._free_pages):
            raise RuntimeError(f"out of KV pages: slot {slot} needs {need - first - len(pages)}, "
                               f"{len(self._free_pages)} free")
        while first + len(pages) < need:
            page = self._free_pages.pop()
            block = first + len(pages)
            pages.append(page)
            self._pending_table[(slot, block)] = page
            self._pending_owner[(slot, page)] = block
        self.peak_pages = max(self.peak_pages, self.num_used_pages)
        self.peak_pages_per_slot = max(self.peak_pages_per_slot, len(pages))

    def erase(self, slot: int) -> None:
        """Free `slot` and all its pages; its table row points back at page 0."""
        pages = self._pages.pop(slot)
        first = self._first.pop(slot)
        for block, page in enumerate(pages, start=first):
            self._pending_table[(slot, block)] = 0
            self._pending_owner[(slot, page)] = -1
        self._free_pages.extend(reversed(pages))
        self._free_slots.append(slot)

    def flush(self) -> None:
        """Apply pending host changes to the device tables: one small copy, no device->host sync."""
        for pending, target in ((self._pending_table, self.table), (self._pending_owner, self.owner)):
            if not pending:
                continue
            host = torch.tensor([(a, b, v) for (a, b), v in pending.items()], dtype=torch.int32)
            if self.device.type == "cuda":
                host = host.pin_memory()
            idx = host.to(self.device, non_blocking=True)
            target[idx[:, 0].long(), idx[:, 1].long()] = idx[:, 2]
            pending.clear()

    def scramble(self, generator: torch.Generator) -> None:
        """Hand out the free pages in a random order (a running engine's layout after erases and preemptions)."""
        free = sorted(self._free_pages)
        self._free_pages = [free[i] for i in torch.randperm(len(free), generator=generator).tolist()]

    def fill_scrambled(self, lengths: list[int], generator: torch.Generator) -> list[int]:
        """Shuffle the free pages, then give each length its own slot and flush; returns the slots.

        A running engine reaches non-consecutive pages after erases and preemptions; kernel-option
        validation and benchmarks start from that layout instead of the fresh, consecutive one.
        """
        self.scramble(generator)
        slots = []
        for n in lengths:
            slot = self.allocate_slot()
            self.reserve(slot, n)
            slots.append(slot)
        self.flush()
        return slots

    # ---- device-side lookups (graph-capturable) ----------------------------------------------
    def physical_index(self, slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Flat KV-pool index of (slot, position) pairs: page * page_size + offset."""
        blocks = (positions // self.page_size).long()
        pages = self.table[slots.long(), blocks].long()
        return pages * self.page_size + positions.long() % self.page_size

    def check_invariants(self) -> None:
        """Assert host and device state agree (test helper: it syncs)."""
        owned = [p for pages in self._pages.values() for p in pages]
        assert len(owned) == len(set(owned)), "a page is owned twice"
        assert 0 not in owned, "reserved page 0 was allocated"
        assert 0 not in self._pages, "reserved slot 0 was allocated"
        assert set(owned).isdisjoint(self._free_pages), "a page is both free and owned"
        assert len(owned) + len(self._free_pages) == self.num_pages - 1, "pages leaked"
        table, owner = self.table.cpu(), self.owner.cpu()
        assert (table[0] == 0).all() and (owner[0] == -1).all(), "reserved slot 0 was written"
        assert (owner[:, 0] == -1).all(), "reserved page 0 has an owner"
        for slot in range(self.num_slots):
            pages = self._pages.get(slot, [])
            first = self._first.get(slot, 0)
            expect = torch.zeros(self.max_blocks_per_slot, dtype=torch.int32)
            expect[first: first + len(pages)] = torch.tensor(pages, dtype=torch.int32)
            assert torch.equal(table[slot], expect), f"device table row {slot} disagrees with host"
            expect_owner = torch.full((self.num_pages,), -1, dtype=torch.int32)
            for block, page in enumerate(pages, start=first):
                expect_owner[page] = block
            assert torch.equal(owner[slot], expect_owner), f"device owner row {slot} disagrees with host"
