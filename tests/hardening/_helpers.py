"""Shared pieces of the hardening tests: the tiny fit config, CLI runners, checkpoint hashing, a loss recorder.

The recorder callback runs inside `lightning-ffpa fit` subprocesses (imported by path from this folder):
it appends one line per optimizer step (step, loss as exact hex float, batch fingerprint) and flushes, so a
process killed with SIGKILL leaves a complete record of every step it finished.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import yaml

from lightning_ffpa.validation import PreflightCLIMixin

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
PYTHON = sys.executable
MAX_STEPS, EVERY = 10, 3  # the tiny fit: 10 steps, 4 batches per epoch, a checkpoint every 3 steps


def tiny_config(ckpt_dir: Path, *, max_steps: int = 10, every_n_train_steps: int = 3, data: dict | None = None,
                callbacks: list[dict] | None = None, model: dict | None = None,
                save_last: bool | str = True) -> dict[str, Any]:
    """The tiny fp32 CPU fit used by every hardening test (4 batches per epoch, checkpoints every 3 steps)."""
    data_args = {"seq_length": 32, "num_samples": 8, "batch_size": 2, "seed": 0}
    data_args.update(data or {})
    model_args = {"preset": "tiny", "dtype": "float32", "warmup_steps": 2}
    model_args.update(model or {})
    return {
        "seed_everything": 0,
        "model": {"class_path": "lightning_ffpa.module.Gemma4LM", "init_args": model_args},
        "data": {"class_path": DATA_CLASS, "init_args": data_args},
        "trainer": {
            "accelerator": "cpu", "devices": 1, "max_steps": max_steps, "logger": False,
            "enable_progress_bar": False, "enable_model_summary": False, "num_sanity_val_steps": 0,
            "default_root_dir": str(ckpt_dir.parent),
            "callbacks": [
                {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                 "init_args": {"dirpath": str(ckpt_dir), "every_n_train_steps": every_n_train_steps,
                               "save_last": save_last, "save_top_k": -1}},
                *(callbacks or []),
            ],
        },
    }


def write_config(path: Path, config: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(config))
    return path


def recorder(log: Path, hang_at: int | None = None, signal_at: int | None = None) -> dict:
    """Config entry for `StepRecorder`."""
    return {"class_path": "_helpers.StepRecorder",
            "init_args": {"log": str(log), "hang_at": hang_at, "signal_at": signal_at}}


def subprocess_env() -> dict[str, str]:
    env = dict(os.environ)
    # one thread: identical float reductions in every process, so curves can be compared bitwise
    # keep an inherited PYTHONPATH: on the GPU machine it carries the FFPA stack and jsonargparse
    path = os.pathsep.join(filter(None, [str(REPO), str(HERE), os.environ.get("PYTHONPATH")]))
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONPATH=path, PYTHONWARNINGS="ignore")
    return env


def start_fit(config: Path, *extra: str, env: dict[str, str] | None = None, log: Path | None = None,
              new_session: bool = False) -> subprocess.Popen:
    """Start `lightning-ffpa fit --config config` in a new process (stdout/stderr into `log`).

    `python -m lightning_ffpa.cli`, so Lightning's launcher can re-run the same command for more devices. With
    `new_session`, the command and the ranks it launches form a process group of their own (`os.killpg`).
    """
    cmd = [PYTHON, "-m", "lightning_ffpa.cli", "fit", "--config", str(config), *extra]
    log = log or config.with_suffix(".out")
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=env or subprocess_env(), stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
                                start_new_session=new_session)
    proc.log_path = log
    return proc


def wait_ok(proc: subprocess.Popen, timeout: float = 120) -> None:
    rc = proc.wait(timeout=timeout)
    if rc != 0:
        raise AssertionError(f"fit exited with {rc}:\n{proc.log_path.read_text()[-4000:]}")


def wait_for_line(path: Path, word: str, proc: subprocess.Popen, timeout: float = 120) -> None:
    """Block until `path` has a line starting with `word` (or fail if the process ends first)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and any(line.startswith(word) for line in path.read_text().splitlines()):
            return
        if proc.poll() is not None:
            raise AssertionError(f"process ended ({proc.returncode}) before {word!r}:\n"
                                 f"{proc.log_path.read_text()[-4000:]}")
        time.sleep(0.05)
    raise TimeoutError(f"no {word!r} line in {path} after {timeout}s")


