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


class _SignalInSanityCheck(L.Callback):
    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        if trainer.sanity_checking and batch_idx == 0:
            os.kill(os.getpid(), signal.SIGTERM)


def _trainer(*callbacks, stop=None, max_steps=6, **kwargs):
    return L.Trainer(accelerator="cpu", max_steps=max_steps, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False,
                     callbacks=[stop or StopOnSigterm(), *callbacks], **kwargs)


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


def test_sigterm_during_the_sanity_check_stops_after_the_first_step():
    """Lightning's handler is in place from the sanity check on; ours replaces it there, not only at train start."""
    trainer = _trainer(_SignalInSanityCheck(), num_sanity_val_steps=2, limit_val_batches=2)
    with pytest.raises(SIGTERMException):
        trainer.fit(BoringModel())
    assert trainer.global_step == 1


def test_one_callback_serves_a_second_fit_after_a_stopped_one():
    stop, before = StopOnSigterm(), signal.getsignal(signal.SIGTERM)
    with pytest.raises(SIGTERMException):
        _trainer(_SignalAt(2), stop=stop).fit(BoringModel())
    assert signal.getsignal(signal.SIGTERM) == before
    trainer = _trainer(_SignalAt(4), stop=stop)
    with pytest.raises(SIGTERMException):
        trainer.fit(BoringModel())
    assert trainer.global_step == 4 and signal.getsignal(signal.SIGTERM) == before


def test_a_script_of_the_users_own_exits_143(tmp_path):
    """Uncaught, Lightning's SIGTERMException is SystemExit(None): a script of the user's own exited 0 after the
    stop, so a scheduler counted the run as finished. StopOnSigterm gives it 128 + SIGTERM."""
    import subprocess
    import sys

    script = tmp_path / "own.py"
    script.write_text(
        "import os, signal\n"
        "import lightning as L\n"
        "from lightning.pytorch.demos.boring_classes import BoringModel\n"
        "from lightning_ffpa.callbacks import StopOnSigterm\n"
        "class At2(L.Callback):\n"
        "    def on_before_optimizer_step(self, trainer, *args):\n"
        "        if trainer.global_step == 1: os.kill(os.getpid(), signal.SIGTERM)\n"
        "L.Trainer(accelerator='cpu', max_steps=6, logger=False, enable_checkpointing=False,\n"
        "          enable_progress_bar=False, callbacks=[StopOnSigterm(), At2()]).fit(BoringModel())\n"
        "print('after fit')\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 143, done.stderr[-2000:]
    assert "stopped by SIGTERM at step 2" in done.stdout + done.stderr and "after fit" not in done.stdout
