"""benchmarks/step_probe.py on CUDA: per-phase peak memory and the profiled step's kernel list."""

import sys
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.gpu
def test_cuda_phase_memory_and_profile():
    """On CUDA: fused AdamW's step peaks at ~0 above its start, foreach's one fp32 parameter-size; kernels listed."""
    import torch

    sys.path.insert(0, str(_ROOT))
    from benchmarks.step_probe import phase_memory, profile_step

    dev = torch.device("cuda")

    def run(**kw):
        p = torch.nn.Parameter(torch.randn(2048, 2048, device=dev))  # 16 MiB fp32
        opt = torch.optim.AdamW([p], lr=1e-3, **kw)
        loss_fn = lambda: (p * p).sum()  # noqa: E731
        for _ in range(2):
            mem = phase_memory(dev, loss_fn, torch.Tensor.backward, opt.step)
            opt.zero_grad(set_to_none=True)
        return mem, opt, loss_fn

    mem, _, _ = run(foreach=True)
    assert mem["optimizer"]["peak_above_start_gb"] * 1024 == pytest.approx(16.0, abs=1.0)
    mem, opt, loss_fn = run(fused=True)
    assert mem["optimizer"]["peak_above_start_gb"] * 1024 < 1.0
    assert {"peak_gb", "allocated_after_gb"} <= set(mem["backward"])
    prof = profile_step(dev, lambda: (loss_fn().backward(), opt.step()))
    assert prof["top_kernels"] and prof["cuda_busy_ms"] > 0 and 0 < prof["cuda_busy_fraction"] <= 1.0
