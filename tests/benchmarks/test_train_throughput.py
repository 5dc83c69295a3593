"""CPU smoke of benchmarks/train_throughput.py: the rows it runs on the GPU build, train and report."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parents[2]
_SMOKE = ["--cpu", "--preset", "tiny", "--layers", "4", "--seqs", "256", "--warmup", "1", "--steps", "1"]


def _run(tmp_path, rows, launcher=(), extra=()):
    out = tmp_path / "tt.json"
    cmd = [*launcher, str(_ROOT / "benchmarks" / "train_throughput.py"), *_SMOKE, "--rows", *rows,
           "--out", str(out), *extra]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(_ROOT), os.environ.get("PYTHONPATH")])), OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.timeout(300)
def test_benchmark_rows_run_on_cpu(tmp_path):
    result = _run(tmp_path, ["sdpa", "ours_nocompile", "ours_every_other"], launcher=[sys.executable],
                  extra=["--profile"])
    rows = {r["row"]: r for r in result["rows"]}
    assert not [r["error"] for r in rows.values() if "error" in r]
    # A model surviving its row would be counted in the next row's memory (the H200 run's +16 GiB).
    assert not [r["warning"] for r in rows.values() if "warning" in r]
    assert rows["ours_nocompile"]["save_mm"] == result["summary"]["ours_sac_save_mm"] == "high_k"
    assert rows["ours_nocompile"]["optim"] == "product" and rows["sdpa"]["optim"] == "adamw_default"
    assert rows["ours_every_other"]["save_mm"] == "every_other"
    assert all("memory_phases" in r and "allocated_before_row_gb" in r for r in rows.values())
    assert rows["ours_nocompile"]["profile"]["wall_ms"] > 0 and "profile" not in rows["sdpa"]
    for r in rows.values():
        assert 0 < r["last_loss"] < 20, r


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_benchmark_dp2_on_cpu(tmp_path):
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29547"]
    result = _run(tmp_path, ["sdpa", "ours_nocompile"], launcher=launcher, extra=["--dp", "2"])
    assert result["dp"] == 2
    assert not [r["error"] for r in result["rows"] if "error" in r]


def test_kernel_summary_counts_overlap_once():
    sys.path.insert(0, str(_ROOT))
    from benchmarks.step_probe import summarize_kernels

    events = [("gemm", 0.0, 1000.0), ("gemm", 2000.0, 3000.0), ("elementwise", 500.0, 1500.0), ("x" * 200, 5000.0, 5100.0)]
    s = summarize_kernels(events, wall_ms=10.0, top=2, name_chars=11)
    assert s["cuda_busy_ms"] == 2.6  # [0,1.5] + [2,3] + [5,5.1]
    assert s["cuda_kernel_total_ms"] == 3.1 and s["num_kernels"] == 4
    assert s["cuda_busy_fraction"] == 0.26
    assert s["top_kernels"] == [dict(name="gemm", calls=2, total_ms=2.0), dict(name="elementwise", calls=1, total_ms=1.0)]


def test_cpu_phase_memory_sees_the_foreach_adamw_temporary():
    """The optimizer phase of foreach AdamW peaks one parameter-size above its start; fused does not."""
    import torch

    sys.path.insert(0, str(_ROOT))
    from benchmarks.step_probe import phase_memory

    def run(**kw):
        p = torch.nn.Parameter(torch.randn(512, 512))  # 1 MiB fp32
        opt = torch.optim.AdamW([p], lr=1e-3, **kw)
        loss_fn = lambda: (p * p).sum()  # noqa: E731
        for _ in range(2):  # first step creates the Adam states; the second is the steady state
            mem = phase_memory(torch.device("cpu"), loss_fn, torch.Tensor.backward, opt.step)
            opt.zero_grad(set_to_none=True)
        return mem["optimizer"]["peak_above_start_gb"] * 1024  # MiB

    assert run(foreach=True) == pytest.approx(1.0, abs=0.01)
    assert run(fused=True) == pytest.approx(0.0, abs=0.01)
