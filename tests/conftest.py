"""Shared test fixtures: a saved tiny checkpoint (`pretrained`), the gpu marker gate, launch and seed variables
and the SIGINT handler restored after every test, and the environment of a one-process gloo fit (`one_process`)."""

import os
import signal
import socket

import pytest
import torch
import torch.distributed as dist
from transformers import Gemma4ForCausalLM

from lightning_ffpa.presets import build_text_config

# Set by Lightning's launcher in the process that fits (here: pytest itself, for in-process fits). Left behind,
# LOCAL_RANK makes a later multi-rank fit started from this process believe its ranks were started outside
# (`creates_processes_externally`): it spawns no other rank and waits for them forever.
# PL_GLOBAL_SEED (seed_everything) is re-applied by a later fit's set-up, reseeding a test that seeded itself.
_LAUNCH_VARS = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "WORLD_SIZE", "GROUP_RANK", "RANK",
                "PL_GLOBAL_SEED", "PL_SEED_WORKERS")


if os.environ.get("PYTEST_XDIST_WORKER"):  # `make test` runs two workers on two cores: one thread each
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # and so do the processes a test starts


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """A random tiny Gemma4 saved with `save_pretrained` (seed 0): every fit of a test module starts from the
    same weights. A module needing other shapes defines its own `pretrained`."""
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny") / "tiny"
    Gemma4ForCausalLM(build_text_config("tiny")).save_pretrained(path)
    return path


@pytest.fixture(autouse=True)
def _sigint_does_not_leak():
    """Lightning sets SIGINT to SIG_IGN in the process that fits while it handles an interrupt or takes a process
    group down, and may leave it there. A process this one starts later inherits SIG_IGN and ignores Ctrl-C (the
    Ctrl-C console test then never ends). A module fixture's fit leaves it outside any test, so every test starts
    with Python's own handler, and one that changes it gets it back."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    before = signal.getsignal(signal.SIGINT)
    yield
    if signal.getsignal(signal.SIGINT) is not before:
        signal.signal(signal.SIGINT, before)


@pytest.fixture(autouse=True)
def _ffpa_sliding_choice_does_not_leak():
    """The "ffpa" backend's sliding kernel is process state (`register_ffpa(sliding=...)`): a test that sets it
    directly would hand its choice to every later test of the process."""
    from lightning_ffpa.attention import backend

    before = backend.config().sliding
    yield
    backend.config().sliding = before


@pytest.fixture(autouse=True)
def _launch_vars_do_not_leak():
    before = {k: os.environ.get(k) for k in _LAUNCH_VARS}
    yield
    for key, value in before.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture
def one_process(monkeypatch):
    """A free MASTER_PORT and MASTER_ADDR for an in-process fit (FSDP2 on a mesh of one, gloo); its process
    group is destroyed after the test."""
    with socket.socket() as sock:  # the port Lightning writes into os.environ is undone after the test
        sock.bind(("127.0.0.1", 0))
        monkeypatch.setenv("MASTER_PORT", str(sock.getsockname()[1]))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    yield
    if dist.is_initialized():  # the one-process group must not leak into later tests
        dist.destroy_process_group()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run with -m gpu on the device)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
