"""CPU smoke of benchmarks/unmerged_lora.py: the merged, shared and shared_fp8 rows each in its own process, the same
greedy tokens (fp32) for merged and shared, the float8 row's conversion and matmul path (dequantize on CPU), the
summary's keys, and what each row's engine weights were."""

import json
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # `benchmarks` is a folder of scripts
from benchmarks import unmerged_lora  # noqa: E402


@pytest.mark.timeout(180)
def _num_lora_targets(layers: int) -> int:
    """How many LoRA layers peft makes on the tiny preset at `layers` with the benchmark's targets (built on meta)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora import LoraLayer
    from transformers import Gemma4ForCausalLM

    from lightning_ffpa.presets import build_text_config

    with torch.device("meta"):
        model = Gemma4ForCausalLM(build_text_config("tiny", num_hidden_layers=layers))
    peft = get_peft_model(model, LoraConfig(r=4, target_modules=unmerged_lora.LORA_TARGETS))
    return sum(isinstance(m, LoraLayer) for m in peft.modules())


@pytest.mark.timeout(240)
def test_merged_shared_and_fp8_rows_in_own_processes(tmp_path):
    out = tmp_path / "unmerged_lora.json"
    unmerged_lora.main(["--preset", "tiny", "--device", "cpu", "--layers", "2", "--batch", "2", "--prompt-len", "8",
                        "--new-tokens", "6", "--page-size", "8", "--lora-r", "4", "--steps", "1", "--out", str(out)])
    record = json.loads(out.read_text())
    merged, shared, fp8 = record["rows"]
    assert (merged["name"], shared["name"], fp8["name"]) == unmerged_lora.MODES
    for r in (merged, shared, fp8):
        assert "error" not in r, r
        assert r["process"]["rc"] == 0 and r["process"]["pid"] != os.getpid() and r["decode_step_ms"] > 0
        assert r["weight_bytes_per_step"] == r["aliased_bytes"] + r["engine_own_bytes"]
    assert len({r["process"]["pid"] for r in (merged, shared, fp8)}) == 3
    # shared_fp8: the shared engine over float8 bases, read on the dequantize path (no FP8 tensor cores on CPU)
    assert fp8["weights"] == "shared" and fp8["mode_ran"] == "shared" and "base_dtype" not in shared
    assert fp8["fp8_conversion"]["converted"] == _num_lora_targets(2) > 0
    assert fp8["fp8_matmul_path"][0] == "dequantize"
    assert set(fp8["fp8_path_counts"]) == {"dequantize"} and fp8["fp8_path_counts"]["dequantize"] > 0
    assert fp8["fp8_path_counts"]["dequantize"] > fp8["fp8_path_counts_warmup"]["dequantize"]  # the timed runs too
    # the engine reads the float8 W0 and its scales (the conversion's bytes) where the fp32 row reads W0 at 4 bytes
    conversion = fp8["fp8_conversion"]
    assert shared["aliased_bytes"] - fp8["aliased_bytes"] == conversion["was_bytes"] - conversion["fp8_bytes"] > 0
    assert fp8["engine_own_bytes"] == shared["engine_own_bytes"]  # the same adapter buffers
    assert merged["weights_path"].startswith("merged copy: ") and merged["aliased_bytes"] == 0
    assert shared["weights_path"].startswith("shared: ") and shared["aliased_bytes"] > 0
    assert shared["engine_own_bytes"] < merged["engine_own_bytes"] // 5
    s = record["summary"]
    assert s["unmerged_lora_decode_overhead"] == pytest.approx(shared["decode_step_ms"] / merged["decode_step_ms"] - 1)
    assert s["greedy_token_agreement"] == 1.0 and "partial" not in s
    assert s["fp8_base_decode_vs_shared_bf16"] == pytest.approx(shared["decode_step_ms"] / fp8["decode_step_ms"])
    assert s["shared_fp8_decode_step_ms"] == fp8["decode_step_ms"] and "shared_fp8_peak_mem_gib" in s
    assert 0.0 <= s["fp8_greedy_token_agreement"] <= 1.0 and "why_none" not in s and "missing" not in s


def _row(name: str, ms: float, tokens: list[int], **kw) -> dict:
    return {"name": name, "weights": name.removesuffix("_fp8"), "decode_step_ms": ms, "outputs_head": [tokens],
            "aliased_bytes": 100, "weights_path": "shared: ...", "weight_bytes_per_step": 120, **kw}


def test_summary_float8_base_against_shared_on_synthetic_rows():
    rows = [_row("merged", 8.0, [1, 2, 3, 4]), _row("shared", 9.0, [1, 2, 3, 4]),
            _row("shared_fp8", 6.0, [1, 2, 5, 6], weight_bytes_per_step=60, fp8_path_counts={"scaled_mm": 48})]
    s = unmerged_lora.summarize(rows)
    assert s["unmerged_lora_decode_overhead"] == pytest.approx(9.0 / 8.0 - 1) and s["greedy_token_agreement"] == 1.0
    assert s["fp8_base_decode_vs_shared_bf16"] == pytest.approx(1.5)  # above 1: the float8 base decodes faster
    assert s["shared_fp8_decode_step_ms"] == 6.0 and s["fp8_greedy_token_agreement"] == 0.5
    assert s["fp8_base_weight_bytes_vs_shared_bf16"] == 2.0 and "why_none" not in s


@pytest.mark.parametrize("left_out", ["shared", "shared_fp8"])
def test_summary_float8_keys_are_none_with_the_reason_when_a_row_is_missing(left_out):
    rows = [_row("merged", 8.0, [1]), _row("shared", 9.0, [1]),
            _row("shared_fp8", 6.0, [1], fp8_path_counts={"scaled_mm": 4})]
    s = unmerged_lora.summarize([r for r in rows if r["name"] != left_out])
    assert s["fp8_base_decode_vs_shared_bf16"] is None and s["fp8_greedy_token_agreement"] is None
    assert s["why_none"]["fp8_base_decode_vs_shared_bf16"] == f"no measured {left_out} row"
    assert s["missing"] == [left_out]
    assert (s["unmerged_lora_decode_overhead"] is None) == (left_out == "shared")


def test_summary_refuses_a_float8_row_that_ran_no_float8_matmul():
    rows = [_row("shared", 9.0, [1]), _row("shared_fp8", 6.0, [1], fp8_path_counts={})]
    s = unmerged_lora.summarize(rows)
    assert s["fp8_base_decode_vs_shared_bf16"] is None
    assert "ran no float8 base matmul" in s["why_none"]["fp8_base_decode_vs_shared_bf16"]


def test_rows_option_runs_the_named_rows_in_order(tmp_path, monkeypatch):
    ran = {}
    monkeypatch.setattr(unmerged_lora, "run_rows_into", lambda script, name, specs, *a: ran.setdefault("specs", specs))
    unmerged_lora.main(["--rows", "shared_fp8", "shared", "--out", str(tmp_path / "u.json")])
    assert [(s["name"], s["weights"], s.get("base_dtype")) for s in ran["specs"]] == [
        ("shared", "shared", None), ("shared_fp8", "shared", "fp8")]
    with pytest.raises(SystemExit):
        unmerged_lora.main(["--rows", "fp8"])


def test_a_shared_row_that_read_no_policy_tensor_gives_no_overhead():
    """On the H100 `--device cuda` against a policy on cuda:0 made the shared row copy every weight: merged against
    merged, reported as a -0.1% overhead. The summary now refuses such a pair and says why."""
    row = {"decode_step_ms": 8.0, "outputs_head": [[1, 2]], "aliased_bytes": 0, "weights_path": "shared: 0.0 MiB read"}
    s = unmerged_lora.summarize([{**row, "name": "merged", "weights": "merged"}, {**row, "name": "shared", "weights": "shared"}])
    assert s["unmerged_lora_decode_overhead"] is None and "read no policy tensor" in s["invalid"]


@pytest.mark.timeout(240)
def test_expert_lora_rows_on_a_moe_preset(tmp_path):
    """--expert-lora: the shared row's engine runs the expert adapters unmerged in its grouped GEMMs, the
    shared_no_expert_lora row has none, and the summary gives what the expert adapters cost a decode step."""
    out = tmp_path / "u.json"
    unmerged_lora.main(["--preset", "tiny-moe", "--device", "cpu", "--layers", "2", "--batch", "2", "--prompt-len", "8",
                        "--new-tokens", "6", "--page-size", "8", "--lora-r", "4", "--steps", "1", "--expert-lora",
                        "--rows", "shared", "shared_no_expert_lora", "--out", str(out)])
    record = json.loads(out.read_text())
    shared, bare = record["rows"]
    assert (shared["name"], bare["name"]) == ("shared", "shared_no_expert_lora")
    assert shared["lora"]["target_parameters"] == unmerged_lora.EXPERT_STACKS and "target_parameters" not in bare["lora"]
    assert "expert LoRA A and B buffers" in shared["weights_path"] and "expert" not in bare["weights_path"]
    assert shared["expert_lora_paths"].get("grouped_mm", 0) + shared["expert_lora_paths"].get("loop", 0) > 0
    assert bare["expert_lora_paths"] == {} and bare["weights"] == "shared"
    assert record["summary"]["expert_lora_decode_overhead"] == pytest.approx(
        shared["decode_step_ms"] / bare["decode_step_ms"] - 1)


@pytest.mark.parametrize("argv, names", [(["--expert-lora", "--preset", "tiny"], "--expert-lora"),
                                         (["--rows", "shared_no_expert_lora"], "--rows shared_no_expert_lora")])
def test_expert_lora_options_are_refused_by_name(argv, names, capsys):
    with pytest.raises(SystemExit):
        unmerged_lora.main([*argv, "--device", "cpu"])
    assert names in capsys.readouterr().err
