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


def _read_back(window, page_size, kv_block, position):
    """Pages the decode mask of a query at `position` lists: its KV block's queries read back `window - 1` tokens."""
    first = max(0, position // kv_block * kv_block - window + 1)
    return set(range(first // page_size, position // page_size + 1))


@pytest.mark.parametrize("window, page_size, kv_block", [(16, 4, 4), (16, 4, 2), (6, 4, 4), (10, 4, 1), (20, 8, 8),
                                                         (5, 16, 16), (1024, 128, 64)])
def test_windowed_table_holds_every_page_a_query_reads_and_at_most_window_pages(window, page_size, kv_block):
    """One sequence grows a token at a time to ten windows: each step it holds every page its query block reads
    (a released one would be read as page 0), never more than `window_pages`, and the rest went back."""
    from lightning_ffpa.rollout.page_table import window_pages

    length = 10 * window + 3 * page_size
    blocks = -(-length // page_size)
    pt = PageTable(num_pages=blocks + 1, page_size=page_size, num_slots=2, max_blocks_per_slot=blocks,
                   window=window, kv_block=kv_block)
    slot = pt.allocate_slot()
    peak = 0
    for n in range(1, length + 1):
        pt.reserve(slot, n)
        first = pt.first_block_of(slot)
        held = set(range(first, first + pt.num_pages_of(slot)))
        assert _read_back(window, page_size, kv_block, n - 1) <= held, n
        peak = max(peak, len(held))
    assert peak == window_pages(window, page_size, kv_block) == pt.peak_pages_per_slot
    assert pt.num_recycled == blocks - pt.num_pages_of(slot)
    pt.flush()
    pt.check_invariants()


def test_windowed_random_walk_keeps_invariants_and_reuses_released_pages():
    pt = PageTable(num_pages=12, page_size=4, num_slots=4, max_blocks_per_slot=30, window=8, kv_block=4)
    rng = random.Random(1)
    live: dict[int, int] = {}
    for _ in range(400):
        if live and (rng.random() < 0.1 or not pt.num_free_slots):
            slot = rng.choice(sorted(live))
            pt.erase(slot)
            del live[slot]
        elif pt.num_free_slots and rng.random() < 0.3:
            slot = pt.allocate_slot()
            live[slot] = 0
            want = rng.randint(1, 40)  # a prompt: longer ones start past their first pages
            if pt.can_reserve(slot, want):
                pt.reserve(slot, want)
                live[slot] = want
        elif live:
            slot = rng.choice(sorted(live))
            want = min(live[slot] + rng.randint(1, 3), 120)
            if pt.can_reserve(slot, want):
                before = pt.num_free_pages
                assert pt.num_new_pages(slot, want) == before - (pt.reserve(slot, want) or pt.num_free_pages)
                live[slot] = want
        if rng.random() < 0.5:
            pt.flush()
            pt.check_invariants()
    assert pt.num_recycled > pt.num_pages  # pages went round the pool more than once
    for slot in list(live):
        pt.erase(slot)
    pt.flush()
    pt.check_invariants()
    assert pt.num_free_pages == 11 and pt.num_free_slots == 3
