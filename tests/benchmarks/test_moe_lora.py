"""benchmarks/moe_lora.py on CPU: the four rows in their own processes (tiny-moe), the summary and its reasons."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(_ROOT))

from benchmarks import moe_lora  # noqa: E402
from lightning_ffpa.errors import ConfigError  # noqa: E402

_KEYS = {f"moe_{k}_{t}" for t in ("8k", "16k") for k in (
    "ours_vs_hf_same_recipe_tps", "ours_vs_hf_defaults_tps", "ours_vs_unsloth_lora_tps", "unmerged_vs_folded_expert_lora_tps", "mfu_active_spec",
    "full_depth_lora_peak_mem_gib", "save_mm_every_other_vs_high_k_tps", "save_mm_all_vs_high_k_tps",
    "gather_vs_scatter_routing_tps", "sliding_auto_vs_flex_tps", "full_depth_lora_fits")}
# ours_save_mm_every_other: its option and ours_save_mm_all's are checked without a run (SAC's rules have their own
# tests); ours_flex_sliding: its command is checked (CPU has no FA4 for `auto` to pick); unsloth_lora: no Unsloth on
# the CPU image
_SMOKE_ROWS = sorted(set(moe_lora.ROWS) - {"ours_save_mm_every_other", "ours_save_mm_all", "ours_flex_sliding",
                                          "unsloth_lora"})


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("moe") / "moe.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(_ROOT), os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(_ROOT / "benchmarks" / "moe_lora.py"), "--cpu", "--profile", "ours",
                           "--rows", *_SMOKE_ROWS, "--out", str(out)],
                          env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.slow  # five row processes, ~55 s on 2 cores
@pytest.mark.timeout(300)
def test_the_rows_run_in_their_own_processes_and_differ_where_their_labels_say(smoke_run):
    rows = {r["row"]: r for r in smoke_run["rows"]}
    assert set(rows) == set(_SMOKE_ROWS)
    assert not [(r.get("error"), r.get("log_tail")) for r in rows.values() if "error" in r]
    assert len({r["process"]["pid"] for r in rows.values()}) == len(_SMOKE_ROWS) and os.getpid() not in {
        r["process"]["pid"] for r in rows.values()}
    for r in rows.values():
        assert r["seq"] == 128 and r["timed_steps"] == 1
        assert r["step_ms_min"] <= r["step_ms_median"] <= r["step_ms_max"]
        assert r["tokens_per_s"] == pytest.approx(128 / r["step_ms_median"] * 1e3)
        assert r["mfu_active_spec"] is None and r["peak_mem_allocated_gb"] is None  # CPU: no peak, no number
        assert all(0 < v < 20 for v in r["losses"])
    ours, same, defaults = rows["ours"], rows["hf_same_recipe"], rows["hf_defaults"]
    # --profile ours: one extra step after the timed one, under the profiler, for that row only (CPU: no CUDA
    # kernels, the extra step's wall time); the timing and dispatch counts stay those of the timed step
    assert ours["profile"]["wall_ms"] > 0 and ours["profile"]["top_kernels"] == []
    assert same["profile"] is defaults["profile"] is False  # the spec's flag, no profile recorded
    assert len(ours["losses"]) == 3 and len(same["losses"]) == len(defaults["losses"]) == 2
    # ours: the shipped yaml through the CLI, its LoRA untouched (the expert stacks included), FFPA on the full layer
    assert ours["built_by"] == "lightning_ffpa.cli.build" and ours["cli_args"][:2] == ["--config", str(moe_lora.CONFIG)]
    assert "--model.init_args.lora" not in ours["cli_args"] and ours["lora"] == moe_lora.recipe_lora()
    assert moe_lora.recipe_lora()["target_parameters"] == ["experts.gate_up_proj", "experts.down_proj"]
    assert ours["global_step"] == 3 and ours["attn_implementation"] == "ffpa" and ours["dispatch"]["ffpa-dense"] == 1
    # ours_folded_experts: ours with peft's fold of the expert adapters, nothing else; the same math
    folded = rows["ours_folded_experts"]
    spec = dict(row="ours", seq=128, preset="tiny-moe", layers=2, dtype="float32", warmup=1, steps=1, cpu=True)
    option = ["--model.init_args.lora.expert_adapters", "folded"]
    assert moe_lora.cli_args({**spec, "row": "ours_folded_experts"}, Path("r")) == moe_lora.cli_args(spec, Path("r")) + option
    assert folded["cli_args"][-2:] == option and option[0] not in ours["cli_args"]
    assert folded["lora"] == {**ours["lora"], "expert_adapters": "folded"}
    assert set(ours["expert_lora_paths"]) == {"grouped_mm"} and folded["expert_lora_paths"] == {}
    assert folded["losses"][:2] == pytest.approx(ours["losses"][:2], rel=1e-4)
    # ours_save_mm_*: ours with only the SAC matmul rule changed; saving more changes no number of the math
    for name, rule in moe_lora.SAVE_MM_ROWS.items():
        option = ["--trainer.strategy.init_args.sac_save_mm", rule]
        assert moe_lora.cli_args({**spec, "row": name}, Path("r")) == moe_lora.cli_args(spec, Path("r")) + option
    assert moe_lora.strategy_init_args({**spec, "row": "ours_save_mm_all"}) == {
        **moe_lora.strategy_init_args(spec), "sac_save_mm": "all"}
    # ours_flex_sliding: the yaml's FFPAAttention with sliding: flex, every other word the same
    flex_words, ours_words = moe_lora.cli_args({**spec, "row": "ours_flex_sliding"}, Path("r")), moe_lora.cli_args(spec, Path("r"))
    at = ours_words.index("--trainer.callbacks") + 1
    flex_cbs, ours_cbs = json.loads(flex_words[at]), json.loads(ours_words[at])
    assert flex_words[:at] + flex_words[at + 1:] == ours_words[:at] + ours_words[at + 1:]
    assert [c["init_args"].get("sliding") for c in flex_cbs if c["class_path"].endswith("FFPAAttention")] == ["flex"]
    assert [c for c in flex_cbs if not c["class_path"].endswith("FFPAAttention")] == [
        c for c in ours_cbs if not c["class_path"].endswith("FFPAAttention")]
    # ours_scatter_routing: the same command; only the routing's backward differs (and says so), not the math
    scatter = rows["ours_scatter_routing"]
    assert moe_lora.cli_args({**spec, "row": "ours_scatter_routing"}, Path("r")) == moe_lora.cli_args(spec, Path("r"))
    assert scatter["strategy_settings"] == ours["strategy_settings"]
    assert (ours["routing_backward"], scatter["routing_backward"]) == ("gather", "index_put (autograd)")
    assert scatter["losses"][:2] == pytest.approx(ours["losses"][:2], rel=1e-5)
    # the HF rows: SDPA, the experts each label names, on every MoE layer (2)
    assert ours["experts_implementation"] == same["experts_implementation"] == {"grouped_mm": 2}
    assert defaults["experts_implementation"] == {"eager": 2}
    assert same["attn_implementation"] == defaults["attn_implementation"] == "sdpa"
    # the same adapters and base in every row; the FLOP counts agree
    for r in (same, defaults):
        assert r["static_memory"]["trainable_params"] == ours["static_memory"]["trainable_params"] > 0
        assert r["static_memory"]["frozen_params"] == ours["static_memory"]["frozen_params"]
        assert r["active_params"] == ours["active_params"] and r["flop_count"] == ours["flop_count"]
        assert r["lora_tflops_per_step"] == pytest.approx(ours["lora_tflops_per_step"])
    # same recipe: ours' FSDP2 settings as applied; defaults: full AC and no compile, the rest the same
    assert same["strategy_settings"] == ours["strategy_settings"]
    assert ours["strategy_settings"]["activation_checkpointing"] == "selective"
    differ = {k for k in ours["strategy_settings"] if defaults["strategy_settings"][k] != ours["strategy_settings"][k]}
    assert differ == {"activation_checkpointing"}  # compile is off in both on CPU (the smoke turns it off)
    assert defaults["strategy_settings"]["activation_checkpointing"] == "full"
    assert (same["loss"], defaults["loss"]) == ("chunked", "HF forward(labels)")
    # no 8k/16k row ran: every key null, with why
    assert set(smoke_run["summary"]) == _KEYS and all(v is None for v in smoke_run["summary"].values())
    assert "row ours at seq 8192 is not in this result" in smoke_run["summary_missing"]["moe_mfu_active_spec_8k"]


def test_summary_gives_ratios_mfu_memory_and_reasons():
    rows = [dict(row="ours", seq=8192, tokens_per_s=300.0, peak_mem_allocated_gb=90.0, mfu_active_spec=0.4),
            dict(row="hf_same_recipe", seq=8192, tokens_per_s=200.0, peak_mem_allocated_gb=100.0),
            dict(row="hf_defaults", seq=8192, error="CUDA out of memory"),
            dict(row="ours", seq=16384, tokens_per_s=250.0, peak_mem_allocated_gb=120.0, mfu_active_spec=0.38),
            dict(row="ours_save_mm_all", seq=8192, tokens_per_s=330.0)]
    summary, missing = moe_lora.summarize(rows)
    assert set(summary) == _KEYS and summary["moe_save_mm_all_vs_high_k_tps_8k"] == pytest.approx(1.1)
    assert "row ours_save_mm_every_other at seq 8192 is not in this result" in missing[
        "moe_save_mm_every_other_vs_high_k_tps_8k"]
    assert summary["moe_ours_vs_hf_same_recipe_tps_8k"] == 1.5 and summary["moe_mfu_active_spec_8k"] == 0.4
    assert summary["moe_full_depth_lora_peak_mem_gib_16k"] == 120.0 and summary["moe_mfu_active_spec_16k"] == 0.38
    assert summary["moe_full_depth_lora_fits_16k"] is True  # ours ran: the step fits
    assert summary["moe_ours_vs_hf_defaults_tps_8k"] is None
    assert "no measurement: CUDA out of memory" in missing["moe_ours_vs_hf_defaults_tps_8k"]
    assert "row hf_same_recipe at seq 16384 is not in this result" in missing["moe_ours_vs_hf_same_recipe_tps_16k"]
    assert set(missing) == {k for k, v in summary.items() if v is None}
    # auto against flex on the sliding layers: only when ours' dispatch shows FA4 ran
    flex = dict(row="ours_flex_sliding", seq=8192, tokens_per_s=250.0)
    summary, missing = moe_lora.summarize([*rows, flex])
    assert "auto found no FA4" in missing["moe_sliding_auto_vs_flex_tps_8k"]
    summary, _ = moe_lora.summarize([dict(rows[0], dispatch={"fa4-dense": 125, "flex": 0}), *rows[1:], flex])
    assert summary["moe_sliding_auto_vs_flex_tps_8k"] == pytest.approx(1.2)
    rows[0] = dict(rows[0], error="timeout")  # ours failed: every 8k key null, the reason named
    summary, missing = moe_lora.summarize(rows)
    assert all(summary[k] is None for k in _KEYS if k.endswith("_8k"))
    assert "row ours at seq 8192 has no measurement: timeout" in missing["moe_full_depth_lora_peak_mem_gib_8k"]
    rows[0] = dict(rows[0], error="torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB")
    summary, missing = moe_lora.summarize(rows)  # ran out of memory: does not fit, a recorded answer
    assert summary["moe_full_depth_lora_fits_8k"] is False and "moe_full_depth_lora_fits_8k" not in missing


def test_a_gpu_run_without_cuda_is_refused_with_one_line_naming_cpu():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU")
    with pytest.raises(ConfigError, match="--cpu"):
        moe_lora.main(["--out", "/nonexistent/x.json"])


def test_profile_names_only_rows_that_run():
    with pytest.raises(ConfigError, match="--profile"):
        moe_lora.parse_args(["--cpu", "--rows", "ours", "--profile", "hf_same_recipe"])
    assert moe_lora.parse_args(["--cpu", "--rows", "ours", "--profile", "ours"]).profile == ["ours"]


def test_hf_rows_take_ours_strategy_options_and_defaults_change_ac_and_compile(tmp_path):
    """The HF rows' FSDP2Strategy options are those ours' CLI parses from the yaml (with this run's overrides);
    hf_defaults sets full AC and no compile on top."""
    from lightning_ffpa.cli import build
    from lightning_ffpa.parallel import FSDP2Strategy

    spec = dict(row="hf_same_recipe", seq=64, preset="gemma4-26b-a4b", layers=2, dtype="bfloat16", warmup=2,
                steps=5, cpu=False)
    words = moe_lora.cli_args({**spec, "row": "ours"}, tmp_path) + ["--trainer.accelerator", "cpu"]
    ours = build(words, run=False).trainer.strategy
    same = FSDP2Strategy(**moe_lora.strategy_init_args(spec))
    defaults = FSDP2Strategy(**moe_lora.strategy_init_args({**spec, "row": "hf_defaults"}))
    names = ("activation_checkpointing", "sac_save_mm", "sac_extra_save_ops", "param_dtype", "reduce_dtype",
             "reshard_after_forward", "cpu_offload", "replicate_frozen", "activation_offload", "compile")
    assert all(getattr(same, n) == getattr(ours, n) for n in names)
    assert ours.compile and ours.activation_checkpointing == "selective"
    assert [n for n in names if getattr(defaults, n) != getattr(ours, n)] == ["activation_checkpointing", "compile"]
    assert defaults.activation_checkpointing == "full" and not defaults.compile


def test_the_unsloth_row_gets_the_recipes_lora_with_the_expert_stacks(monkeypatch):
    """The row hands Unsloth the yaml's LoRA, expert stacks included; in a process that imported transformers
    first (this one) it is refused untimed, naming why."""
    from benchmarks import unsloth_row

    spec = dict(row="unsloth_lora", seq=128, preset="tiny-moe", layers=2, dtype="float32", warmup=1, steps=1, cpu=True)
    row = moe_lora.measure(spec)
    assert "Unsloth must come first" in row["error"] and "transformers" in row["imported_before_unsloth"]
    seen = {}
    monkeypatch.setattr(unsloth_row, "measure_unsloth", lambda s: seen.update(s) or {})
    moe_lora.measure(spec)
    assert seen["lora"] == moe_lora.recipe_lora() and seen["smoke"] is True
    assert seen["lora"]["target_parameters"] == ["experts.gate_up_proj", "experts.down_proj"]
    assert sorted(seen["lora"]["target_modules"]) == sorted(unsloth_row.LINEAR)
