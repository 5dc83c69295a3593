"""CPU smoke of benchmarks/resume.py: every row (two uninterrupted runs, kill -9, SIGTERM) runs and resumes."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
def test_resume_benchmark_rows_run_on_cpu(tmp_path):
    out = tmp_path / "resume.json"
    cmd = [sys.executable, str(_ROOT / "benchmarks" / "resume.py"), "--smoke", "--jobs", "2", "--variant", "lora", "--steps", "6",
           "--stop-at", "4", "--every", "2", "--seq", "64", "--vocab", "512", "--samples", "12",
           "--logs", str(tmp_path), "--out", str(out)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(_ROOT), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out.read_text())
    rows = {r["row"]: r for r in result["rows"]}
    assert rows["kill9"]["stop_rc"] == -9 and rows["sigterm"]["stop_rc"] == 143
    assert rows["kill9"]["steps_before_stop"] == [1, 2, 3] and rows["sigterm"]["steps_before_stop"] == [1, 2, 3, 4]
    assert result["summary"]["kill9_bitwise"] and result["summary"]["sigterm_bitwise"]  # fp32 CPU is deterministic
