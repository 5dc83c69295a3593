"""SIGTERM to a two-rank FSDP2 fit stops both ranks after the same step: exit 143, one line, no rank left behind.

Two CPU ranks (gloo) launched by one console command. Rank 0 is held mid-step (gradients computed, update not
applied) when the signal comes, either to rank 0 alone (`kill PID`) or to every rank (`srun` signals each
task). Lightning's own handler ran a broadcast inside the signal handler and both ranks hung in mismatched
collectives; `StopOnSigterm` (added by the CLI) only records the signal and the ranks agree at the step's end.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
from _helpers import read_steps, recorder, start_fit, tiny_config, wait_for_line, write_config

STOP_AT = 3


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.timeout(300)
@pytest.mark.parametrize("target", ["rank0", "every_rank"])
def test_sigterm_stops_both_ranks_at_the_same_step(tmp_path, target):
    log = tmp_path / "run.log"
    cfg = tiny_config(tmp_path / "ckpt", max_steps=50, callbacks=[recorder(log, hang_at=STOP_AT)])
    cfg["trainer"].update(devices=2, strategy={"class_path": "lightning_ffpa.parallel.FSDP2Strategy",
                                               "init_args": {"param_dtype": None, "reduce_dtype": None}})
    run = start_fit(write_config(tmp_path / "fit.yaml", cfg), new_session=True)
    try:
        wait_for_line(log, "hang", run, timeout=200)
        if target == "rank0":
            run.send_signal(signal.SIGTERM)
        else:
            os.killpg(run.pid, signal.SIGTERM)
        assert run.wait(timeout=90) == 143, run.log_path.read_text()[-4000:]
        deadline = time.monotonic() + 30
        while _group_alive(run.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _group_alive(run.pid), "a rank outlived the stopped run"
    finally:
        if _group_alive(run.pid):
            os.killpg(run.pid, signal.SIGKILL)
    last_line = run.log_path.read_text().strip().splitlines()[-1]
    assert last_line.startswith(f"stopped by SIGTERM at step {STOP_AT}; last checkpoint "), last_line
    assert sorted(read_steps(log)) == list(range(1, STOP_AT + 1))  # the step in flight completed, no more
