"""The launch environment through the console script: variables torchrun, SLURM or the user set that Lightning
would meet as a traceback (`MASTER_PORT=abc`, `--ntasks` without `--ntasks-per-node`) or as a wrong run (torchrun
with more processes than `trainer.devices`: independent fits whose siblings were refused as "another fit").
Each exits 2 with one line naming the variable or option, before any model is built or file written."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import yaml
from _console import ROOT, env, run, snapshot

TORCHRUN_2 = {"TORCHELASTIC_RUN_ID": "t46", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1",
              "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29546"}  # rank 1 of torchrun -nproc 2
SLURM_NTASKS_ONLY = {"SLURM_NTASKS": "2", "SLURM_JOB_NAME": "train", "SLURM_JOB_ID": "46", "SLURM_NODELIST": "n1",
                     "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0"}
SLURM_2 = {**SLURM_NTASKS_ONLY, "SLURM_NTASKS_PER_NODE": "2", "SLURM_NNODES": "1"}  # srun --ntasks-per-node 2
FSDP2_4 = "--trainer.strategy lightning_ffpa.parallel.FSDP2Strategy --trainer.devices 4"
# name: (environment, the one line's start, extra options)
CASES = {
    "master_port": ({"MASTER_PORT": "abc"}, "error: `MASTER_PORT='abc'`: must be a TCP port number", ""),
    "slurm_ntasks": (SLURM_NTASKS_ONLY, "error: `SLURM_NTASKS='2'`: the job sets `--ntasks=2` without `--ntasks-per-node`",
                     ""),
    "torchrun_world": (TORCHRUN_2, "error: `trainer.devices=1`: torchrun started 2 processes (WORLD_SIZE; 2 per node)",
                       ""),
    # FSDP2Strategy has no launcher under either, so nothing compared: a traceback at the mesh ("Mesh should not be
    # bigger than default world size 2, but found 4 ranks"), exit 1
    "torchrun_world_fsdp2": (TORCHRUN_2, "error: `trainer.devices=4`: torchrun started 2 processes", FSDP2_4),
    # one device: each srun task ran a fit of its own into the same folder, every one exiting 0
    "slurm_tasks_one_device": (SLURM_2, "error: `trainer.devices`: You set `devices=1` in Lightning, but the number "
                                        "of tasks per node configured in SLURM `--ntasks-per-node=2`", ""),
    # the second task has no device of its own: an IndexError traceback at the strategy's root device
    "slurm_tasks_fsdp2_rank1": ({**SLURM_2, "SLURM_PROCID": "1", "SLURM_LOCALID": "1"},
                                "error: `trainer.devices`: You set `devices=1` in Lightning",
                                "--trainer.strategy lightning_ffpa.parallel.FSDP2Strategy"),
    "slurm_tasks_fsdp2": (SLURM_2, "error: `trainer.devices`: You set `devices=4` in Lightning, but the number of "
                                   "tasks per node configured in SLURM `--ntasks-per-node=2` does not match", FSDP2_4),
}


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    cfg = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())
    cfg["trainer"].update(max_steps=2, limit_val_batches=0)
    cfg["data"]["init_args"].update(batch_size=2, max_seq_length=32)

    def one(name):
        cwd = tmp_path_factory.mktemp(name)
        (cwd / "fit.yaml").write_text(yaml.safe_dump(cfg))
        before = snapshot(cwd)
        proc = run(f"lightning-ffpa fit --config fit.yaml {CASES[name][2]}", cwd, timeout=240,
                   env={**env(), **CASES[name][0]})
        return name, (proc, before, snapshot(cwd))

    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(pool.map(one, CASES))


@pytest.mark.slow
@pytest.mark.parametrize("name", CASES)
def test_bad_launch_environment_exits_2_with_one_line(results, name, record_property):
    proc, before, after = results[name]
    record_property("hardening", "bad_input")
    record_property("case", f"launch environment: {name}")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.splitlines() == [proc.stderr.strip()] and proc.stderr.startswith(CASES[name][1]), proc.stderr
    assert proc.stdout == "" and before == after
