"""GRPO with LoRA and `model.save_frozen_weights: false` through the CLI in-process (configs/tiny_grpo.yaml, CPU,
fp32): the checkpoints hold the adapters, and a run stopped at step 2 and resumed to 4 ends with the adapters and
optimizer state of the uninterrupted 4-step run, bit for bit (the base is rebuilt from the preset under the
config's seed, and its digest checked); another seed is refused by the pre-flight, before any model is built, with
one line naming `ckpt_path`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_ffpa.checkpoint.frozen import FROZEN_BASE_KEY
from lightning_ffpa.cli import main

ROOT = Path(__file__).resolve().parents[2]
ARGS = ["--model.init_args.lora", "{r: 4, lora_alpha: 8, target_modules: [q_proj, v_proj, down_proj]}",
        "--model.init_args.save_frozen_weights", "false", "--model.init_args.config_overrides", "{num_hidden_layers: 2}",
        "--trainer.callbacks.init_args.num_generations", "4", "--data.init_args.num_random_prompts", "8",
        "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false", "--trainer.logger", "false"]


def _fit(root: Path, steps: int, *extra: str) -> int:
    return main(["fit", "--config", str(ROOT / "configs" / "tiny_grpo.yaml"), *ARGS, "--trainer.max_steps", str(steps),
                 "--trainer.default_root_dir", str(root), *extra])


def _state(ckpt: Path) -> tuple[int, dict, dict[str, torch.Tensor]]:
    saved = torch.load(ckpt, map_location="cpu", weights_only=True)
    moments = {f"opt.{i}.{k}": v for i, s in saved["optimizer_states"][0]["state"].items()
               for k, v in s.items() if torch.is_tensor(v)}
    return saved["global_step"], saved[FROZEN_BASE_KEY], {**saved["state_dict"], **moments}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_adapter_only_grpo_resume_repeats_the_uninterrupted_run(tmp_path, capsys):
    assert _fit(tmp_path / "straight", 4) == 0
    assert _fit(tmp_path / "cut", 2) == 0
    step, base, cut = _state(tmp_path / "cut" / "checkpoints" / "last.ckpt")
    assert step == 2 and base and not any(".base_layer." in k or k.endswith("embed_tokens.weight") for k in cut)
    assert all(".lora_" in k or k.endswith(".layer_scalar") or k.startswith("opt.") for k in cut), sorted(cut)

    capsys.readouterr()
    assert _fit(tmp_path / "cut", 4, "--ckpt_path", "last", "--seed_everything", "1") == 2  # another seed's base
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: `ckpt_path=") and "`model.save_frozen_weights=false`" in err, err
    assert "base was drawn under `seed_everything=0`, this run's under 1" in err, err  # the pre-flight: no model built
    assert "\n" not in err

    assert _fit(tmp_path / "cut", 4, "--ckpt_path", "last") == 0
    step, base_after, got = _state(tmp_path / "cut" / "checkpoints" / "last.ckpt")
    _, base_straight, want = _state(tmp_path / "straight" / "checkpoints" / "last.ckpt")
    assert step == 4 and base_after == base_straight == base and got.keys() == want.keys()
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=0, msg=key)
