"""Scheduler: admission of waiting sequences into batch slots and KV pages, and recompute-style
preemption when decode runs out of pages.

Owns sequence state and the choice of what runs next (a packed prefill, one decode step, or a sync).
It never touches tensors; pages and slots come from the `PageTable`. A preempted sequence gives back
all its pages and later re-enters as a prefill of prompt + generated tokens (recompute, no KV swapping).

Decode may run ahead of the host: the engine issues a step before it has read the previous step's
tokens (`Sequence.num_pending` counts tokens issued but not read back). Positions and pages follow the
issued count, so a step never needs the host to know token values. Anything that does need exact
host state (admission, preemption) answers "sync" while tokens are pending; the engine reads everything
back and asks again. A sequence that hit EOS may have one more step in flight: its token is discarded.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

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

    def __init__(self, page_table: PageTable, max_batch_size: int, max_prefill_tokens: int,
                 eos_token_ids: set[int] | None = None) -> None:
        self.page_table = page_table
        self.max_batch_size = max_batch_size
        self.max_prefill_tokens = max_prefill_tokens
        self.eos_token_ids = set(eos_token_ids or ())
        self.max_seq_len = page_table.max_blocks_per_slot * page_table.page_size
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.finished: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        """Queue a request; rejects prompts that can never fit."""
        if len(seq.prompt) + 1 > self.max_seq_len:
            raise ValueError(f"prompt of {len(seq.prompt)} tokens does not fit `max_seq_len={self.max_seq_len}`")
        if self.page_table.num_pages_for(len(seq.prompt) + 1) > self.page_table.num_pages - 1:
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
        pt = self.page_table
        rows = [seq for seq in self.running if seq.can_issue(self.max_seq_len)]
        if not rows:
            return "sync", []  # every running sequence is waiting for its last tokens to come back
        if not self._fits(rows):
            if pending:
                return "sync", []  # preemption recomputes from host tokens: read them back first
            self._preempt_for(rows)
            rows = [seq for seq in self.running if seq.can_issue(self.max_seq_len)]
        for seq in rows:
            pt.reserve(seq.slot, seq.num_issued_tokens)
        if not rows:
            raise RuntimeError("every running sequence was preempted: the KV pool is too small")
        return "decode", rows

    def _fits(self, rows: list[Sequence]) -> bool:
        """Whether every row can grow to hold its next token at once."""
        pt = self.page_table
        need = [pt.num_pages_for(seq.num_issued_tokens) for seq in rows]
        if max(need) > pt.max_blocks_per_slot:
            return False
        return sum(n - pt.num_pages_of(seq.slot) for n, seq in zip(need, rows)) <= pt.num_free_pages

    def _can_admit(self) -> bool:
        seq = self.waiting[0]
        return (len(self.running) < self.max_batch_size and self.page_table.num_free_slots > 0
                and self.page_table.can_reserve(None, seq.num_tokens + 1))

    def _admit(self) -> list[Sequence]:
        """FIFO admission under the slot, page and prefill-token budgets."""
        admitted: list[Sequence] = []
        budget = self.max_prefill_tokens
        pt = self.page_table
        while self.waiting and len(self.running) + len(admitted) < self.max_batch_size and pt.num_free_slots:
            seq = self.waiting[0]
            n = seq.num_tokens
            if admitted and n > budget:
                break
            if not pt.can_reserve(None, n + 1):  # room for the prompt and the first decode write
                break
            self.waiting.popleft()
            seq.slot = pt.allocate_slot()
            pt.reserve(seq.slot, n)
            admitted.append(seq)
            budget -= n
        return admitted

    def _preempt_for(self, rows: list[Sequence]) -> None:
        """Oldest first; the newest are preempted until every older row can grow by its next token."""
        pt = self.page_table
        for seq in rows:
            if seq.slot is None:
                continue
            while not pt.can_reserve(seq.slot, seq.num_tokens):
                victim = self.running[-1]
                self.preempt(victim)
                if victim is seq:
                    break
            if seq.slot is not None:
                pt.reserve(seq.slot, seq.num_tokens)

    def preempt(self, seq: Sequence) -> None:
        """Free `seq`'s slot and pages; it re-enters first in line and is recomputed by prefill."""
        self.page_table.erase(seq.slot)
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
        self.page_table.erase(seq.slot)
        seq.slot = None
        self.running.remove(seq)
        self.finished.append(seq)
