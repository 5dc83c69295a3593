"""Extending a finished run through the `lightning-ffpa` console script: steps 4-6 of a run stopped at
`max_steps=3` and resumed with `max_steps=6` train on the batches, and reach the losses, of a straight run.

The learning rate is held constant (no warmup, `min_lr_ratio=1`) because the cosine schedule spans
`max_steps`: a run planned for 3 steps has a different schedule than one planned for 6.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from data_steplog import read

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
SCRIPT = Path(sys.executable).with_name("lightning-ffpa")


def _config(root: Path, max_steps: int, every: int = 1000) -> Path:
    cfg = {
        "seed_everything": 0,
        "model": {"class_path": "lightning_ffpa.module.Gemma4LM",
                  "init_args": {"preset": "tiny", "dtype": "float32", "warmup_steps": 0, "min_lr_ratio": 1.0,
                                "learning_rate": 1e-2}},
        "data": {"class_path": "lightning_ffpa.data.MockDataModule",
                 "init_args": {"seq_length": 16, "num_samples": 40, "batch_size": 2, "seed": 0}},
        "trainer": {
            "accelerator": "cpu", "devices": 1, "max_steps": max_steps, "logger": False,
            "enable_progress_bar": False, "enable_model_summary": False, "num_sanity_val_steps": 0,
            "default_root_dir": str(root),
            "callbacks": [
                {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                 "init_args": {"dirpath": str(root / "ckpt"), "save_last": True, "every_n_train_steps": every}},
                {"class_path": "data_steplog.StepLog", "init_args": {"path": str(root / "steps.log")}},
            ],
        },
    }
    path = root / f"fit{max_steps}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _fit(root: Path, max_steps: int, *extra: str, every: int = 1000) -> str:
    root.mkdir(exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore::DeprecationWarning,ignore::FutureWarning",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), str(HERE), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([str(SCRIPT), "fit", "--config", str(_config(root, max_steps, every)), *extra],
                          env=env, cwd=root, capture_output=True, text=True, timeout=240)
    lines = proc.stderr.strip().splitlines()
    # `main()` returning the CLI object makes the console script print it and exit 1; an exit code is 0
    object_exit = proc.returncode == 1 and lines and re.fullmatch(r"<lightning_ffpa\.cli\.\w+ object at \w+>",
                                                                    lines[-1])
    assert proc.returncode == 0 or object_exit, proc.stderr[-4000:]
    return proc.stdout + proc.stderr


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.skipif(not SCRIPT.exists(), reason="the lightning-ffpa console script is not installed")
@pytest.mark.parametrize("every", [1000, 2])
def test_extended_run_repeats_the_straight_runs_batches_and_losses(tmp_path, every):
    """every=2: a periodic save at step 2 and the stop at 3, which `FinalCheckpoint` saves (Lightning kept step 2)."""
    _fit(tmp_path / "a", 6, every=every)
    _fit(tmp_path / "b", 3, every=every)
    resumed = _fit(tmp_path / "b", 6, "--ckpt_path", "last", every=every)
    # a constant learning rate here, but the horizon changed: a cosine would jump at the resume, and says so
    assert "the learning-rate schedule of the checkpoint's run spanned 3 steps and this run's spans 6" in resumed
    straight, extended = read(tmp_path / "a" / "steps.log"), read(tmp_path / "b" / "steps.log")
    assert [s for s, *_ in straight] == [s for s, *_ in extended] == [1, 2, 3, 4, 5, 6]
    assert extended == straight  # same epoch, same batch digests, bitwise equal losses


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.skipif(not SCRIPT.exists(), reason="the lightning-ffpa console script is not installed")
def test_epoch_end_resume_at_a_smaller_batch_size_trains_the_next_epoch_whole(tmp_path):
    """A run stopped by `max_steps` at epoch 0's end (10 batches of 4), resumed at batch size 2, started epoch 1 at
    batch 10 of 20 and trained only its second half: Lightning kept the saved batch count against the new length."""
    _fit(tmp_path / "ref", 40, "--data.init_args.batch_size", "2")
    _fit(tmp_path / "b", 10, "--data.init_args.batch_size", "4")
    resumed = _fit(tmp_path / "b", 30, "--data.init_args.batch_size", "2", "--ckpt_path", "last")
    straight, extended = read(tmp_path / "ref" / "steps.log"), read(tmp_path / "b" / "steps.log")
    # epoch 1 whole, in its order: the weights differ (another batch size before), the batches do not
    assert [(e, d) for _, e, _, d in extended[10:]] == [(e, d) for _, e, _, d in straight[20:]]
    assert "Resuming at the start of epoch 1: the checkpointed run had trained all of epoch 0" in resumed
