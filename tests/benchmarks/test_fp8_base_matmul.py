"""CPU smoke of benchmarks/fp8_base_matmul.py: the bf16 and dequantize rows each in its own process, each timing
every shape, the dequantize row's path counts naming the path it ran, and the summary's keys (scaled_mm needs an
FP8 GPU: its keys are None here and the row is listed as missing)."""

import json
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # `benchmarks` is a folder of scripts
from benchmarks import fp8_base_matmul  # noqa: E402


@pytest.mark.timeout(180)
def test_rows_in_own_processes_say_which_path_ran(tmp_path):
    out = tmp_path / "fp8_base_matmul.json"
    fp8_base_matmul.main(["--device", "cpu", "--dtype", "float32", "--scale", "64", "--tokens", "32", "--steps", "1",
                          "--paths", "bf16", "dequantize", "--out", str(out)])
    record = json.loads(out.read_text())
    bf16, deq = record["rows"]
    assert (bf16["name"], deq["name"]) == ("bf16", "dequantize")
    for r in (bf16, deq):
        assert "error" not in r, r
        assert r["process"]["rc"] == 0 and r["process"]["pid"] != os.getpid()
        # both timed; not fwdbwd > fwd: one step of each on a loaded 2-core CI machine can come out either way
        assert len(r["shapes"]) == len(fp8_base_matmul.SHAPES) and r["fwdbwd_ms_total"] > 0 and r["fwd_ms_total"] > 0
    assert bf16["path_counts"] == {} and deq["path_counts"] == {"dequantize": 2 * 2 * len(fp8_base_matmul.SHAPES)}
    s = record["summary"]
    assert s["missing"] == ["scaled_mm"] and s["fp8_base_scaled_mm_vs_dequantize_fwdbwd"] is None
    assert s["dequantize_fwdbwd_ms_total"] == deq["fwdbwd_ms_total"]
