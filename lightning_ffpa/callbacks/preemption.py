"""Preemption at a step boundary: SLURM's SIGUSR1 save-and-requeue (`DeferredRequeue`) and SIGTERM on any
rank (`StopOnSigterm`), each acted on at the end of a step, by every rank at the same step.

Why: Lightning's SLURM handler (`SLURMEnvironment(auto_requeue=True)`) writes the HPC checkpoint inside the
signal handler, i.e. wherever the main thread happens to be: between backward and the optimizer step, or
between the optimizer step and the loop's progress counters. A checkpoint written there can make the resumed
run redo a step that was already applied, or drop one. This callback only records the signal and runs
Lightning's own handler (same `hpc_ckpt_N.ckpt`, same `scontrol requeue`) after the optimizer step has
completed (with gradient accumulation: after the window's last micro-batch), where the checkpoint equals a
`ModelCheckpoint` one; then it stops the run cleanly.

Both record a signal in their handler and learn at the step's end whether any rank got one. They share one
vote for that (`_StepVote`): one all-reduce per step for both, and none on a single process.

Owns: when the HPC checkpoint is written, and at which step a SIGTERM stops the ranks. Does not own
requeueing or resuming (Lightning: on the requeued job `fit` finds `hpc_ckpt_*.ckpt` in `default_root_dir` by
itself), nor the exit code (`lightning_ffpa.cli`: 143).
"""

from __future__ import annotations

import signal
import weakref
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lightning_ffpa._compat import lightning as lightning_compat
from lightning_ffpa.errors import EXIT_TERMINATED


class _StepVote:
    """Whether any rank raised each voter's flag in this step, agreed in one all-reduce per step.

    Voters are the preemption callbacks of one Trainer that are active in this fit; they join in the same
    order on every rank (the Trainer's callback order, and conditions that are the same on every rank). The
    first voter to ask at a step's end runs the all-reduce over every voter's `pending` flag; the others
    read its answer. On a single process the local flags are the answer: no collective, no device sync.
    """

    def __init__(self) -> None:
        self.voters: list[Any] = []
        self._batch: int | None = None
        self._answer: list[bool] = []

    def join(self, voter: Any) -> None:
        if voter not in self.voters:
            self.voters.append(voter)
            self._batch = None

    def leave(self, voter: Any) -> None:
        if voter in self.voters:
            self.voters.remove(voter)
            self._batch = None

    def any_rank(self, trainer: pl.Trainer, voter: Any) -> bool:
        batch = trainer.fit_loop.total_batch_idx  # the same at every voter's hook of one batch end
        if batch != self._batch:
            flags = [bool(v.pending) for v in self.voters]
            if trainer.world_size > 1:
                votes = torch.tensor(flags, dtype=torch.int32, device=trainer.strategy.root_device)
                flags = [n > 0 for n in trainer.strategy.reduce(votes, reduce_op="sum").tolist()]
            self._batch, self._answer = batch, flags
        return self._answer[self.voters.index(voter)]


_VOTES: weakref.WeakKeyDictionary[pl.Trainer, _StepVote] = weakref.WeakKeyDictionary()


def step_vote(trainer: pl.Trainer) -> _StepVote:
    """The preemption vote of `trainer` (one per Trainer)."""
    vote = _VOTES.get(trainer)
    if vote is None:
        vote = _VOTES[trainer] = _StepVote()
    return vote


