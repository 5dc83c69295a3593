"""StopOnSigterm on one process: the step in flight completes, fit stops there, a handler installed before the
Trainer still runs, and the process's SIGTERM handler after `fit` is the one from before it."""

import os
import signal

import lightning as L
import pytest
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lightning_ffpa.callbacks import StopOnSigterm


class _SignalAt(L.Callback):
    """SIGTERM to this process between backward and the optimizer step of step `at`."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if trainer.global_step + 1 == self.at:
            os.kill(os.getpid(), signal.SIGTERM)


def _trainer(*callbacks, max_steps=6):
    return L.Trainer(accelerator="cpu", max_steps=max_steps, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, callbacks=[StopOnSigterm(), *callbacks])


def test_sigterm_mid_step_stops_after_that_step_and_runs_the_earlier_handler():
    seen = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    try:
        mine = signal.getsignal(signal.SIGTERM)
        trainer = _trainer(_SignalAt(3))
        with pytest.raises(SIGTERMException):
            trainer.fit(BoringModel())
        assert trainer.global_step == 3 and seen == [signal.SIGTERM]
        assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_a_finished_fit_leaves_the_handler_it_found():
    before = signal.getsignal(signal.SIGTERM)
    trainer = _trainer(max_steps=2)
    trainer.fit(BoringModel())
    assert trainer.global_step == 2 and signal.getsignal(signal.SIGTERM) == before
