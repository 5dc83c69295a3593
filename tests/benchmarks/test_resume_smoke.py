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


def _rows(ref, repeat, stopped):
    return [{"row": "uninterrupted", "curve": ref}, {"row": "uninterrupted_repeat", "curve": repeat},
            {"row": "kill9", "checkpoints_seen": ["epoch=0-step=2.ckpt", "last.ckpt"], "curve": stopped}]


def test_resume_summary_takes_the_spread_from_steps_no_resume_touched(tmp_path):
    sys.path.insert(0, str(_ROOT))
    from benchmarks import resume

    ref = {"1": 1.0, "2": 1.0, "3": 1.0, "4": 1.0}
    # the stopped row's own steps 1-2 (before its checkpoint) differ by 1e-3 from the reference: spread >= 1e-3
    s = resume.summarize(_rows(ref, dict(ref), {"1": 1.001, "2": 1.0, "3": 1.0005, "4": 1.0}))
    assert s["run_to_run_spread"] == pytest.approx(1e-3) and s["uninterrupted_pair_max_abs_loss_diff"] == 0.0
    assert s["kill9_resumed_from_step"] == 2 and s["kill9_within_spread"] and not s["kill9_bitwise"]
    # a resumed step further off than anything seen without a resume fails
    s = resume.summarize(_rows(ref, dict(ref), {"1": 1.001, "2": 1.0, "3": 1.01, "4": 1.0}))
    assert not s["kill9_within_spread"] and s["kill9_bitwise_equal_to"] == []
    s = resume.summarize(_rows(ref, {**ref, "1": 1.5}, {**ref, "1": 1.5}))
    assert s["kill9_bitwise_equal_to"] == ["uninterrupted_repeat"]

    path = tmp_path / "resume_full.json"
    path.write_text(json.dumps({"benchmark": "resume_full", "rows": _rows(ref, dict(ref), dict(ref)),
                                "summary": {"old": 1}}))
    proc = subprocess.run([sys.executable, str(_ROOT / "benchmarks" / "resume.py"), "--summarize", str(path)],
                          capture_output=True, text=True, cwd=_ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    record = json.loads(path.read_text())
    assert record["summary"]["kill9_bitwise"] and record["summary_recomputed"]["summary_at_run"] == {"old": 1}
