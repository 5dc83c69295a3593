"""The FP8 frozen base's matmul paths at the Gemma4-31B linear shapes: `scaled_mm` against `dequantize`, and both
against a bf16 base, each row in its own process.

Each row builds, per shape (the decoder's q/k/o projections and gate/up/down MLPs, `in -> out`), a frozen bf16
Linear (`bf16` row) or its `fp8_base.Float8BaseLinear` (`dequantize`: the path forced with
`fp8_base.force_dequantize`; `scaled_mm`: torch._scaled_mm with rowwise scales), then times the forward and the
forward plus the backward for the input (what a LoRA step runs over its frozen base) at `--tokens` bf16 tokens,
`--steps` times after a warm-up: median, min and max per shape, and the sum over the shapes. The row records the path
counts (`fp8_base.path_counts()`), so a row that ran another path than its name says is visible.

Rows: `bf16`, `dequantize`, `scaled_mm`. Summary: `fp8_base_scaled_mm_vs_dequantize_fwdbwd` (dequantize's summed
fwd+bwd time over scaled_mm's: above 1 means scaled_mm is faster, the path the code takes wherever it can),
`fp8_base_scaled_mm_vs_bf16_fwdbwd`, and the same for the forward alone.

    python benchmarks/fp8_base_matmul.py --out $OUT/fp8_base_matmul.json
    python benchmarks/fp8_base_matmul.py --device cpu --dtype float32 --scale 64 --tokens 64 --steps 1 \\
        --paths bf16 dequantize --out /tmp/f.json        # CPU smoke of the script
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.row_process import run_rows_into  # noqa: E402

PATHS = ("bf16", "dequantize", "scaled_mm")
# Gemma4-31B (hidden 5376, 32 query / 16 KV heads of 256, MLP 21504): name -> (in, out)
SHAPES = {"q_proj": (5376, 8192), "k_proj": (5376, 4096), "o_proj": (8192, 5376), "gate_proj": (5376, 21504),
          "up_proj": (5376, 21504), "down_proj": (21504, 5376)}


def _timed(fn, device: str) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    """One row: every shape on one path, forward and forward + backward for the input."""
    import contextlib

    from torch import nn

    from lightning_ffpa import fp8_base

    device, dtype, path = spec["device"], getattr(torch, spec["dtype"]), spec["path"]
    torch.manual_seed(0)
    shapes, totals = {}, {"fwd": 0.0, "fwdbwd": 0.0}
    forced = fp8_base.force_dequantize() if path == "dequantize" else contextlib.nullcontext()
    with forced:
        for name, (k, n) in SHAPES.items():
            k, n = max(16, k // spec["scale"]), max(16, n // spec["scale"])
            linear = nn.Linear(k, n, bias=False, device=device, dtype=dtype).requires_grad_(False)
            layer = linear if path == "bf16" else fp8_base.Float8BaseLinear.from_linear(linear)
            x = torch.randn(spec["tokens"], k, device=device, dtype=dtype, requires_grad=True)
            dy = torch.randn(spec["tokens"], n, device=device, dtype=dtype)

            def fwd(layer=layer, x=x):
                with torch.no_grad():
                    layer(x)

            def fwdbwd(layer=layer, x=x, dy=dy):
                torch.autograd.grad(layer(x), x, dy)

            row = {}
            for label, fn in (("fwd", fwd), ("fwdbwd", fwdbwd)):
                fn()  # warm-up
                times = [_timed(fn, device) * 1e3 for _ in range(spec["steps"])]
                row.update({f"{label}_ms": statistics.median(times), f"{label}_ms_min": min(times),
                            f"{label}_ms_max": max(times)})
                totals[label] += statistics.median(times)
            shapes[f"{name} {k}->{n}"] = row
            del layer, linear, x, dy
    return {"shapes": shapes, "fwd_ms_total": totals["fwd"], "fwdbwd_ms_total": totals["fwdbwd"],
            "path_counts": fp8_base.path_counts(), "device_name": torch.cuda.get_device_name()
            if device == "cuda" else device}


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The time ratios between the paths that measured (None where one is missing)."""
    by = {r["path"]: r for r in rows if "fwdbwd_ms_total" in r}
    summary: dict[str, Any] = {f"{p}_{k}_ms_total": by[p][f"{k}_ms_total"] for p in by for k in ("fwd", "fwdbwd")}
    for k in ("fwd", "fwdbwd"):
        for other in ("dequantize", "bf16"):
            ok = "scaled_mm" in by and other in by
            summary[f"fp8_base_scaled_mm_vs_{other}_{k}"] = (by[other][f"{k}_ms_total"] / by["scaled_mm"][f"{k}_ms_total"]
                                                            if ok else None)
    summary["missing"] = [p for p in PATHS if p not in by]
    return summary


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", help="the activations' and the bf16 row's weights' dtype")
    ap.add_argument("--tokens", type=int, default=8192, help="rows of x: tokens in one micro-batch")
    ap.add_argument("--scale", type=int, default=1, help="divide every shape's dims by this (CPU smoke)")
    ap.add_argument("--paths", nargs="+", default=list(PATHS), choices=PATHS)
    ap.add_argument("--steps", type=int, default=5, help="timed runs per shape (median, min and max)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--budget-s", type=float, default=570.0, help="the whole call ends within this many seconds")
    ap.add_argument("--row-timeout-s", type=float, default=180.0, help="one row's process is killed after this")
    args = ap.parse_args(argv)
    spec = {k: getattr(args, k) for k in ("device", "dtype", "tokens", "scale", "steps")}
    specs = [{**spec, "name": p, "path": p} for p in args.paths]
    out = Path(args.out) if args.out else Path(__file__).resolve().parent / "results" / "fp8_base_matmul.json"
    return run_rows_into(Path(__file__).resolve(), "fp8_base_matmul", specs, out, summarize, args.row_timeout_s, args.budget_s)


if __name__ == "__main__":
    from benchmarks.row_process import row_main

    if not row_main(None, measure):
        main()
