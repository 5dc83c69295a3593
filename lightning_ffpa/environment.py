"""Checks of the launch environment: the variables a launcher (torchrun, SLURM) or the user set for the run.

Owns refusing, with one line naming the variable or option, what Lightning would otherwise meet as a
traceback or a wrong run: a `MASTER_PORT` that is not a port, a SLURM job with `--ntasks` but no
`--ntasks-per-node`, and a torchrun world size that `trainer.devices` x `trainer.num_nodes` does not match
(each process would start its own fit, and the siblings would fight over the run directory).
Does not own the layout checks between components (`lightning_ffpa.validation`) or the cluster's own
launcher checks (`cli.check_cluster_layout`).
"""

from __future__ import annotations

import os
from typing import Any

from lightning_ffpa.errors import ConfigError

__all__ = ["check_environment", "check_world_matches_launcher"]


def check_environment() -> None:
    """Before the Trainer is built: `MASTER_PORT`, and SLURM's task layout (Lightning's SLURM environment raises
    on `--ntasks` without `--ntasks-per-node` while the Trainer is constructed)."""
    from lightning.fabric.plugins.environments import SLURMEnvironment

    port = os.environ.get("MASTER_PORT")
    if port is not None and not (port.strip().isdigit() and 0 < int(port) < 65536):
        raise ConfigError("MASTER_PORT", port, "must be a TCP port number in 1..65535 (an environment variable)")
    if "SLURM_NTASKS" in os.environ and SLURMEnvironment.detect():
        ntasks = os.environ["SLURM_NTASKS"]
        if not ntasks.isdigit():
            raise ConfigError("SLURM_NTASKS", ntasks, "is not a number of tasks")
        if int(ntasks) > 1 and "SLURM_NTASKS_PER_NODE" not in os.environ:
            raise ConfigError("SLURM_NTASKS", ntasks, f"the job sets `--ntasks={ntasks}` without `--ntasks-per-node` "
                              f"(SLURM_NTASKS_PER_NODE), which Lightning needs: use `#SBATCH --ntasks-per-node=N` "
                              "with N = trainer.devices")


def check_world_matches_launcher(trainer: Any) -> None:
    """Under torchrun, `WORLD_SIZE` must equal `trainer.devices` x `trainer.num_nodes`: with fewer devices each
    process runs a fit of its own."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_torchelastic_launched()):
        return
    world = os.environ.get("WORLD_SIZE", "")
    wanted = trainer.num_devices * trainer.num_nodes  # not `trainer.world_size`: that reads WORLD_SIZE itself here
    if world.isdigit() and int(world) != wanted:
        per_node = os.environ.get("LOCAL_WORLD_SIZE", "?")
        raise ConfigError("trainer.devices", trainer.num_devices,
                          f"torchrun started {world} processes (WORLD_SIZE; {per_node} per node), but trainer.devices "
                          f"x trainer.num_nodes = {wanted}: set --trainer.devices {per_node} (or start "
                          "torchrun with as many processes as devices)")
