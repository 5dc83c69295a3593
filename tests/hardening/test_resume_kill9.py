"""kill -9 (or SIGTERM) in the middle of `fit`, resume from `last`: the loss curve equals an uninterrupted run,
bitwise. SIGTERM also ends the console script with exit 143 and one line saying how to continue.

Tiny fp32 config on CPU, one thread per process. 4 batches per epoch and checkpoints every 3 steps, so the
checkpoint the resume starts from (step 3) is in the middle of epoch 0 and the resumed run crosses two
epoch boundaries. The killed process is stopped mid-step (gradients computed, update not applied).
The GPU variant (`-m gpu`) runs the same on one CUDA device and allows 1e-3 on the loss.
"""

from __future__ import annotations

import signal
import subprocess

import pytest
import torch
from _helpers import (
    DATA_CLASS,
    EVERY,
    MAX_STEPS,
    kill9,
    read_steps,
    recorder,
    start_fit,
    tiny_config,
    wait_for_line,
    wait_ok,
    write_config,
)

KILL_AT = 5


def _config(root, log, accelerator, **recorder_kw):
    cfg = tiny_config(root / "ckpt", max_steps=MAX_STEPS, every_n_train_steps=EVERY,
                      callbacks=[recorder(log, **recorder_kw)])
    cfg["trainer"]["accelerator"] = accelerator
    return write_config(root / f"{log.stem}.yaml", cfg)


def _kill_and_resume(tmp_path, accelerator):
    """Run until step KILL_AT, SIGKILL it mid-step, resume from `last`; returns (killed, resumed) steps."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    run_log, resume_log = tmp_path / "run.log", tmp_path / "resume.log"
    run = start_fit(_config(run_dir, run_log, accelerator, hang_at=KILL_AT))
    wait_for_line(run_log, "hang", run)
    assert kill9(run) == -9

    ckpt = run_dir / "ckpt"
    assert (ckpt / "last.ckpt").exists(), sorted(p.name for p in ckpt.iterdir())
    state = torch.load(ckpt / "last.ckpt", map_location="cpu", weights_only=True)
    assert state["global_step"] == EVERY  # the step-3 checkpoint; step 5 never completed
    data_state = state["MockDataModule"]  # the datamodule's own state (data/sampler.py does the skipping)
    assert (data_state["epoch"], data_state["samples_done"]) == (0, EVERY * 2)  # mid-epoch 0, batch size 2

    wait_ok(start_fit(_config(run_dir, resume_log, accelerator), "--ckpt_path", "last"))
    killed, resumed = read_steps(run_log), read_steps(resume_log)
    assert sorted(killed) == list(range(1, KILL_AT))  # steps 1..4 finished before the kill
    assert sorted(resumed) == list(range(EVERY + 1, MAX_STEPS + 1))  # resumed after the step-3 checkpoint
    return killed, resumed


@pytest.mark.timeout(240)
def test_sigterm_mid_step_exits_143_with_one_line_and_resumes_bitwise(tmp_path, reference_steps):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    run_log, resume_log = tmp_path / "run.log", tmp_path / "resume.log"
    run = start_fit(_config(run_dir, run_log, "cpu", hang_at=KILL_AT))
    wait_for_line(run_log, "hang", run)
    run.send_signal(signal.SIGTERM)
    assert run.wait(timeout=60) == 143  # 128 + SIGTERM: a scheduler sees a stopped run, not a finished one
    last_line = run.log_path.read_text().strip().splitlines()[-1]
    assert last_line.startswith(f"stopped by SIGTERM at step {KILL_AT}; last checkpoint "), last_line
    assert last_line.endswith("--ckpt_path last"), last_line
    wait_ok(start_fit(_config(run_dir, resume_log, "cpu"), "--ckpt_path", "last"))
    stopped, resumed = read_steps(run_log), read_steps(resume_log)
    assert sorted(stopped) == list(range(1, KILL_AT + 1))  # the step in flight completed before the stop
    assert not _lost(reference_steps, stopped, resumed, lambda a, b: a == b)


def _lost(reference, killed, resumed, same):
    combined = {**{s: v for s, v in killed.items() if s <= EVERY}, **resumed}
    lost = [s for s in reference if s not in combined or not same(combined[s], reference[s])]
    redone_differently = [s for s in killed if s > EVERY and not same(killed[s], resumed[s])]
    return lost + redone_differently


@pytest.mark.timeout(240)
def test_kill9_mid_epoch_resume_reproduces_loss_curve_bitwise(tmp_path, reference_steps, record_property):
    killed, resumed = _kill_and_resume(tmp_path, "cpu")
    lost = _lost(reference_steps, killed, resumed, lambda a, b: a == b)
    record_property("hardening", "fault")
    record_property("case", f"kill -9 at step {KILL_AT} (mid-epoch), resume from last (step {EVERY})")
    record_property("data_lost", len(lost))
    record_property("data", DATA_CLASS)
    assert not lost, f"steps whose (loss, batch) differ from the uninterrupted run: {lost}"


@pytest.mark.gpu
@pytest.mark.timeout(400)
def test_kill9_resume_on_gpu_within_1e_3(tmp_path, record_property):
    ref_dir = tmp_path / "ref"
    ref_dir.mkdir()
    wait_ok(start_fit(_config(ref_dir, tmp_path / "ref.log", "gpu")))
    reference = read_steps(tmp_path / "ref.log")
    killed, resumed = _kill_and_resume(tmp_path, "gpu")

    def close(a, b):
        return a[1] == b[1] and abs(float.fromhex(a[0]) - float.fromhex(b[0])) <= 1e-3

    lost = _lost(reference, killed, resumed, close)
    record_property("hardening", "fault")
    record_property("case", f"GPU: kill -9 at step {KILL_AT}, resume from last, loss within 1e-3")
    record_property("data_lost", len(lost))
    assert not lost, f"steps off by more than 1e-3 (or on another batch): {lost}"


@pytest.mark.timeout(240)
def test_ctrl_c_mid_step_exits_130_with_the_resume_line(tmp_path, record_property):
    """Ctrl-C (SIGINT): Lightning ends fit with exit 1 and no word on the checkpoint; the console gives the
    shell's 130 and the line SIGTERM gets."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    run_log = tmp_path / "run.log"
    # a child inherits an ignored SIGINT (tests/conftest.py restores it after each test)
    assert signal.getsignal(signal.SIGINT) is not signal.SIG_IGN
    run = start_fit(_config(run_dir, run_log, "cpu", hang_at=KILL_AT))
    wait_for_line(run_log, "hang", run)
    run.send_signal(signal.SIGINT)
    try:
        rc = run.wait(timeout=120)  # seconds on an idle machine
    except subprocess.TimeoutExpired:
        run.kill()
        pytest.fail("no exit 120 s after SIGINT:\n" + run.log_path.read_text()[-3000:])
    assert rc == 130, run.log_path.read_text()[-3000:]  # 128 + SIGINT
    record_property("hardening", "fault")
    record_property("case", f"Ctrl-C at step {KILL_AT}: exit 130 and the line naming the checkpoint to resume from")
    last_line = run.log_path.read_text().strip().splitlines()[-1]
    assert last_line.startswith(f"stopped by SIGINT (Ctrl-C) at step {KILL_AT - 1}; last checkpoint "), last_line
    assert f"{run_dir / 'ckpt' / 'last.ckpt'}" in last_line and last_line.endswith("--ckpt_path last"), last_line
