"""Page-table invariants: no double allocation, erase frees pages, reserved slot 0 / page 0 untouched."""

import random

import pytest

from lightning_ffpa.rollout.page_table import PageTable


def test_reserve_erase_random_walk_keeps_invariants():
    pt = PageTable(num_pages=33, page_size=4, num_slots=6, max_blocks_per_slot=10)
    rng = random.Random(0)
    live: dict[int, int] = {}
    for _ in range(300):
        if live and (rng.random() < 0.3 or not pt.num_free_slots):
            slot = rng.choice(sorted(live))
            pt.erase(slot)
            del live[slot]
        elif pt.num_free_slots and rng.random() < 0.5:
            slot = pt.allocate_slot()
            assert slot != 0
            live[slot] = 0
        elif live:
            slot = rng.choice(sorted(live))
            want = live[slot] + rng.randint(1, 9)
            if pt.can_reserve(slot, want):
                pt.reserve(slot, want)
                live[slot] = want
            else:
                with pytest.raises((RuntimeError, ValueError)):
                    pt.reserve(slot, want)
        if rng.random() < 0.5:
            pt.flush()
            pt.check_invariants()
    pt.flush()
    pt.check_invariants()
    for slot in list(live):
        pt.erase(slot)
    pt.flush()
    pt.check_invariants()
    assert pt.num_free_pages == 32 and pt.num_free_slots == 5


def test_erase_then_reuse_in_one_flush_last_write_wins():
    pt = PageTable(num_pages=9, page_size=2, num_slots=3, max_blocks_per_slot=4)
    a = pt.allocate_slot()
    pt.reserve(a, 5)
    pt.flush()
    pt.erase(a)
    b = pt.allocate_slot()
    assert b == a  # the freed slot is handed out again before any flush
    pt.reserve(b, 3)
    pt.flush()
    pt.check_invariants()


def test_physical_index_and_errors():
    import torch

    pt = PageTable(num_pages=5, page_size=4, num_slots=2, max_blocks_per_slot=3)
    s = pt.allocate_slot()
    pt.reserve(s, 6)
    pt.flush()
    pages = pt.pages_of(s)
    idx = pt.physical_index(torch.tensor([s, s, 0]), torch.tensor([1, 5, 3]))
    assert idx.tolist() == [pages[0] * 4 + 1, pages[1] * 4 + 1, 0 * 4 + 3]
    with pytest.raises(ValueError, match="max_seq_len"):
        pt.reserve(s, 13)
    with pytest.raises(ValueError, match="num_pages"):
        PageTable(num_pages=1, page_size=4, num_slots=2, max_blocks_per_slot=3)
