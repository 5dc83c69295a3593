"""Page table: which physical KV page holds each logical block of each batch slot.

Owns slot and page bookkeeping (host side, so reserve/erase never wait on the device) and the two
device tables the attention masks read: `table[slot, logical_block] -> page` and
`owner[slot, page] -> logical_block` (-1 when the slot does not own the page).
It does not own the KV tensors (`kv_cache.py`) nor the masks built from these tables (`masks.py`).

Slot 0 and page 0 are reserved: padded batch rows use slot 0, and every unused table entry points
at page 0, so stray writes land in a page no real sequence ever reads.
"""

from __future__ import annotations

import torch


class PageTable:
    """Logical-block -> physical-page mapping for `num_slots` sequences over `num_pages` pages."""

    def __init__(self, num_pages: int, page_size: int, num_slots: int, max_blocks_per_slot: int,
                 device: torch.device | str = "cpu") -> None:
        if num_pages < 2:
            raise ValueError(f"`num_pages={num_pages}` must be >= 2 (page 0 is reserved for padding)")
        if num_slots < 2:
            raise ValueError(f"`num_slots={num_slots}` must be >= 2 (slot 0 is reserved for padding)")
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_slots = num_slots
        self.max_blocks_per_slot = max_blocks_per_slot
        self.device = torch.device(device)
        self.table = torch.zeros(num_slots, max_blocks_per_slot, dtype=torch.int32, device=self.device)
        self.owner = torch.full((num_slots, num_pages), -1, dtype=torch.int32, device=self.device)
        # Host-side truth; the device tables are written from it in one batched copy per `flush`.
        self._free_pages: list[int] = list(range(num_pages - 1, 0, -1))
        self._free_slots: list[int] = list(range(num_slots - 1, 0, -1))
        self._pages: dict[int, list[int]] = {}
        # Keyed so the last write wins when a slot is erased and reused before one flush.
        self._pending_table: dict[tuple[int, int], int] = {}  # (slot, block) -> page
        self._pending_owner: dict[tuple[int, int], int] = {}  # (slot, page) -> block or -1

    # ---- counts -------------------------------------------------------------------------------
    @property
    def num_free_pages(self) -> int:
        """Pages not owned by any slot (page 0 excluded)."""
        return len(self._free_pages)

    @property
    def num_free_slots(self) -> int:
        """Slots available for admission (slot 0 excluded)."""
        return len(self._free_slots)

    def num_pages_for(self, num_tokens: int) -> int:
        """Pages needed to hold `num_tokens` positions."""
        return -(-num_tokens // self.page_size)

    def num_pages_of(self, slot: int) -> int:
        """Pages owned by `slot`."""
        return len(self._pages.get(slot, ()))

    def pages_of(self, slot: int) -> list[int]:
        """Physical pages owned by `slot`, in logical order."""
        return list(self._pages.get(slot, []))

    # ---- slots --------------------------------------------------------------------------------
    def allocate_slot(self) -> int:
        """Take a free slot (never 0)."""
        if not self._free_slots:
            raise RuntimeError("no free batch slot; check `num_free_slots` before allocating")
        slot = self._free_slots.pop()
        self._pages[slot] = []
        return slot

    def restart(self) -> None:
        """With no slot owned, hand out slots and pages again in a fresh table's order (no-op otherwise).

        A generation's page layout, and so the rounding of attention over the pool, then depends on its own
        sequences, not on earlier generations: a run resumed from a checkpoint samples bit for bit what the
        uninterrupted run did."""
        if not self._pages:
            self._free_pages = list(range(self.num_pages - 1, 0, -1))
            self._free_slots = list(range(self.num_slots - 1, 0, -1))

    # ---- pages --------------------------------------------------------------------------------
    def can_reserve(self, slot: int | None, num_tokens: int) -> bool:
        """Whether `slot` (None: a new slot) can grow to hold `num_tokens` positions."""
        have = len(self._pages.get(slot, [])) if slot is not None else 0
        need = self.num_pages_for(num_tokens)
        return need <= self.max_blocks_per_slot and need - have <= len(self._free_pages)

    def reserve(self, slot: int, num_tokens: int) -> None:
        """Give `slot` enough pages for positions [0, num_tokens); host-only until `flush`."""
        pages = self._pages[slot]
        need = self.num_pages_for(num_tokens)
        if need > self.max_blocks_per_slot:
            raise ValueError(f"{num_tokens} tokens exceed `max_seq_len`={self.max_blocks_per_slot * self.page_size}")
        if need - len(pages) > len(self._free_pages):
            raise RuntimeError(f"out of KV pages: slot {slot} needs {need - len(pages)}, {len(self._free_pages)} free")
        while len(pages) < need:
            page = self._free_pages.pop()
            block = len(pages)
            pages.append(page)
            self._pending_table[(slot, block)] = page
            self._pending_owner[(slot, page)] = block

    def erase(self, slot: int) -> None:
        """Free `slot` and all its pages; its table row points back at page 0."""
        pages = self._pages.pop(slot)
        for block, page in enumerate(pages):
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

    def fill_scrambled(self, lengths: list[int], generator: torch.Generator) -> list[int]:
        """Shuffle the free pages, then give each length its own slot and flush; returns the slots.

        A running engine reaches non-consecutive pages after erases and preemptions; kernel-option
        validation and benchmarks start from that layout instead of the fresh, consecutive one.
        """
        self._free_pages = (torch.randperm(self.num_pages - 1, generator=generator) + 1).tolist()
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
            expect = torch.zeros(self.max_blocks_per_slot, dtype=torch.int32)
            expect[: len(pages)] = torch.tensor(pages, dtype=torch.int32)
            assert torch.equal(table[slot], expect), f"device table row {slot} disagrees with host"
            expect_owner = torch.full((self.num_pages,), -1, dtype=torch.int32)
            for block, page in enumerate(pages):
                expect_owner[page] = block
            assert torch.equal(owner[slot], expect_owner), f"device owner row {slot} disagrees with host"
