"""Scheduler: admission of waiting sequences into batch slots and KV pages, and recompute-style
preemption when decode runs out of pages.

Owns sequence state and the choice of what runs next (a packed prefill, one decode step, or a sync).
It never touches tensors; pages and slots come from the `PagePools` (the full layers' page table, and the
sliding layers' one when the engine recycles their pages), and a sequence runs only while both have room.
A preempted sequence gives back all its pages and later re-enters as a prefill of prompt + generated
tokens (recompute, no KV swapping).

Decode may run ahead of the host: the engine issues a step before it has read the previous step's
tokens (`Sequence.num_pending` counts tokens issued but not read back). Positions and pages follow the
issued count, so a step never needs the host to know token values. Anything that does need exact
host state (admission, preemption) answers "sync" while tokens are pending; the engine reads everything
back and asks again. A sequence that hit EOS may have one more step in flight: its token is discarded.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from lightning_ffpa.rollout.page_pools import PagePools
from lightning_ffpa.rollout.page_table import PageTable


@dataclass
class Sequence:
    """One request: its prompt, what it has generated, and where it lives."""

    seq_id: int
    prompt: list[int]
    max_new_tokens: int
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    slot: int | None = None
    finish_reason: str | None = None
    num_preemptions: int = 0
    num_pending: int = 0
    """Decode steps issued for this sequence whose tokens the host has not read back yet."""

    @property
    def tokens(self) -> list[int]:
        """Prompt followed by generated tokens."""
        return self.prompt + self.output

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated length."""
        return len(self.prompt) + len(self.output)

    @property
    def num_issued_tokens(self) -> int:
        """Tokens the device holds or is computing: known ones plus those still in flight."""
        return self.num_tokens + self.num_pending

    def can_issue(self, max_seq_len: int) -> bool:
        """Whether another decode step may be issued without overshooting a length limit."""
        return (len(self.output) + self.num_pending < self.max_new_tokens
                and self.num_issued_tokens < max_seq_len)


class Scheduler:
    """FIFO admission under slot, page and prefill-token budgets; newest-first preemption."""

    def __init__(self, pages: PagePools | PageTable, max_batch_size: int, max_prefill_tokens: int,
                 eos_token_ids: set[int] | None = None) -> None:
        """`pages`: the engine's pools, or one page table serving every layer."""
        self.pages = pages if isinstance(pages, PagePools) else PagePools(pages)
        self.max_batch_size = max_batch_size
        self.max_prefill_tokens = max_prefill_tokens
        self.eos_token_ids = set(eos_token_ids or ())
        self.max_seq_len = self.pages.max_blocks_per_slot * self.pages.page_size
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.finished: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        """Queue a request; rejects prompts that can never fit."""
        if len(seq.prompt) + 1 > self.max_seq_len:
            raise ValueError(f"prompt of {len(seq.prompt)} tokens does not fit `max_seq_len={self.max_seq_len}`")
        if not self.pages.fits_alone(len(seq.prompt) + 1):
            raise ValueError(f"prompt of {len(seq.prompt)} tokens needs more than `num_pages` holds")
        self.waiting.append(seq)

    @property
    def has_work(self) -> bool:
        """Whether anything is waiting or running."""
        return bool(self.waiting or self.running)

    def schedule(self) -> tuple[str, list[Sequence]]:
        """Pick the next step: ("prefill", admitted) when anything can be admitted, else ("decode", rows);
        ("sync", []) when that choice needs tokens still in flight (the engine drains, then asks again)."""
        pending = any(seq.num_pending for seq in self.running)
        if pending and self.waiting and self._can_admit():
            return "sync", []
        admitted = [] if pending else self._admit()
        if admitted:
            self.running.extend(admitted)
            return "prefill", admitted
        if not self.running:
            raise RuntimeError("nothing runs and nothing can be admitted: the KV pool is too small")
        rows = [seq for seq in self.running if seq.can_issue(self.max_seq_len)]
        if not rows:
            return "sync", []  # every running sequence is waiting for its last tokens to come back
        if not self.pages.can_reserve_all(_growth(rows)):
            if pending:
                return "sync", []  # preemption recomputes from host tokens: read them back first
            self._preempt_for(rows)
            rows = [seq for seq in self.running if seq.can_issue(self.max_seq_len)]
        self.pages.reserve_all(_growth(rows))
        if not rows:
            raise RuntimeError("every running sequence was preempted: the KV pool is too small")
        return "decode", rows

    def _can_admit(self) -> bool:
        return len(self.running) < self.max_batch_size and self.pages.can_admit(self.waiting[0].num_tokens)

    def _admit(self) -> list[Sequence]:
        """FIFO admission under the slot, page and prefill-token budgets."""
        admitted: list[Sequence] = []
        budget = self.max_prefill_tokens
        while self.waiting and len(self.running) + len(admitted) < self.max_batch_size:
            seq = self.waiting[0]
            n = seq.num_tokens
            if admitted and n > budget:
                break
            if not self.pages.can_admit(n):  # a slot, and room for the prompt and the first decode write
                break
            self.waiting.popleft()
            seq.slot = self.pages.admit(n)
            admitted.append(seq)
            budget -= n
        return admitted

    def _preempt_for(self, rows: list[Sequence]) -> None:
        """Oldest first; the newest are preempted until every older row can grow by its next token."""
        self.pages.release_all(_growth(rows))  # what left a window is free before anyone is preempted
        for seq in rows:
            if seq.slot is None:
                continue
            while not self.pages.can_reserve(seq.slot, seq.num_tokens):
                victim = self.running[-1]
                self.preempt(victim)
                if victim is seq:
                    break
            if seq.slot is not None:
                self.pages.reserve(seq.slot, seq.num_tokens)

    def preempt(self, seq: Sequence) -> None:
        """Free `seq`'s slot and pages; it re-enters first in line and is recomputed by prefill."""
        self.pages.erase(seq.slot)
        seq.slot = None
        self.running.remove(seq)
        self.waiting.appendleft(seq)
        seq.num_preemptions += 1
        self.num_preemptions += 1

    def postprocess(self, seqs: list[Sequence], tokens: list[int], logprobs: list[float]) -> None:
        """Append one sampled token per sequence and retire the ones that stop.

        `seqs` are the rows of one issued step, oldest step first; a row that already stopped (EOS seen
        in an earlier step while this one was in flight) has its token discarded."""
        for seq, tok, lp in zip(seqs, tokens, logprobs):
            seq.num_pending = max(seq.num_pending - 1, 0)
            if seq.finish_reason is not None:
                continue
            seq.output.append(tok)
            seq.logprobs.append(lp)
            if tok in self.eos_token_ids:
                self._finish(seq, "stop")
            elif len(seq.output) >= seq.max_new_tokens or seq.num_tokens >= self.max_seq_len:
                self._finish(seq, "length")

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        self.pages.erase(seq.slot)
        seq.slot = None
        self.running.remove(seq)
        self.finished.append(seq)


def _growth(rows: list[Sequence]) -> list[tuple[int, int]]:
    """(slot, positions after the step) of every row of a decode step."""
    return [(seq.slot, seq.num_issued_tokens) for seq in rows]