class DeferredRequeue(pl.Callback):
    """Run Lightning's SLURM auto-requeue handler at the next step boundary instead of mid-step."""

    def __init__(self, stop_after_requeue: bool = True) -> None:
        """
        Args:
            stop_after_requeue: end `fit` cleanly after the HPC checkpoint is written (SLURM ends the job anyway).
        """
        self.stop_after_requeue = stop_after_requeue
        self._signum: int | None = None
        self._lightning_handler: Any = None
        self._pending = False
        self.num_deferred = 0  # signals handled at a step boundary
        self.requeued: tuple[int, str] | None = None  # (step, HPC checkpoint) where it stopped the fit, for the CLI
        self._held_last: list = []  # ModelCheckpoints whose end-of-train `last` save a requeue holds back

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.requeued = None
        env = lightning_compat.cluster_environment(trainer)
        if not (isinstance(env, SLURMEnvironment) and env.auto_requeue):
            return
        self._signum = env.requeue_signal
        # Lightning registered its handler just before the train stage started; wrap it
        self._lightning_handler = signal.getsignal(self._signum)
        signal.signal(self._signum, self._record)
        step_vote(trainer).join(self)

    @property
    def pending(self) -> bool:
        """The requeue signal reached this rank and the HPC checkpoint has not been written yet."""
        return self._pending

    def _record(self, signum: int, frame: Any) -> None:
        rank_zero_info(f"DeferredRequeue: signal {signum} received; checkpoint at the end of this step")
        self._pending = True

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        if self._lightning_handler is None:  # not under SLURM auto-requeue (the same on every rank): no vote
            return
        # Mid-accumulation the checkpoint would hold the optimizer step before, without this window's
        # gradients, and the resumed run would step on the window's remaining micro-batches only.
        if lightning_compat.accumulating(trainer):
            return
        if not step_vote(trainer).any_rank(trainer, self):
            return
        self._pending = False
        self.num_deferred += 1
        path = lightning_compat.next_hpc_checkpoint(trainer)  # rank 0's: the one the strategy saves to
        self._lightning_handler(self._signum, None)  # Lightning's: hpc_ckpt_N.ckpt + `scontrol requeue`
        if self.stop_after_requeue:
            self.requeued = (trainer.global_step, path)
            trainer.should_stop = True

    def _after_training(self, signum: int, frame: Any) -> None:
        rank_zero_info(f"DeferredRequeue: signal {signum} received after training ended; nothing to checkpoint, "
                       "no requeue")

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        step_vote(trainer).leave(self)
        if self.requeued:
            # The HPC checkpoint holds this step: a ModelCheckpoint that saved nothing yet in this process would
            # write a second full `last` inside the signal's margin (checkpoint callbacks run their hooks last)
            self._held_last = lightning_compat.hold_last_save(trainer)
        if self._lightning_handler is not None:
            # Lightning's handler would requeue a finished run; its teardown then puts back the default
            # action, which ends the process with 138 (on_fit_end installs this handler again after that).
            signal.signal(self._signum, self._after_training)
            self._lightning_handler = None

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        lightning_compat.release_last_save(self._held_last)
        self._held_last = []
        if self._signum is not None:  # under SLURM auto-requeue: the signal can still come before exit
            signal.signal(self._signum, self._after_training)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self.on_train_end(trainer, pl_module)


class StopOnSigterm(pl.Callback):
    """A SIGTERM on any rank stops every rank at the end of the same step, with no collective in the handler.

    Why: Lightning 2.6's own SIGTERM handler broadcasts a tensor from inside the handler, wherever each rank's
    main thread is. Under FSDP2 that broadcast meets another rank's all-gather and the job hangs (two CPU ranks
    given `kill -TERM`, as `srun` signals every task: both ranks stuck mid-forward). Its step-end check is also
    per rank, so a rank signalled a moment later starts a step the others never join. Here the handler only
    records the signal (and runs any handler installed before the Trainer); at each step's end the ranks
    agree on "any rank was signalled" (the vote it shares with `DeferredRequeue`), and all of them stop
    there. The `lightning-ffpa` CLI adds this Callback to every fit.
    """

    def __init__(self) -> None:
        self._pending = False
        self._trainer: pl.Trainer | None = None
        self._lightning_handler: Any = None

    @property
    def pending(self) -> bool:
        """A SIGTERM reached this rank and the ranks have not stopped yet."""
        return self._pending

    def on_sanity_check_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._install(trainer)  # Lightning registers its handler just before the sanity check

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._install(trainer)

    def _install(self, trainer: pl.Trainer) -> None:
        if self._trainer is not None:  # already in place for this fit (a signal during the sanity check counts)
            return
        self._pending, self._trainer = False, trainer
        self._lightning_handler = signal.getsignal(signal.SIGTERM)
        signal.signal(signal.SIGTERM, self._record)
        step_vote(trainer).join(self)

    def _record(self, signum: int, frame: Any) -> None:
        rank_zero_info("StopOnSigterm: SIGTERM received; every rank stops at the end of this step")
        self._pending = True
        before = lightning_compat.handler_before_trainer(self._trainer, signum) if self._trainer else None
        if callable(before):
            before(signum, frame)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        if self._trainer is not None and step_vote(trainer).any_rank(trainer, self):
            lightning_compat.set_received_sigterm(trainer)  # the loop raises SIGTERMException after this hook

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if isinstance(exception, SIGTERMException) and exception.code is None:
            # Lightning's SystemExit(None) would end a script of the user's own with exit 0, and a scheduler would
            # count the stopped run as finished: 128 + SIGTERM, as a shell reports it
            exception.code = EXIT_TERMINATED
            rank_zero_info(f"StopOnSigterm: stopped by SIGTERM at step {trainer.global_step} (exit {EXIT_TERMINATED})")
        step_vote(trainer).leave(self)
        self._trainer = None  # Lightning's teardown restores the handlers from before the Trainer

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Lightning's own teardown, which comes next, restores the handlers from before the Trainer; a stop by
        # SIGTERM skips this hook, and that teardown replaces ours all the same
        if self._trainer is not None and signal.getsignal(signal.SIGTERM) == self._record:
            signal.signal(signal.SIGTERM, self._lightning_handler)
        step_vote(trainer).leave(self)
        self._trainer = None
