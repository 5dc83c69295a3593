"""Rollout seeding (rollout/seed.py) and the page table's fresh order per generation: what makes a resumed GRPO
run sample what the uninterrupted one did (the whole run: tests/cli/test_grpo_resume.py)."""

import torch

from lightning_ffpa.rollout.page_table import PageTable
from lightning_ffpa.rollout.seed import rollout_seed, run_seed, seeded


def test_seeded_block_is_a_function_of_its_seed_and_leaves_the_run_stream_alone():
    torch.manual_seed(1)
    expected_after = torch.rand(3)
    torch.manual_seed(1)
    with seeded(torch.device("cpu"), 7):
        first = torch.rand(3)
    with seeded(torch.device("cpu"), 7):
        again = torch.rand(3)
    assert torch.equal(first, again)
    assert torch.equal(torch.rand(3), expected_after)  # the run's stream continues as if nothing drew


def test_seed_differs_by_place_and_reads_the_run_seed(monkeypatch):
    places = [(0, 0, 0, 0), (0, 1, 1, 0), (1, 0, 4, 0), (0, 0, 0, 1)]
    assert len({rollout_seed(3, *p) for p in places}) == len(places)
    assert all(0 <= rollout_seed(3, *p) < 2**63 for p in places)
    monkeypatch.setenv("PL_GLOBAL_SEED", "42")
    assert run_seed() == 42
    monkeypatch.delenv("PL_GLOBAL_SEED")
    assert run_seed() == 0


def test_restart_hands_out_pages_in_a_fresh_order_only_when_idle():
    fresh = PageTable(num_pages=8, page_size=4, num_slots=4, max_blocks_per_slot=4)
    used = PageTable(num_pages=8, page_size=4, num_slots=4, max_blocks_per_slot=4)
    a, b = used.allocate_slot(), used.allocate_slot()
    used.reserve(a, 8)
    used.reserve(b, 4)
    used.erase(a)  # pages come back out of order
    used.restart()  # slot b still owns a page: no-op
    assert used.pages_of(b) and used.num_free_pages == 6
    used.erase(b)
    used.restart()
    for table in (fresh, used):
        slot = table.allocate_slot()
        table.reserve(slot, 12)
    assert used.pages_of(slot) == fresh.pages_of(slot) == [1, 2, 3]
