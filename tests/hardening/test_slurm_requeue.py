"""SLURM preemption on CPU: SIGUSR1 mid-step -> HPC checkpoint at the step boundary + `scontrol requeue`;
the requeued job (same command, same SLURM variables) resumes from it and reproduces the loss curve bitwise.

The job runs `lightning-ffpa fit` with SLURM's variables set, so Lightning selects `SLURMEnvironment`
(auto_requeue=True); a fake `scontrol` on PATH records the requeue call instead of talking to a cluster.
"""

from __future__ import annotations

import os

import pytest
import torch
from _helpers import (
    EVERY,
    MAX_STEPS,
    read_steps,
    recorder,
    start_fit,
    subprocess_env,
    tiny_config,
    wait_ok,
    write_config,
)

SIGNAL_AT = 6  # the step during which the preemption notice arrives (mid-epoch 1)
DEFERRED = {"class_path": "lightning_ffpa.callbacks.preemption.DeferredRequeue"}


def _slurm_env(tmp_path):
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    scontrol = fake_bin / "scontrol"
    scontrol.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path / "scontrol.log"}\n')
    scontrol.chmod(0o755)
    env = subprocess_env()
    env.update(SLURM_JOB_ID="4242", SLURM_JOB_NAME="lffpa-hardening", SLURM_NTASKS="1", SLURM_NTASKS_PER_NODE="1",
               SLURM_NODELIST="localhost", SLURM_JOB_NUM_NODES="1", SLURM_PROCID="0", SLURM_LOCALID="0",
               SLURM_NODEID="0", PATH=f"{fake_bin}{os.pathsep}{env['PATH']}")
    return env


@pytest.mark.timeout(240)
def test_sigusr1_saves_requeues_and_the_requeued_job_resumes_bitwise(tmp_path, reference_steps, record_property):
    env = _slurm_env(tmp_path)
    job, log1, log2 = tmp_path / "job", tmp_path / "first.log", tmp_path / "requeued.log"
    job.mkdir()
    first = write_config(job / "first.yaml", tiny_config(job / "ckpt", max_steps=MAX_STEPS, every_n_train_steps=EVERY,
                                                          callbacks=[recorder(log1, signal_at=SIGNAL_AT), DEFERRED]))
    wait_ok(start_fit(first, env=env))  # stops cleanly after the HPC checkpoint

    assert (tmp_path / "scontrol.log").read_text().split() == ["requeue", "4242"]
    hpc = job / "hpc_ckpt_1.ckpt"
    assert hpc.is_file(), sorted(p.name for p in job.iterdir())
    assert torch.load(hpc, map_location="cpu", weights_only=True)["global_step"] == SIGNAL_AT  # step completed

    # the requeued job: same command line, no ckpt_path; Lightning finds hpc_ckpt_1.ckpt by itself
    again = write_config(job / "again.yaml", tiny_config(job / "ckpt", max_steps=MAX_STEPS, every_n_train_steps=EVERY,
                                                          callbacks=[recorder(log2), DEFERRED]))
    wait_ok(start_fit(again, env=env))
    before, after = read_steps(log1), read_steps(log2)
    assert sorted(before) == list(range(1, SIGNAL_AT + 1))
    assert sorted(after) == list(range(SIGNAL_AT + 1, MAX_STEPS + 1))
    combined = {**before, **after}
    lost = [s for s in reference_steps if combined.get(s) != reference_steps[s]]
    record_property("hardening", "fault")
    record_property("case", f"SLURM SIGUSR1 during step {SIGNAL_AT}: hpc checkpoint, requeue, auto-resume")
    record_property("data_lost", len(lost))
    assert not lost, f"steps whose (loss, batch) differ from the uninterrupted run: {lost}"
