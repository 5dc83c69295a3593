"""CPU smoke of benchmarks/unmerged_lora.py: the merged and shared rows each in its own process, the same greedy
tokens (fp32), the summary's overhead key, and what each row's engine weights were."""

import json
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # `benchmarks` is a folder of scripts
from benchmarks import unmerged_lora  # noqa: E402


@pytest.mark.timeout(180)
def test_merged_and_shared_rows_in_own_processes(tmp_path):
    out = tmp_path / "unmerged_lora.json"
    unmerged_lora.main(["--preset", "tiny", "--device", "cpu", "--layers", "2", "--batch", "2", "--prompt-len", "8",
                        "--new-tokens", "6", "--page-size", "8", "--lora-r", "4", "--steps", "1", "--out", str(out)])
    record = json.loads(out.read_text())
    merged, shared = record["rows"]
    assert (merged["name"], shared["name"]) == ("merged", "shared")
    for r in (merged, shared):
        assert "error" not in r, r
        assert r["process"]["rc"] == 0 and r["process"]["pid"] != os.getpid() and r["decode_step_ms"] > 0
    assert merged["process"]["pid"] != shared["process"]["pid"]
    assert merged["weights_path"].startswith("merged copy: ") and merged["aliased_bytes"] == 0
    assert shared["weights_path"].startswith("shared: ") and shared["aliased_bytes"] > 0
    assert shared["engine_own_bytes"] < merged["engine_own_bytes"] // 5
    s = record["summary"]
    assert s["unmerged_lora_decode_overhead"] == pytest.approx(shared["decode_step_ms"] / merged["decode_step_ms"] - 1)
    assert s["greedy_token_agreement"] == 1.0 and "partial" not in s


def test_a_shared_row_that_read_no_policy_tensor_gives_no_overhead():
    """On the H100 `--device cuda` against a policy on cuda:0 made the shared row copy every weight: merged against
    merged, reported as a -0.1% overhead. The summary now refuses such a pair and says why."""
    row = {"decode_step_ms": 8.0, "outputs_head": [[1, 2]], "aliased_bytes": 0, "weights_path": "shared: 0.0 MiB read"}
    s = unmerged_lora.summarize([{**row, "weights": "merged"}, {**row, "weights": "shared"}])
    assert s["unmerged_lora_decode_overhead"] is None and "read no policy tensor" in s["invalid"]
