"""torch.profiler view of the rollout engine's decode steps: top CUDA kernels and GPU-busy vs wall time per step.

Owns profiling a few whole decode steps of one rollout (the engine's `_decode` is wrapped for that rollout only)
and summing their kernels by kind for the report.
Does not own timing rows or the roofline (`rollout_rows.py`).
"""

from __future__ import annotations

import time

import torch


def profile_decode(eng, prompts: list[list[int]], device: str, steps: int = 6, skip: int = 4, top: int = 20) -> dict:
    """Profile decode steps skip+1..skip+steps of one rollout with the engine's current sampling settings (a
    `skip` of half the timed run's new tokens puts them at its mean context, the one its roofline bytes assume)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    # device events only on CUDA: less host overhead inside the timed window (CPU runs record CPU ops)
    prof = profile(activities=[ProfilerActivity.CUDA if device == "cuda" else ProfilerActivity.CPU])
    decode, count, marks = eng._decode, [0], {}

    def counted(*args, **kwargs):  # starts/stops the profiler around whole decode steps only
        count[0] += 1
        if count[0] == skip + 1:
            sync()
            prof.start()
            marks["t0"] = time.perf_counter()
        out = decode(*args, **kwargs)
        if count[0] == skip + steps:
            sync()
            marks["t1"] = time.perf_counter()
            prof.stop()
        return out

    eng._decode = counted  # instance attribute shadows the method for this one rollout
    try:
        eng.generate(prompts, skip + steps + 2, eng._sampling)
    finally:
        del eng._decode
    kernels: dict[str, list[float]] = {}
    spans = []
    for evt in prof.events():
        if evt.device_type != DeviceType.CUDA:
            continue
        start, end = evt.time_range.start, evt.time_range.end
        spans.append((start, end))
        k = kernels.setdefault(evt.name[:100], [0, 0.0])
        k[0] += 1
        k[1] += (end - start) / 1e3
    busy_us, last = 0.0, float("-inf")
    for start, end in sorted(spans):  # union of intervals: overlapping kernels count once
        if end > last:
            busy_us += end - max(start, last)
            last = end
    wall_ms = (marks["t1"] - marks["t0"]) * 1e3 if "t1" in marks else float("nan")
    rows = sorted(kernels.items(), key=lambda kv: -kv[1][1])[:top]
    return {"steps": steps, "first_step": skip + 1, "context_at_first_step": len(prompts[0]) + skip,
            "wall_ms_per_step": wall_ms / steps, "gpu_busy_ms_per_step": busy_us / 1e3 / steps,
            "num_device_events": len(spans),
            "top_kernels": [{"name": n, "calls": c, "total_ms": round(t, 4)} for n, (c, t) in rows]}


# What a decode kernel does, from its name (first match wins): the flex template is a Triton kernel too.
DECODE_KERNEL_KINDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("attention: Flex", ("flex_attention",)),
    ("matmul", ("nvjet", "gemm", "sm90_xmma", "splitkreduce")),
    ("K/V write (index_copy)", ("index_copy",)),
    ("fused norms, RoPE, activations, sampler (Triton)", ("triton_",)),
)


def decode_kernel_kinds(profile: dict) -> dict[str, float]:
    """`profile_decode`'s top kernels summed by `DECODE_KERNEL_KINDS`, in ms per decode step (one stream, so
    GPU-busy time is all kernel time)."""
    from benchmarks.step_probe import kernel_kinds

    steps = profile["steps"]
    total = kernel_kinds(profile, DECODE_KERNEL_KINDS, profile["gpu_busy_ms_per_step"] * steps)
    return {kind: ms / steps for kind, ms in total.items()}
