"""CPU smoke of benchmarks/grpo_full_depth.py: the recipe fit through the console script, its steps read back
from the CSV logger, the first step left out of the medians, and the decode roofline's byte count."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # `benchmarks` is a folder of scripts
from benchmarks import grpo_full_depth  # noqa: E402


@pytest.mark.timeout(240)
def test_tiny_recipe_row_reads_every_step_and_times_all_but_the_first(tmp_path):
    out = tmp_path / "r.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "grpo_full_depth.py"), "--recipe", "tiny_grpo", "--preset",
           "tiny", "--lengths", "6", "--steps", "3", "--prompt-len", "4", "--page-size", "8", "--logs",
           str(tmp_path), "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=220, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    record = json.loads(out.read_text())
    (row,) = record["rows"]
    assert row["exit_code"] == 0 and "--trainer.callbacks.init_args.sampling.max_new_tokens 6" in row["command"]
    assert [s["step"] for s in row["steps"]] == [0, 1, 2]
    for step in row["steps"]:
        assert step["rollout/generate_s"] > 0 and step["rollout/update_s"] > 0
        assert step["rollout/decode_steps"] >= 5  # 6 new tokens: the prefill samples the first
    assert row["step_s"]["n"] == 2  # the first step (capture, compile) is not timed
    parts = [s["rollout/refresh_s"] + s["rollout/generate_s"] + s["rollout/update_s"] for s in row["steps"][1:]]
    assert row["step_s"]["median"] == pytest.approx(sum(parts) / 2)
    assert row["completion_tokens_per_s"] > 0 and record["summary"]["grpo_full_depth_fits_6"] is True
    first = (tmp_path / "grpo_full_depth_6.log").read_text().splitlines()[0]  # the log opens with the command
    assert first.split()[0].endswith("lightning-ffpa") and "fit --config" in first


def test_decode_bytes_count_each_weight_once_and_sliding_kv_only_within_the_window():
    short = grpo_full_depth.decode_bytes(4, 8, 1, "tiny", None, 4)
    longer = grpo_full_depth.decode_bytes(4, 400, 1, "tiny", None, 4)
    two_rows = grpo_full_depth.decode_bytes(4, 400, 2, "tiny", None, 4)
    assert short < longer < two_rows  # full layers read every position; more rows read more K/V
    weights = two_rows - 2 * (two_rows - longer)  # what does not scale with the rows
    assert weights == pytest.approx(grpo_full_depth.decode_bytes(4, 400, 0, "tiny", None, 4))


def test_routed_decode_bytes_count_the_routed_share_of_the_experts():
    """tiny-moe: 4 layers x 4 experts x (gate_up 64x64 + down 64x32) bf16; a routed half drops half of them."""
    experts = 4 * 4 * (64 * 64 + 64 * 32) * 2
    full = grpo_full_depth.decode_bytes(4, 8, 2, "tiny-moe", None, 4)
    assert grpo_full_depth.decode_bytes(4, 8, 2, "tiny-moe", None, 4, 1.0) == pytest.approx(full)
    assert grpo_full_depth.decode_bytes(4, 8, 2, "tiny-moe", None, 4, 0.5) == pytest.approx(full - experts / 2)
    args = grpo_full_depth.parse_args(["--preset", "tiny-moe", "--lengths", "8", "--prompt-len", "4",
                                       "--prompts", "1", "--group", "2", "--lora-r", "4", "--count-routed"])
    steps = [{"rollout/refresh_s": 0.1, "rollout/generate_s": 1.0, "rollout/update_s": 0.1,
              "rollout/decode_steps": 7.0, "rollout/routed_expert_fraction": f} for f in (1.0, 0.5, 0.5, 0.25)]
    row = {"completion_len": 8, "exit_code": 0, "steps": steps}
    out = grpo_full_depth.summarize([row], {"datasheet_bytes_per_s": 1e12, "copy_bytes_per_s": 1e12}, args)
    assert row["routed_expert_fraction"] == 0.5  # the median of the timed steps (the first is not timed)
    assert row["decode_bytes_per_step_routed"] == pytest.approx(full - experts / 2)
    assert out["grpo_full_depth_decode_routed_roofline_datasheet_bs2_8"] == pytest.approx(
        (full - experts / 2) / (1.0 / 7) / 1e12)
    assert row["decode_roofline_datasheet"] == pytest.approx(full / (1.0 / 7) / 1e12)  # all weights, beside


def test_a_gpu_run_times_at_least_three_steps_per_row(monkeypatch):
    """The first step captures and compiles: a GPU run needs --steps >= 4 for three timed samples (one line
    naming the option, before any row runs); on CPU the smoke run may time fewer."""
    import torch

    from lightning_ffpa.errors import ConfigError

    assert grpo_full_depth.parse_args(["--steps", "3"]).steps == 3  # CPU: no timing claims
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ConfigError, match="--steps"):
        grpo_full_depth.parse_args(["--steps", "3"])
    assert grpo_full_depth.parse_args(["--steps", "4"]).steps == 4
    assert grpo_full_depth.parse_args([]).steps >= 4  # the default times enough
