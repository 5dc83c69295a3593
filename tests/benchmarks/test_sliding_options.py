"""The sliding-window Flex option sweep: its candidate table is valid, and without a GPU it stops with one error."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(_ROOT))
from benchmarks import sliding_options  # noqa: E402


def test_fixed_candidates_keep_torchs_backward_tile_rule():
    sliding_options.check_candidates()
    assert sliding_options.CANDIDATES["torch_defaults"] == {}  # the product's current head_dim-256 options
    broken = dict(sliding_options.CANDIDATES["fwd64x64s2_bwd32x64s2"], bwd_BLOCK_N1=48)
    sliding_options.CANDIDATES["broken"] = broken
    try:
        with pytest.raises(ValueError, match="broken"):
            sliding_options.check_candidates()
    finally:
        del sliding_options.CANDIDATES["broken"]


def test_summary_compares_the_best_row_with_torch_defaults():
    rows = [dict(row="torch_defaults", seq=8192, ms=10.0), dict(row="a", seq=8192, ms=8.0),
            dict(row="b", seq=8192, error="OutOfResources"), dict(row="torch_defaults", seq=16384, error="x")]
    summary = sliding_options.summarize(rows, [8192, 16384])
    assert summary["sliding_best_vs_default_fwdbwd_8k"] == pytest.approx(1.25)
    assert summary["sliding_best_row_8k"] == "a"
    assert summary["sliding_best_vs_default_fwdbwd_16k"] is None


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the CPU refusal")
def test_without_a_gpu_the_script_exits_2_naming_the_device(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(_ROOT))
    out = subprocess.run([sys.executable, str(_ROOT / "benchmarks" / "sliding_options.py"), "--out",
                          str(tmp_path / "s.json")], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "device" in out.stderr and "CUDA" in out.stderr, out.stderr[-800:]
    assert not (tmp_path / "s.json").exists()
