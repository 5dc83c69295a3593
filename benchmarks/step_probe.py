"""Where one training step's memory and time go: per-phase memory, and a profiled step's top CUDA kernels.

Owns the measuring only; the step itself (forward + loss, backward, optimizer) is the caller's, passed
in as three callables so every benchmark row is probed the same way. Neither probe is timed: they
run on an extra step after the timed ones, because the syncs and the profiler perturb timing.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

__all__ = ["KERNEL_KINDS", "StepProfiler", "kernel_kinds", "phase_memory", "profile_step", "summarize_kernels"]

_GIB = 2**30


def phase_memory(device: torch.device, forward_loss: Callable[[], torch.Tensor],
                 backward: Callable[[torch.Tensor], None], optimizer_step: Callable[[], None]) -> dict:
    """Memory of forward+loss, backward and the optimizer step, each phase measured on its own.

    Per phase: `peak_above_start_gb` (its own high-water mark over what was allocated when it began)
    and `allocated_change_gb`; on CUDA also the absolute `peak_gb` / `allocated_after_gb` (the peak
    counter is reset before each phase). On CPU the allocator has no counters, so the profiler's
    allocation and free events are replayed in time order instead.
    """
    out: dict = {}
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
    out["allocated_before_gb"] = torch.cuda.memory_allocated(device) / _GIB if cuda else None

    def phase(name: str, fn: Callable, *args) -> object:
        if cuda:
            start = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
            result = fn(*args)
            torch.cuda.synchronize(device)
            peak, end = torch.cuda.max_memory_allocated(device), torch.cuda.memory_allocated(device)
            out[name] = dict(peak_gb=peak / _GIB, allocated_after_gb=end / _GIB,
                             peak_above_start_gb=(peak - start) / _GIB, allocated_change_gb=(end - start) / _GIB)
        else:
            result, peak, change = _cpu_tracked(fn, *args)
            out[name] = dict(peak_above_start_gb=peak / _GIB, allocated_change_gb=change / _GIB)
        return result

    loss = phase("forward_loss", forward_loss)
    phase("backward", backward, loss)
    loss = None  # its graph holds the model's FSDP state; the optimizer phase must not see it
    phase("optimizer", optimizer_step)
    key = "peak_gb" if cuda else "peak_above_start_gb"
    phases = ("forward_loss", "backward", "optimizer")
    out["step_peak_gb"] = max(out[k][key] for k in phases) if cuda else None
    out["peak_phase"] = max(phases, key=lambda k: out[k][key])
    return out


def _cpu_tracked(fn: Callable, *args) -> tuple[object, int, int]:
    """Run `fn` under the profiler's memory tracking: (result, peak bytes above start, net bytes).

    Reads the raw allocator events (`kineto_results`, not public API): the FunctionEvent view files
    a free under its enclosing scope (e.g. `Optimizer.step`), out of time order.
    """
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn(*args)
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    cur = peak = 0
    for _, nbytes in events:
        cur += nbytes
        peak = max(peak, cur)
    return result, peak, cur


class StepProfiler:
    """Profile the work between `start()` and `stop()` (one step, where the caller does not own the loop, e.g. a
    Lightning fit's batch hooks); `stop()` returns what `profile_step` returns."""

    def __init__(self, device: torch.device, top: int = 60, name_chars: int = 90) -> None:
        self.device, self.top, self.name_chars = device, top, name_chars
        self._prof = None

    @property
    def active(self) -> bool:
        return self._prof is not None

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def start(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        cuda = self.device.type == "cuda"
        self._sync()
        self._prof = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []))
        self._prof.__enter__()
        self._t0 = time.perf_counter()

    def stop(self) -> dict:
        self._sync()
        wall_ms = (time.perf_counter() - self._t0) * 1e3
        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        events = [(ev.name, ev.time_range.start, ev.time_range.end) for ev in prof.events()
                  if ev.device_type == torch.autograd.DeviceType.CUDA]
        return dict(wall_ms=wall_ms, **summarize_kernels(events, wall_ms, self.top, self.name_chars))


