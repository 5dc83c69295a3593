"""SLURM preemption on CPU: SIGUSR1 mid-step -> HPC checkpoint at the step boundary + `scontrol requeue`;
the requeued job (same command, same SLURM variables) resumes from it and reproduces the loss curve bitwise.

The job runs `lightning-ffpa fit` with SLURM's variables set, so Lightning selects `SLURMEnvironment`
(auto_requeue=True); a fake `scontrol` on PATH records the requeue call instead of talking to a cluster.
One task, and two tasks started the way `srun` starts them (one process per rank, no launcher; FSDP2); and the
GRPO recipe, whose resumed rollouts must sample what the uninterrupted run's did.
"""

from __future__ import annotations

import os

import pytest
import torch
import yaml
from _helpers import (
    EVERY,
    MAX_STEPS,
    REPO,
    read_steps,
    recorder,
    start_fit,
    subprocess_env,
    tiny_config,
    wait_ok,
    write_config,
)
from lightning.fabric.plugins.environments.lightning import find_free_network_port

SIGNAL_AT = 6  # the step during which the preemption notice arrives (mid-epoch 1)
DEFERRED = {"class_path": "lightning_ffpa.callbacks.preemption.DeferredRequeue"}


def _slurm_env(tmp_path, ntasks: int = 1, procid: int = 0, port: int | None = None):
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir(exist_ok=True)
    scontrol = fake_bin / "scontrol"
    scontrol.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path / "scontrol.log"}\n')
    scontrol.chmod(0o755)
    env = subprocess_env()
    env.update(SLURM_JOB_ID="4242", SLURM_JOB_NAME="lffpa-hardening", SLURM_NTASKS=str(ntasks),
               SLURM_NTASKS_PER_NODE=str(ntasks), SLURM_NODELIST="localhost", SLURM_JOB_NUM_NODES="1",
               SLURM_PROCID=str(procid), SLURM_LOCALID=str(procid), SLURM_NODEID="0",
               PATH=f"{fake_bin}{os.pathsep}{env['PATH']}")
    for key in ("MASTER_ADDR", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK"):
        env.pop(key, None)
    if port is not None:
        env["MASTER_PORT"] = str(port)
    return env


@pytest.mark.timeout(240)
def test_sigusr1_saves_requeues_and_the_requeued_job_resumes_bitwise(tmp_path, reference_steps, record_property):
    env = _slurm_env(tmp_path)
    job, log1, log2 = tmp_path / "job", tmp_path / "first.log", tmp_path / "requeued.log"
    job.mkdir()
    # as the shipped gemma4_ffpa.yaml saves: `last` a link, remade when the fit ends (after the HPC checkpoint), and
    # the periodic saves (step 4) not at the signal's step: the requeued job resumed from step 4, not 6
    ckpt = dict(every_n_train_steps=EVERY + 1, save_last="link")
    first = write_config(job / "first.yaml", tiny_config(job / "ckpt", max_steps=MAX_STEPS, **ckpt,
                                                          callbacks=[recorder(log1, signal_at=SIGNAL_AT), DEFERRED]))
    run = start_fit(first, env=env)
    wait_ok(run)  # stops cleanly after the HPC checkpoint
    last_line = run.log_path.read_text().strip().splitlines()[-1]
    assert last_line.startswith(f"stopped for the SLURM requeue at step {SIGNAL_AT}; HPC checkpoint "
                                f"{job / 'hpc_ckpt_1.ckpt'} "), last_line

    assert (tmp_path / "scontrol.log").read_text().split() == ["requeue", "4242"]
    hpc = job / "hpc_ckpt_1.ckpt"
    assert hpc.is_file(), sorted(p.name for p in job.iterdir())
    assert torch.load(hpc, map_location="cpu", weights_only=True)["global_step"] == SIGNAL_AT  # step completed

    # the requeued job: same command line, no ckpt_path; Lightning finds hpc_ckpt_1.ckpt by itself
    again = write_config(job / "again.yaml", tiny_config(job / "ckpt", max_steps=MAX_STEPS, **ckpt,
                                                          callbacks=[recorder(log2), DEFERRED]))
    wait_ok(start_fit(again, env=env))
    before, after = read_steps(log1), read_steps(log2)
    assert sorted(before) == list(range(1, SIGNAL_AT + 1))
    assert sorted(after) == list(range(SIGNAL_AT + 1, MAX_STEPS + 1))
    combined = {**before, **after}
    lost = [s for s in reference_steps if combined.get(s) != reference_steps[s]]
    record_property("hardening", "fault")
    record_property("case", f"SLURM SIGUSR1 during step {SIGNAL_AT}: hpc checkpoint, requeue, auto-resume; a "
                            "later job resumes from the newer save, not the stale hpc checkpoint")
    record_property("data_lost", len(lost))
    assert not lost, f"steps whose (loss, batch) differ from the uninterrupted run: {lost}"

    # A later job in the same folder (another job id, more steps): hpc_ckpt_1.ckpt (step 6) is still there, older
    # than the saves since; Lightning would take it and train over them. It resumes from the newest save instead.
    log3 = tmp_path / "later.log"
    later = write_config(job / "later.yaml", tiny_config(job / "ckpt", max_steps=MAX_STEPS + 2,
                                                          every_n_train_steps=EVERY, callbacks=[recorder(log3)]))
    run3 = start_fit(later, env={**env, "SLURM_JOB_ID": "4343"})
    wait_ok(run3)
    # the requeued job's newest save is its last step (`FinalCheckpoint`)
    assert sorted(read_steps(log3)) == [MAX_STEPS + 1, MAX_STEPS + 2], run3.log_path.read_text()[-2000:]
    assert "resuming from " in run3.log_path.read_text() and hpc.is_file()


def _srun(tmp_path, name: str, callbacks: list[dict], port: int) -> list:
    """The tiny FSDP2 fit as `srun --ntasks=2` starts it: one `lightning-ffpa fit` per task, SLURM's variables."""
    cfg = tiny_config(tmp_path / "job" / "ckpt", max_steps=MAX_STEPS, every_n_train_steps=EVERY, callbacks=callbacks)
    cfg["trainer"].update(devices=2, default_root_dir=str(tmp_path / "job"),
                          strategy={"class_path": "lightning_ffpa.parallel.FSDP2Strategy",
                                    "init_args": {"param_dtype": None, "reduce_dtype": None}})
    config = write_config(tmp_path / f"{name}.yaml", cfg)
    return [start_fit(config, env=_slurm_env(tmp_path, ntasks=2, procid=r, port=port),
                      log=tmp_path / f"{name}_task{r}.out") for r in range(2)]


@pytest.mark.timeout(300)
def test_two_srun_tasks_requeue_at_one_step_and_resume_bitwise(tmp_path, record_property):
    port = find_free_network_port()
    (tmp_path / "job").mkdir()
    reference, first, again = (tmp_path / f"{n}.log" for n in ("reference", "first", "again"))
    (tmp_path / "ref").mkdir()
    for task in _srun(tmp_path / "ref", "reference", [recorder(reference)], port):  # uninterrupted, 2 tasks
        wait_ok(task)

    # Rank 0 gets the notice mid-step; both tasks finish that step, save one checkpoint, and stop.
    tasks = _srun(tmp_path, "first", [recorder(first, signal_at=SIGNAL_AT), DEFERRED], port)
    for task in tasks:
        wait_ok(task)
    assert (tmp_path / "scontrol.log").read_text().split() == ["requeue", "4242"]  # rank 0 alone requeues
    hpc = tmp_path / "job" / "hpc_ckpt_1.ckpt"
    assert sorted(p.name for p in (tmp_path / "job").glob("hpc_ckpt_*")) == [hpc.name]
    assert (hpc / ".metadata").is_file()  # one sharded checkpoint, both ranks' shards published
    last_line = tasks[0].log_path.read_text().strip().splitlines()[-1]
    assert last_line.startswith(f"stopped for the SLURM requeue at step {SIGNAL_AT}; HPC checkpoint {hpc} ")

    # The requeued job: the same two tasks, no ckpt_path; Lightning finds hpc_ckpt_1.ckpt on both ranks.
    for task in _srun(tmp_path, "again", [recorder(again), DEFERRED], port):
        wait_ok(task)
    want, before, after = read_steps(reference), read_steps(first), read_steps(again)
    assert sorted(before) == list(range(1, SIGNAL_AT + 1))
    assert sorted(after) == list(range(SIGNAL_AT + 1, MAX_STEPS + 1))
    lost = [s for s in want if {**before, **after}.get(s) != want[s]]
    record_property("hardening", "fault")
    record_property("case", f"SLURM, 2 srun tasks (FSDP2), SIGUSR1 during step {SIGNAL_AT}: one sharded hpc "
                            "checkpoint, one requeue, auto-resume")
    record_property("data_lost", len(lost))
    assert not lost, f"steps whose (loss, batch) differ from the uninterrupted 2-task run: {lost}"


def _grpo(path, root, callbacks: list[dict]):
    """configs/tiny_grpo.yaml at 6 steps over 8 prompts (an epoch crossed), `callbacks` before RolloutCallback."""
    cfg = yaml.safe_load((REPO / "configs" / "tiny_grpo.yaml").read_text())
    cfg["trainer"].update(max_steps=6, logger=False, enable_progress_bar=False, enable_model_summary=False,
                          default_root_dir=str(root))
    cfg["trainer"]["callbacks"][-1:-1] = callbacks  # RolloutCallback stays last
    cfg["trainer"]["callbacks"][-1]["init_args"]["num_generations"] = 4
    cfg["data"]["init_args"]["num_random_prompts"] = 8
    return write_config(path, cfg)


@pytest.mark.timeout(240)
def test_grpo_requeue_resumes_the_rollouts_bitwise(tmp_path, record_property):
    """tiny_grpo.yaml with DeferredRequeue: SIGUSR1 during step 4, HPC checkpoint, requeue, and the requeued job
    repeats the uninterrupted run's losses and sampled batches (prompts + completions) bit for bit."""
    env, job = _slurm_env(tmp_path), tmp_path / "job"
    reference, first, again = (tmp_path / f"{n}.log" for n in ("reference", "first", "again"))
    wait_ok(start_fit(_grpo(tmp_path / "reference.yaml", tmp_path / "ref", [recorder(reference)])))
    wait_ok(start_fit(_grpo(tmp_path / "first.yaml", job, [recorder(first, signal_at=4), DEFERRED]), env=env))
    assert (tmp_path / "scontrol.log").read_text().split() == ["requeue", "4242"]
    assert torch.load(job / "hpc_ckpt_1.ckpt", map_location="cpu", weights_only=False)["global_step"] == 4
    wait_ok(start_fit(_grpo(tmp_path / "again.yaml", job, [recorder(again), DEFERRED]), env=env))
    want, before, after = read_steps(reference), read_steps(first), read_steps(again)
    assert sorted(before) == [1, 2, 3, 4] and sorted(after) == [5, 6]
    lost = [s for s in want if {**before, **after}.get(s) != want[s]]
    record_property("hardening", "fault")
    record_property("case", "GRPO (tiny_grpo.yaml), SLURM SIGUSR1 during step 4: hpc checkpoint, requeue, "
                            "auto-resume with the same rollouts")
    record_property("data_lost", len(lost))
    assert not lost, f"steps whose (loss, sampled batch) differ from the uninterrupted run: {lost}"
