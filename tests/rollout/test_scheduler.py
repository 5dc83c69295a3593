"""Scheduler: admission budgets, EOS / max-token stops, newest-first recompute preemption (no model needed)."""

import pytest

from lightning_ffpa.rollout.page_table import PageTable
from lightning_ffpa.rollout.scheduler import Scheduler, Sequence


def _sched(num_pages=9, page_size=4, batch=3, prefill=16, eos=(7,)):
    pt = PageTable(num_pages, page_size, batch + 1, 8)
    return Scheduler(pt, batch, prefill, set(eos)), pt


def test_admission_respects_token_budget_and_slots():
    s, _ = _sched(num_pages=40, batch=2, prefill=10)
    for i, n in enumerate((6, 6, 3)):
        s.add(Sequence(i, [1] * n, 5))
    kind, seqs = s.schedule()
    assert kind == "prefill" and [q.seq_id for q in seqs] == [0]  # 6 + 6 > 10 tokens
    kind, seqs = s.schedule()
    assert kind == "prefill" and [q.seq_id for q in seqs] == [1]
    kind, seqs = s.schedule()
    assert kind == "decode" and len(seqs) == 2  # batch of 2 is full: seq 2 waits


def test_eos_and_length_stops_free_pages():
    s, pt = _sched(num_pages=40)
    s.add(Sequence(0, [1, 2], 3))
    s.add(Sequence(1, [1, 2], 3))
    _, seqs = s.schedule()
    s.postprocess(seqs, [5, 7], [0.0, 0.0])  # seq 1 emits EOS
    assert [q.finish_reason for q in s.finished] == ["stop"]
    for _ in range(2):
        _, seqs = s.schedule()
        s.postprocess(seqs, [5], [0.0])
    assert s.finished[-1].finish_reason == "length" and len(s.finished[-1].output) == 3
    pt.flush()
    pt.check_invariants()
    assert pt.num_free_pages == 39 and not s.has_work


def test_decode_preempts_newest_and_recomputes():
    s, pt = _sched(num_pages=7, page_size=4, batch=3, prefill=64, eos=())  # 6 usable pages
    for i in range(3):
        s.add(Sequence(i, [1] * 7, 20))  # 2 pages each after prefill
    kind, seqs = s.schedule()
    assert kind == "prefill" and len(seqs) == 3 and pt.num_free_pages == 0
    s.postprocess(seqs, [3, 3, 3], [0.0] * 3)
    kind, seqs = s.schedule()
    assert kind == "decode" and len(seqs) == 3  # position 7 still fits in two pages
    s.postprocess(seqs, [4, 4, 4], [0.0] * 3)  # position 8 needs a third page for everyone
    kind, seqs = s.schedule()
    # the newest (2) gives back two pages: enough for the older two to grow by one each
    assert kind == "decode" and [q.seq_id for q in seqs] == [0, 1]
    assert [q.seq_id for q in s.waiting] == [2] and s.num_preemptions == 1
    assert s.waiting[0].tokens == [1] * 7 + [3, 4]  # re-enters with its generated token: recompute by prefill
    pt.flush()
    pt.check_invariants()


def test_prompt_that_cannot_fit_is_rejected():
    s, _ = _sched()
    with pytest.raises(ValueError, match="max_seq_len"):
        s.add(Sequence(0, [1] * 40, 4))


def test_pending_steps_defer_admission_and_discard_after_eos():
    s, pt = _sched(num_pages=40, batch=2, eos=(7,))
    for i in range(3):
        s.add(Sequence(i, [1, 2], 4))
    _, seqs = s.schedule()
    s.postprocess(seqs, [5, 5], [0.0, 0.0])
    kind, rows = s.schedule()
    assert kind == "decode" and len(rows) == 2
    for q in rows:  # the engine issues the step without reading it back
        q.num_pending += 1
    kind, rows2 = s.schedule()
    assert kind == "decode" and [q.num_issued_tokens for q in rows2] == [4, 4]  # positions follow issued steps
    for q in rows2:
        q.num_pending += 1
    s.postprocess(rows, [7, 5], [0.0, 0.0])  # seq 0 stopped one step ago
    assert s.schedule() == ("sync", [])  # seq 2 could be admitted, but seq 1's token is still in flight
    s.postprocess(rows2, [9, 5], [0.0, 0.0])  # seq 0's extra token is discarded
    assert s.finished[0].output == [5, 7] and s.finished[0].finish_reason == "stop"
    kind, seqs = s.schedule()
    assert kind == "prefill" and [q.seq_id for q in seqs] == [2]


def test_no_step_is_issued_past_max_new_tokens():
    s, _ = _sched(num_pages=40, batch=1, eos=())
    s.add(Sequence(0, [1, 2], 2))
    _, seqs = s.schedule()
    s.postprocess(seqs, [5], [0.0])
    _, rows = s.schedule()
    rows[0].num_pending += 1  # the second (last) token is in flight
    assert s.schedule() == ("sync", [])
    s.postprocess(rows, [6], [0.0])
    assert s.finished[0].output == [5, 6] and not s.has_work
