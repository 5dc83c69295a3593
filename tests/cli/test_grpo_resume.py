"""GRPO resume through the `lightning-ffpa` console script (configs/tiny_grpo.yaml, CPU, fp32): a run stopped at
step 3 and resumed to step 6, by `--ckpt_path last` and by the path of an uninterrupted run's step-3 checkpoint,
repeats the uninterrupted run bit for bit: every step's logged loss, reward and sampler gap, and the final
weights and optimizer state. 8 prompts in batches of 2: the 6 steps cross an epoch, the stop is mid-epoch. Ids
0-39 end a completion, so batches shrink mid-decode (a full fine-tune with fused projections: a resume once left
their sampler gaps apart).
"""

from __future__ import annotations

import csv
import re
from pathlib import Path

import pytest
import torch
import yaml
from _console import ROOT, run

STEPS, STOP = 6, 3
EOS = "[" + ",".join(map(str, range(40))) + "]"  # ~8% of the 512 ids: about a third of the completions stop early
SMALL = ["--trainer.callbacks.init_args.num_generations", "4", "--data.init_args.num_random_prompts", "8",
         "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
         "--trainer.logger", "lightning.pytorch.loggers.CSVLogger", "--trainer.logger.save_dir", "logs",
         "--trainer.callbacks.init_args.eos_token_ids", EOS]
LOGGED = ("train/loss", "rollout/reward", "rollout/completion_length", "train/sampler_logprob_gap")


def _config(tmp_path: Path) -> Path:
    """tiny_grpo.yaml saving every STOP steps (`--trainer.callbacks.init_args.*` reaches the last callback only)."""
    cfg = yaml.safe_load((ROOT / "configs" / "tiny_grpo.yaml").read_text())
    (save,) = [c for c in cfg["trainer"]["callbacks"] if c["class_path"].endswith(".ModelCheckpoint")]
    save["init_args"]["every_n_train_steps"] = STOP
    path = tmp_path / "grpo.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _fit(folder: Path, max_steps: int, *extra: str) -> str:
    folder.mkdir(exist_ok=True)
    proc = run(["lightning-ffpa", "fit", "--config", str(_config(folder.parent)), "--trainer.max_steps", str(max_steps),
                "--trainer.default_root_dir", "run", *SMALL, *extra], folder, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout.strip().splitlines()[-1]


def _curve(folder: Path) -> dict[int, tuple[str, ...]]:
    """step -> the logged values as written (exact decimal floats); a resumed run's versions override."""
    curve = {}
    for path in sorted((folder / "logs").rglob("metrics.csv"), key=lambda p: int(p.parent.name.split("_")[-1])):
        for row in csv.DictReader(path.open()):
            if row.get("train/loss"):
                curve[int(row["step"])] = tuple(row[k] for k in LOGGED)
    return curve


def _state(ckpt: Path) -> tuple[int, list[tuple[str, torch.Tensor]]]:
    saved = torch.load(ckpt, map_location="cpu", weights_only=False)
    moments = [(f"opt.{i}.{k}", v) for i, s in saved["optimizer_states"][0]["state"].items()
               for k, v in s.items() if torch.is_tensor(v)]
    return saved["global_step"], [*saved["state_dict"].items(), *moments]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_resumed_grpo_repeats_the_uninterrupted_run_bitwise(tmp_path):
    straight, stopped, from_path = tmp_path / "straight", tmp_path / "stopped", tmp_path / "from_path"
    _fit(straight, STEPS)
    assert _fit(stopped, STOP).startswith(f"fit finished at step {STOP}; checkpoint ")
    assert _fit(stopped, STEPS, "--ckpt_path", "last").startswith(f"fit finished at step {STEPS}; checkpoint ")
    mid_run = next((straight / "run" / "checkpoints").glob(f"*step={STOP}.ckpt"))  # written mid-run
    last = _fit(from_path, STEPS, "--ckpt_path", str(mid_run))
    assert re.match(rf"fit finished at step {STEPS}; checkpoint ", last), last

    reference = _curve(straight)
    assert sorted(reference) == list(range(STEPS))
    max_new = yaml.safe_load((ROOT / "configs" / "tiny_grpo.yaml").read_text())["trainer"]["callbacks"][-1][
        "init_args"]["sampling"]["max_new_tokens"]
    assert min(float(v[2]) for v in reference.values()) < max_new  # EOS stopped completions early
    resumed = {s: v for s, v in reference.items() if s >= STOP}  # from_path logs the resumed steps only
    for folder, expected_curve in ((stopped, reference), (from_path, resumed)):
        curve = _curve(folder)
        assert curve == expected_curve, {s: (v, curve.get(s)) for s, v in expected_curve.items() if curve.get(s) != v}

    step, expected = _state(straight / "run" / "checkpoints" / "last.ckpt")
    assert step == STEPS
    for folder in (stopped, from_path):
        step, got = _state(folder / "run" / "checkpoints" / "last.ckpt")
        assert step == STEPS and [k for k, _ in got] == [k for k, _ in expected]
        assert all(torch.equal(a, b) for (_, a), (_, b) in zip(got, expected)), folder.name