def profile_step(device: torch.device, step: Callable[[], None], top: int = 60, name_chars: int = 90) -> dict:
    """Profile one step: top `top` CUDA kernels by total time, and CUDA busy time against wall time.

    `cuda_busy_ms` is the union of kernel intervals (overlapping streams counted once); busy / wall
    below 1 means the GPU waited on the host (launch overhead, syncs, graph breaks).
    """
    profiler = StepProfiler(device, top, name_chars)
    profiler.start()
    step()
    return profiler.stop()


def summarize_kernels(events: list[tuple[str, float, float]], wall_ms: float, top: int = 25,
                      name_chars: int = 90) -> dict:
    """(name, start_us, end_us) kernel events -> busy time (interval union), totals and the top kernels."""
    kernels: dict[str, list] = {}
    for name, start, stop in events:
        total = kernels.setdefault(name, [0, 0.0])
        total[0] += 1
        total[1] += (stop - start) / 1e3
    busy_us, end = 0.0, float("-inf")
    for start, stop in sorted((start, stop) for _, start, stop in events):  # union of intervals
        if stop > end:
            busy_us += stop - max(start, end)
            end = stop
    ranked = sorted(kernels.items(), key=lambda kv: -kv[1][1])
    return dict(
        cuda_busy_ms=busy_us / 1e3,
        cuda_busy_fraction=busy_us / 1e3 / wall_ms if wall_ms else None,
        cuda_kernel_total_ms=sum(v[1] for v in kernels.values()),
        num_kernels=sum(v[0] for v in kernels.values()),
        top_kernels=[dict(name=n[:name_chars], calls=c, total_ms=round(ms, 3)) for n, (c, ms) in ranked[:top]],
    )


# What a kernel does, from its name (first match wins). Ranges the profiler records around kernels
# (`Optimizer.step#AdamW.step`, `FSDP::...`) are not kernels and are left out: they would count time twice.
KERNEL_KINDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("attention: FFPA", ("ffpa",)),
    ("attention: Flex", ("flex_attention",)),
    ("attention: FA4", ("flash_attncute",)),  # flash-attn-4's CuTeDSL kernels (the sliding layers)
    ("attention: SDPA", ("sdpa", "fmha", "flash")),
    # torch's CUTLASS 3.x kernels: _grouped_mm (the experts) and the float8 rowwise _scaled_mm; cuBLAS is "nvjet"
    ("CUTLASS GEMM (grouped, scaled)", ("grouped", "group_gemm", "enable_3x_kernel_for_sm9x")),
    # cuBLAS's float8 GEMMs: "q" for an e4m3 operand, "r" for e5m2 (torchao's gradients) in nvjet's names
    ("matmul: float8", ("_qqtst", "_qrtst", "_rqtst")),
    ("matmul", ("nvjet", "gemm", "sm90_xmma")),
    ("fused elementwise (Triton)", ("triton_poi", "triton_red", "triton_per")),
    ("routing, gather and scatter", ("topk", "sort", "histc", "histogram", "bincount", "index", "gather", "scatter")),
    ("optimizer", ("multi_tensor_apply",)),
    ("copies and casts", ("memcpy", "copy_kernel", "chunk_cat", "split_with_sizes")),
)


def kernel_kinds(profile: dict, kinds: tuple[tuple[str, tuple[str, ...]], ...] = KERNEL_KINDS,
                 total_ms: float | None = None) -> dict[str, float]:
    """A profiled step's top kernels summed by `kinds` (ms); "other" is the rest of the top list and
    "outside the top list" what the list leaves out of all kernel time, `total_ms` (default: the profile's
    `cuda_kernel_total_ms`; kernels on other streams overlap, so the sum can exceed the step's wall time)."""
    out = dict.fromkeys([kind for kind, _ in kinds] + ["other"], 0.0)
    for k in profile["top_kernels"]:
        name = k["name"].lower()
        if "#" in name or name.startswith(("fsdp::", "profilerstep")):
            continue
        kind = next((kind for kind, keys in kinds if any(key in name for key in keys)), "other")
        out[kind] += k["total_ms"]
    total = profile["cuda_kernel_total_ms"] if total_ms is None else total_ms
    out["outside the top list"] = total - sum(k["total_ms"] for k in profile["top_kernels"])
    return out
