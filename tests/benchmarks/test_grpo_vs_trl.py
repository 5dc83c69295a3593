"""CPU smoke of benchmarks/grpo_vs_trl.py: both rows in their own processes, per-step phases that add up, and
the TRL row either measured (trl installed) or carrying its ImportError."""

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # `benchmarks` is a folder of scripts
from benchmarks import grpo_vs_trl  # noqa: E402


@pytest.mark.timeout(120)
def test_smoke_rows_phases_and_trl_row(tmp_path):
    out = tmp_path / "grpo.json"
    grpo_vs_trl.main(["--smoke", "--rows", "ours_grpo,trl_grpo", "--out", str(out)])
    record = json.loads(out.read_text())
    rows = {r["name"]: r for r in record["rows"]}
    assert list(rows) == ["ours_grpo", "trl_grpo"]
    pids = {r["process"]["pid"] for r in rows.values()}
    assert len(pids) == 2 and os.getpid() not in pids
    assert {r["process"]["parent_pid"] for r in rows.values()} == {os.getpid()}
    ours = rows["ours_grpo"]
    assert "error" not in ours, ours
    assert len(ours["per_step"]) == 3 and ours["timed_steps"] == 2  # 3 steps, 1 warm-up
    for step in ours["per_step"]:
        assert step["completion_tokens"] == 2 * 2 * 6  # prompts x group x completion length, no EOS
        parts = step["refresh_s"] + step["generation_s"] + step["scoring_s"] + step["update_s"]
        assert parts == pytest.approx(step["wall_s"]) and min(step["generation_s"], step["update_s"]) > 0
    assert ours["step_s_min"] <= ours["step_s_median"] <= ours["step_s_max"]
    assert ours["completion_tokens_per_s"] > 0 and ours["engine"]["attention_path"] == "dense_reference"
    gaps = ours["sampler_logprob_gap_per_step"]  # fp32 CPU: the engine's logprobs are the policy's
    assert len(gaps) == 3 and max(gaps) < 1e-4 and ours["sampler_logprob_gap_median"] == sorted(gaps)[1]
    assert (ours["old_logprobs"], ours["sampler_is_cap"]) == ("policy", 3.0)  # TRL's on-policy ratio
    trl = rows["trl_grpo"]
    summary = record["summary"]
    if importlib.util.find_spec("trl") is None:
        assert trl["error"].startswith("ImportError") and "trl_grpo_error" in summary
        assert "ours_vs_trl_step_speedup" not in summary
    else:
        assert "error" not in trl and trl["completion_tokens_per_step"] == 24
        assert summary["ours_vs_trl_step_speedup"] > 0 and "ours_vs_trl_generation_speedup" in summary
        assert summary["trl_baseline"].startswith("trl_grpo,")
    assert "2 of 60 layers" in summary["model_slice"] and "partial" not in summary


def test_ratio_divides_by_the_fastest_trl_row():
    def row(name, step, tps):
        return {"name": name, "step_s_median": step, "completion_tokens_per_s": tps, "process": {"pid": 1},
                "phases_s_median": {"refresh_s": 0.0, "generation_s": step / 2, "scoring_s": 0.1, "update_s": 0.4}}

    rows = [row("ours_grpo", 1.0, 100.0), row("trl_grpo", 8.0, 12.5), row("trl_grpo_static_cache", 6.0, 16.0),
            {"name": "trl_grpo_continuous_batching", "error": "ValueError: heterogeneous heads"}]
    s = grpo_vs_trl.summarize(rows)
    assert s["ours_vs_trl_step_speedup"] == 6.0 and s["trl_baseline"].startswith("trl_grpo_static_cache,")
    assert s["ours_vs_trl_grpo_step_speedup"] == 8.0 and "ours_vs_trl_grpo_continuous_batching_step_speedup" not in s
    assert s["trl_grpo_continuous_batching_error"].startswith("ValueError")


def test_unknown_row_is_refused_naming_the_option():
    with pytest.raises(SystemExit):
        grpo_vs_trl.parse_args(["--rows", "ours_grpo,trl_vllm"])


def test_a_continuous_batching_failure_names_what_hf_logged():
    import logging

    from benchmarks.rollout_hf import CBErrors

    with CBErrors() as errors:
        try:
            raise RuntimeError("index_copy_(): Source/destination tensor must have same slice shapes")
        except RuntimeError:
            logging.getLogger("ContinuousBatchingLogger").exception("Error in generation loop")
        logging.getLogger("ContinuousBatchingLogger").error("a later failure without an exception")
    assert errors.first == "RuntimeError: index_copy_(): Source/destination tensor must have same slice shapes"
    assert errors not in logging.getLogger("ContinuousBatchingLogger").handlers
