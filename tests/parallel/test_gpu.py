"""GPU smoke: the benchmark's rows (FSDP2 + SAC + compile + chunked loss, ffpa) train finitely at tiny size."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.gpu
@pytest.mark.timeout(420)
def test_benchmark_rows_run_tiny(tmp_path):
    out = tmp_path / "tt.json"
    cmd = [sys.executable, str(_ROOT / "benchmarks" / "train_throughput.py"), "--preset", "tiny", "--layers", "4",
           "--seqs", "512", "--warmup", "1", "--steps", "2", "--out", str(out)]
    proc = subprocess.run(cmd, env=dict(os.environ, PYTHONPATH=str(_ROOT)), capture_output=True, text=True,
                          timeout=400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = json.loads(out.read_text())["rows"]
    errors = {r["row"]: r["error"] for r in rows if "error" in r}
    assert not errors, errors
    ours = next(r for r in rows if r["row"] == "ours")
    assert any(k.startswith("ffpa") and v for k, v in ours["dispatch"].items()), ours["dispatch"]