def kill9(proc: subprocess.Popen) -> int:
    os.kill(proc.pid, signal.SIGKILL)
    return proc.wait(timeout=30)


def read_steps(path: Path) -> dict[int, tuple[str, str]]:
    """{global_step: (loss hex, batch fingerprint)} from a recorder log."""
    steps = {}
    for line in path.read_text().splitlines():
        if line.startswith("step "):
            _, step, loss, fp = line.split()
            steps[int(step)] = (loss, fp)
    return steps


def tree_hash(root: Path) -> dict[str, str]:
    """sha256 of every file under `root` (relative path -> digest); symlinks hashed by target path."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        if p.is_symlink():
            out[rel] = "link:" + os.readlink(p)
        elif p.is_file():
            out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def _sigterm_seen(trainer) -> bool:
    """This rank got SIGTERM: recorded by the CLI's `StopOnSigterm`, or Lightning's flag without it."""
    from lightning_ffpa.callbacks.preemption import StopOnSigterm

    return trainer.received_sigterm or any(c.pending for c in trainer.callbacks if isinstance(c, StopOnSigterm))


class StepRecorder(pl.Callback):
    """Append `step <global_step> <loss.hex> <batch fingerprint>` per optimizer step; optionally hang mid-step."""

    def __init__(self, log: str, hang_at: int | None = None, signal_at: int | None = None) -> None:
        """
        Args:
            log: file to append to.
            hang_at: when the optimizer is about to take step `hang_at`, write `hang` and sleep (to be killed).
            signal_at: when the optimizer is about to take step `signal_at`, send this process SIGUSR1 (what
                SLURM's `--signal=USR1@T` does before preempting).
        """
        self.log_file, self.hang_at, self.signal_at = Path(log), hang_at, signal_at

    def _write(self, line: str) -> None:
        with open(self.log_file, "a") as f:
            f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if not trainer.is_global_zero:
            return
        if self.hang_at is not None and trainer.global_step + 1 == self.hang_at:
            self._write(f"hang {trainer.global_step + 1}")
            # Gradients computed, weights not yet updated: SIGKILL arrives here. SIGTERM ends the wait (the
            # handler only records it, and a plain sleep resumes after it); the step completes and fit stops.
            deadline = time.monotonic() + 600
            while time.monotonic() < deadline and not _sigterm_seen(trainer):
                time.sleep(0.05)
        if self.signal_at is not None and trainer.global_step + 1 == self.signal_at:
            self._write(f"signal {trainer.global_step + 1}")
            os.kill(os.getpid(), signal.SIGUSR1)  # mid-step, like a real preemption notice

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not trainer.is_global_zero:
            return  # rank 0's loss and batch stand for the step (the comparison is run against run)
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        fp = hashlib.sha1(batch["input_ids"].cpu().numpy().tobytes()).hexdigest()[:12]
        self._write(f"step {trainer.global_step} {float(loss.detach()).hex()} {fp}")


# The datamodule the tiny config uses: the shipped one (it resumes mid-epoch, see data/sampler.py).
DATA_CLASS = "lightning_ffpa.data.MockDataModule"


def run_cli(args: list[str]):
    """`lightning_ffpa.cli.build(args)` in-process, with `PreflightCLIMixin` added if cli.py lacks it."""
    from unittest import mock

    from lightning_ffpa import cli

    if cli_has_preflight():
        return cli.build(args)
    patched = type("FFPACLI", (PreflightCLIMixin, cli.FFPACLI), {})
    with mock.patch.object(cli, "FFPACLI", patched):
        return cli.build(args)


def cli_has_preflight() -> bool:
    """True once `FFPACLI` runs the pre-flight checks itself (the proposed one-line change to cli.py)."""
    from lightning_ffpa import cli

    return issubclass(cli.FFPACLI, PreflightCLIMixin)
