"""CPU smoke of benchmarks/grpo_vs_trl.py: both rows in their own processes, per-step phases that add up, the
per-row wall budget, the TRL row either measured (trl installed) or carrying its ImportError; the summary's
ratios and full-depth key, the budget rule and the reward spread in-process."""

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # `benchmarks` is a folder of scripts
from benchmarks import grpo_vs_trl  # noqa: E402


@pytest.mark.timeout(120)
def test_smoke_rows_phases_budget_and_trl_row(tmp_path, capsys):
    # A 1 s wall budget per row: each row stops after its first step (the next would end past it) and says so;
    # both rows split their update into micro-batches (ours: one 10-token sequence each; TRL: 2 sequences).
    out = tmp_path / "grpo.json"
    grpo_vs_trl.main(["--smoke", "--rows", "ours_grpo,trl_grpo", "--warmup", "0", "--row-wall-s", "1",
                      "--max-tokens-per-microbatch", "10", "--trl-micro-batch", "2", "--out", str(out)])
    assert "estimate: a TRL step" in capsys.readouterr().out
    record = json.loads(out.read_text())
    rows = {r["name"]: r for r in record["rows"]}
    assert list(rows) == ["ours_grpo", "trl_grpo"]
    pids = {r["process"]["pid"] for r in rows.values()}
    assert len(pids) == 2 and os.getpid() not in pids
    assert {r["process"]["parent_pid"] for r in rows.values()} == {os.getpid()}
    ours = rows["ours_grpo"]
    assert "error" not in ours, ours
    for r in [ours] + ([rows["trl_grpo"]] if "error" not in rows["trl_grpo"] else []):
        assert (r["steps_finished"], r["timed_steps"], r["wall_budget_stop"], r["min_steps_met"]) == (1, 1, True, False)
        assert "1 of 3 steps" in r["wall_budget_note"] and r["reward"]["groups"] == 2 and r["reward"]["calls"] == 1
    step = ours["per_step"][0]
    assert step["completion_tokens"] == 2 * 2 * 6  # prompts x group x completion length, no EOS
    parts = step["refresh_s"] + step["generation_s"] + step["scoring_s"] + step["update_s"]
    assert parts == pytest.approx(step["wall_s"]) and min(step["generation_s"], step["update_s"]) > 0
    assert ours["step_s_min"] <= ours["step_s_median"] <= ours["step_s_max"]
    assert ours["completion_tokens_per_s"] > 0 and ours["engine"]["attention_path"] == "dense_reference"
    gaps = ours["sampler_logprob_gap_per_step"]  # fp32 CPU: the engine's logprobs are the policy's
    assert len(gaps) == 1 and max(gaps) < 1e-4
    assert (ours["old_logprobs"], ours["sampler_is_cap"]) == ("policy", 3.0)  # TRL's on-policy ratio
    assert (ours["loss_type"], ours["scale_rewards"], ours["max_tokens_per_microbatch"]) == ("dapo", "group", 10)
    trl = rows["trl_grpo"]
    summary = record["summary"]
    assert summary["ours_grpo_short_of_min_steps"].startswith("1 timed of 5")
    if importlib.util.find_spec("trl") is None:
        assert trl["error"].startswith("ImportError") and "trl_grpo_error" in summary
        assert "ours_vs_trl_step_speedup" not in summary
    else:
        assert "error" not in trl and trl["completion_tokens_per_step"] == 24
        assert trl["trl_version"] == "1.16.0" and trl["label"] == grpo_vs_trl.TRL_LABEL
        assert (trl["loss_type"], trl["scale_rewards"], trl["num_iterations"], trl["beta"]) == ("dapo", "group", 1, 0.0)
        assert (trl["per_device_train_batch_size"], trl["gradient_accumulation_steps"]) == (2, 2)
        assert summary["ours_vs_trl_step_speedup"] > 0 and "ours_vs_trl_generation_speedup" in summary
        assert summary["trl_baseline"].startswith("trl_grpo,")
    assert "2 of 4 layers" in summary["model_slice"] and "partial" not in summary
    assert "grpo_full_depth_ours_vs_trl_step" not in summary  # 2 of the preset's 4 layers: not full depth


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


