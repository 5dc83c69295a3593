"""What the op rows (`nemo_backend.py`) and step rows (`nemo_step.py`) of the NeMo-backend comparison share:
timing a call, and the record of which attention path a row really took (ours' dispatch and kernel counters,
NeMo's once-per-reason fallback log) with the reason a row did not measure the path it is labelled with.
"""

from __future__ import annotations

import statistics
import time

import torch

from benchmarks import nemo_wheel
from lightning_ffpa.attention import backend, kernels


def time_ms(fn, device, warmup: int, iters: int) -> dict:
    """Median/min/max ms of `fn` over `iters` runs after `warmup` (CUDA events; wall clock on CPU)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return {"ms": round(statistics.median(times), 4), "ms_min": round(min(times), 4),
            "ms_max": round(max(times), 4), "iters": iters, "warmup": warmup}


def path_record(impl: str, nemo) -> dict:
    """Which path the row really took: our dispatch/kernel counters, or NeMo's once-per-reason fallback log."""
    if impl == "ours":
        return {"dispatch": backend.dispatch_counts(), "kernels": kernels.kernel_counts()}
    return {"nemo_fallbacks": nemo_wheel.fallbacks(nemo)}


def reset_paths(nemo) -> None:
    backend.reset_dispatch_counts()
    if nemo is not None:
        nemo_wheel.reset_fallbacks(nemo)


def fell_back(row: dict, device) -> str | None:
    """Why a row did not measure the FFPA path it is labelled with, or None (on CPU only the op path counts)."""
    if row.get("nemo_fallbacks"):
        return f"NeMo's backend fell back: {row['nemo_fallbacks']}"
    counts, ran = row.get("dispatch") or {}, row.get("kernels") or {}
    if counts and counts.get("ffpa-dense", 0) + counts.get("ffpa-varlen", 0) == 0:
        return f"ours took no FFPA path: {counts}"
    if device.type == "cuda" and (ran.get("reference") or counts.get("sdpa") or counts.get("eager")):
        return f"ours left the FFPA/flex paths on CUDA: {counts} {ran}"
    return None
