"""The preemption callbacks' shared step-end vote: one all-reduce per step for every voter on several ranks,
none on one process, and each voter gets its own flag's answer."""

from types import SimpleNamespace

import torch

from lightning_ffpa.callbacks.preemption import DeferredRequeue, StopOnSigterm, step_vote


class _Strategy:
    """Stands in for the other rank: its flags are added to ours, as the all-reduce (sum) would."""

    def __init__(self, other_rank: list[int]) -> None:
        self.other_rank, self.calls = other_rank, 0
        self.root_device = torch.device("cpu")

    def reduce(self, tensor, reduce_op="mean"):
        assert reduce_op == "sum"
        self.calls += 1
        return tensor + torch.tensor(self.other_rank, dtype=tensor.dtype)


class _Trainer:
    """What the vote reads of a Trainer."""

    def __init__(self, world_size: int, other_rank: list[int]) -> None:
        self.world_size, self.strategy = world_size, _Strategy(other_rank)
        self.fit_loop = SimpleNamespace(total_batch_idx=0)


def _trainer(world_size: int, other_rank: list[int]) -> _Trainer:
    return _Trainer(world_size, other_rank)


def _voters(trainer, sigterm: bool, requeue: bool):
    stop, requeue_cb = StopOnSigterm(), DeferredRequeue()
    stop._pending, requeue_cb._pending = sigterm, requeue
    vote = step_vote(trainer)
    vote.join(stop)
    vote.join(requeue_cb)
    return vote, stop, requeue_cb


def test_two_voters_share_one_all_reduce_per_step():
    trainer = _trainer(2, other_rank=[0, 1])  # the other rank got the requeue signal
    vote, stop, requeue = _voters(trainer, sigterm=False, requeue=False)
    assert vote.any_rank(trainer, stop) is False
    assert vote.any_rank(trainer, requeue) is True
    assert trainer.strategy.calls == 1
    trainer.fit_loop.total_batch_idx = 1  # the next step's end votes again
    stop._pending = True
    assert vote.any_rank(trainer, requeue) is True and vote.any_rank(trainer, stop) is True
    assert trainer.strategy.calls == 2


def test_one_process_reads_its_own_flags_without_a_collective():
    trainer = _trainer(1, other_rank=[1, 1])
    vote, stop, requeue = _voters(trainer, sigterm=True, requeue=False)
    assert vote.any_rank(trainer, stop) is True and vote.any_rank(trainer, requeue) is False
    assert trainer.strategy.calls == 0


def test_a_voter_that_leaves_is_not_counted_and_the_vote_is_per_trainer():
    trainer = _trainer(2, other_rank=[0])
    vote, stop, requeue = _voters(trainer, sigterm=False, requeue=True)
    vote.leave(requeue)
    assert vote.voters == [stop] and vote.any_rank(trainer, stop) is False
    assert step_vote(_trainer(2, [])) is not vote and step_vote(trainer) is vote