def _row(name, step, layers=60, timed=5, peak=70.0):
    return {"name": name, "step_s_median": step, "completion_tokens_per_s": 100.0 / step, "process": {"pid": 1},
            "layers": layers, "full_layers": 60, "min_steps": 5, "timed_steps": timed, "min_steps_met": timed >= 5,
            "peak_mem_gb": peak, "peak_reserved_gb": peak + 2,
            "phases_s_median": {"refresh_s": 0.0, "generation_s": step / 2, "scoring_s": 0.1, "update_s": 0.4}}


def test_full_depth_key_needs_every_layer_and_min_steps_in_both_rows():
    s = grpo_vs_trl.summarize([_row("ours_grpo", 10.0, peak=60.0), _row("trl_grpo", 60.0)])
    assert s["grpo_full_depth_ours_vs_trl_step"] == 6.0 and s["ours_vs_trl_peak_mem"] == 60.0 / 70.0
    assert s["ours_grpo_peak_reserved_gib"] == 62.0 and s["trl_generation"] == grpo_vs_trl.TRL_LABEL
    short = grpo_vs_trl.summarize([_row("ours_grpo", 10.0), _row("trl_grpo", 300.0, timed=1)])
    assert "grpo_full_depth_ours_vs_trl_step" not in short and short["ours_vs_trl_step_speedup"] == 30.0
    assert "trl_grpo 1" in short["grpo_full_depth_ours_vs_trl_step_missing"]
    assert short["trl_grpo_short_of_min_steps"].startswith("1 timed of 5")
    cut = grpo_vs_trl.summarize([_row("ours_grpo", 1.0, layers=12), _row("trl_grpo", 6.0, layers=12)])
    assert "grpo_full_depth_ours_vs_trl_step" not in cut and "grpo_full_depth_ours_vs_trl_step_missing" not in cut


def test_wall_budget_stops_when_one_more_step_would_end_past_it():
    import time

    from benchmarks.grpo_budget import StepClock

    clock = StepClock("cpu", deadline=time.perf_counter() + 5.0)
    assert not clock.out_of_time()  # no step yet: nothing to go by
    clock.steps.append({"wall_s": 1.0})
    assert not clock.out_of_time()
    clock.steps.append({"wall_s": 6.0})
    assert clock.out_of_time()
    assert not StepClock("cpu").out_of_time()


def test_reward_varies_within_groups_and_its_spread_is_counted():
    from benchmarks.grpo_budget import lower_half_vocab_reward, reward_spread

    log = []
    fn = lower_half_vocab_reward(100, log)
    assert fn(prompts=[0] * 4, completions=[""] * 4, completion_ids=[[1, 2], [60, 70], [1, 99], [3, 4]]) == \
        [1.0, 0.0, 0.5, 1.0]
    spread = reward_spread(log, group=2)
    assert spread["groups"] == 2 and spread["zero_std_groups"] == 0 and spread["calls"] == 1
    assert reward_spread([[0.5, 0.5, 1.0, 0.0]], group=2)["zero_std_groups"] == 1


def test_trl_call_estimate_at_full_depth():
    from benchmarks.grpo_budget import trl_call_estimate

    est = {n: trl_call_estimate(60, 1, 16, 512, n, warmup=1, row_wall_s=540) for n in (512, 2048, 4096)}
    assert est[512]["timed_steps_in_row"] >= 5 and est[2048]["steps_in_row"] == 1 and est[4096]["steps_in_row"] == 0


def test_bad_options_are_refused_naming_the_option(tmp_path, capsys):
    for argv, option in ((["--trl-micro-batch", "3"], "--trl-micro-batch"), (["--group", "1"], "--group"),
                         (["--row-wall-s", "600"], "--row-wall-s"), (["--loss-type", "ppo"], "--loss-type")):
        with pytest.raises(SystemExit):
            grpo_vs_trl.parse_args(argv)
        assert option in capsys.readouterr().err
    earlier = tmp_path / "earlier.json"
    earlier.write_text(json.dumps({"rows": [{"name": "trl_grpo", "layers": 12, **{k: None for k in
                                                                                   grpo_vs_trl.SAME_RECIPE[1:]}}]}))
    with pytest.raises(SystemExit, match="--resume"):
        grpo_vs_trl.main(["--smoke", "--rows", "ours_grpo", "--resume", str(earlier), "--out", str(tmp_path / "o")])
