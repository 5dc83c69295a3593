"""Shared test fixtures: the gpu marker gate, and launch and seed variables restored after every test."""

import os

import pytest
import torch

# Set by Lightning's launcher in the process that fits (here: pytest itself, for in-process fits). Left behind,
# LOCAL_RANK makes a later multi-rank fit started from this process believe its ranks were started outside
# (`creates_processes_externally`): it spawns no other rank and waits for them forever.
# PL_GLOBAL_SEED (seed_everything) is re-applied by a later fit's set-up, reseeding a test that seeded itself.
_LAUNCH_VARS = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "WORLD_SIZE", "GROUP_RANK", "RANK",
                "PL_GLOBAL_SEED", "PL_SEED_WORKERS")


@pytest.fixture(autouse=True)
def _launch_vars_do_not_leak():
    before = {k: os.environ.get(k) for k in _LAUNCH_VARS}
    yield
    for key, value in before.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run with -m gpu on the device)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
