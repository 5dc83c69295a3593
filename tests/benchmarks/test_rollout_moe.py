"""CPU smoke of benchmarks/rollout.py on the tiny MoE preset: the engine row's routed-bytes roofline beside the
all-weights one, its routed expert fraction, and the summary keys (`moe_decode_routed_roofline_bs*`)."""

import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # `benchmarks` is a folder of scripts
from benchmarks import rollout  # noqa: E402


@pytest.mark.timeout(120)
def test_moe_row_reports_the_routed_bytes_roofline(tmp_path):
    out = tmp_path / "rollout_moe.json"
    # one row: every step routes to exactly top_k = 2 of tiny-moe's 4 experts per layer, so half the expert bytes
    rollout.main(["--preset", "tiny-moe", "--device", "cpu", "--batches", "1", "--prompt-len", "8",
                  "--new-tokens", "10", "--bandwidth-gb", "0.01", "--check-prompts", "0", "--rows", "ours_paged_flex",
                  "--modes", "greedy", "--out", str(out)])
    record = json.loads(out.read_text())
    (row,) = record["rows"]
    assert "error" not in row, row
    moe = row["moe_routing"]
    assert moe["decode_steps_counted"] == 9 and moe["num_experts"] == 4 and len(moe["moe_layers"]) == 4
    assert moe["mean_union_per_layer"] == [2.0] * 4 and row["routed_expert_fraction"] == 0.5
    assert moe["token_match"] == 1.0  # fp32 CPU: the counting rollout decodes the timed one's tokens
    # 4 layers x 4 experts x (gate_up 64x64 + down 64x32) fp32; the steps read half of them
    assert moe["all_expert_bytes"] == 4 * 4 * (64 * 64 + 64 * 32) * 4
    assert row["routed_step_bytes"] == pytest.approx(row["step_bytes"] - moe["all_expert_bytes"] / 2)
    ratio = row["routed_step_bytes"] / row["step_bytes"]
    for end in ("", "_min", "_max"):  # the same timed steps over fewer bytes
        assert row[f"routed_roofline_fraction{end}"] == pytest.approx(row[f"roofline_fraction{end}"] * ratio)
    assert row["routed_roofline_fraction_datasheet"] is None  # no CPU datasheet
    s = record["summary"]
    assert s["moe_decode_routed_roofline_copy_bw_bs1"] == row["routed_roofline_fraction"]
    assert s["moe_decode_routed_expert_fraction_bs1"] == 0.5
    assert "moe_decode_routed_roofline_bs1" in s and "moe_decode_all_weights_roofline_bs1" in s
    assert s["depth_note"].startswith("4 of 4 layers (full tiny-moe depth)")


def test_no_moe_keys_without_routed_fields_and_the_depth_is_the_presets(tmp_path):
    rows = [dict(name="ours_paged_flex", kind="ours_paged_flex", mode="greedy", batch=64, tokens_per_s=1.0,
                 roofline_fraction=0.5, layers=30, preset="gemma4-26b-a4b", prompt_len=256, new_tokens=512)]
    s = rollout.summarize(rows)
    assert not [k for k in s if k.startswith("moe_")]
    assert s["depth_note"].startswith("30 of 30 layers (full Gemma4-26B-A4B depth)")
    assert rollout.parse_args(["--preset", "gemma4-26b-a4b"]).layers == 30
    assert rollout.parse_args([]).layers == 60


def test_a_failed_count_is_recorded_and_the_timed_row_kept(monkeypatch):
    from benchmarks import rollout_rows

    def no_room(*args, **kwargs):
        raise RuntimeError("no room for the counting engine")

    monkeypatch.setattr(rollout_rows, "routed_roofline", no_room)
    args = rollout.parse_args(["--preset", "tiny-moe", "--device", "cpu", "--layers", "2", "--batches", "1",
                               "--prompt-len", "4", "--new-tokens", "4", "--bandwidth-gb", "0.01",
                               "--check-prompts", "0", "--rows", "ours_paged_flex", "--modes", "greedy"])
    (spec,) = rollout.build_specs(args)
    row = rollout_rows.measure(spec)
    assert row["moe_routing_error"] == "RuntimeError: no room for the counting engine"
    assert row["tokens_per_s"] > 0 and row["roofline_fraction"] > 0 and "routed_roofline_fraction" not in row


def test_dtype_option_reaches_the_rows_model():
    """`--dtype float32` on a GPU checks the MoE engine against HF without bf16 flips; the row builds its model so."""
    from benchmarks import rollout_rows

    args = rollout.parse_args(["--preset", "tiny-moe", "--device", "cpu", "--batches", "1", "--dtype", "bfloat16"])
    (spec,) = [s for s in rollout.build_specs(args) if s["kind"] == "ours_paged_flex" and s["mode"] == "greedy"]
    assert spec["dtype"] == "bfloat16"
    model, _ = rollout_rows.build_model(1, "tiny-moe", "cpu", spec["dtype"])
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in rollout_rows.build_model(1, "tiny-moe", "cpu")[0].parameters()} == {torch.float32}
