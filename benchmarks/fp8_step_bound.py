"""Where an FP8 full fine-tuning step's time goes, and the speedup the share FP8 touches allows.

Reads a `train_throughput.py --profile` result holding ours in bf16 (`ours`) and an FP8 row, both profiled, and
writes a derived result (no GPU). From each row's extra profiled step, summed by kind (`step_probe.kernel_kinds`):
the decoder GEMMs FP8 converted (bf16 matmul time the FP8 row no longer has) against the float8 GEMMs that
replaced them, what the rest of the FP8 step added (the casts, fused by Inductor into the kernels around them), and
two bounds from the median step times: the step with free casts (Amdahl over the GEMMs FP8 touches) and the step
with the still-bf16 matmuls (the lm_head) converted at the same GEMM speedup.

    python benchmarks/fp8_step_bound.py --source benchmarks/results/train_throughput_fp8_profile_h100.json \\
        --out benchmarks/results/fp8_step_bound_h100.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.report.results_io import read_result, write_result  # noqa: E402
from benchmarks.step_probe import kernel_kinds  # noqa: E402
from lightning_ffpa.errors import ConfigError  # noqa: E402

FLOAT8, BF16 = "matmul: float8", "matmul"


def _row(record: dict, name: str, option: str) -> dict:
    rows = [r for r in record["rows"] if r.get("row") == name and r.get("profile")]
    if not rows:
        raise ConfigError(option, name, "has no profiled row of that name in --source (run train_throughput.py "
                          "with --profile for it)")
    return rows[0]


def bound(record: dict, fp8_row: str, target: float) -> tuple[list[dict], dict]:
    """(rows, summary) of the breakdown; times in ms."""
    base, fp8 = _row(record, "ours", "--source"), _row(record, fp8_row, "--fp8-row")
    kinds = {r["row"]: kernel_kinds(r["profile"]) for r in (base, fp8)}
    b, f = kinds[base["row"]], kinds[fp8["row"]]
    converted_bf16 = b[BF16] - f[BF16]  # the bf16 GEMMs the FP8 row no longer runs
    gemm_saving = converted_bf16 - f[FLOAT8]
    step_b, step_f = base["step_ms_median"], fp8["step_ms_median"]
    gemm_speedup = converted_bf16 / f[FLOAT8]
    free_casts = step_b / (step_b - gemm_saving)
    rest_bf16 = step_f - f[BF16] * (1 - 1 / gemm_speedup)  # the remaining bf16 matmuls at the same speedup
    rows = [{"row": r["row"], "step_ms_median": r["step_ms_median"], "kernel_ms_by_kind": kinds[r["row"]]}
            for r in (base, fp8)]
    summary = {
        "fp8_recipe": fp8.get("fp8"),
        "fp8_step_vs_bf16": step_b / step_f,
        "fp8_converted_gemm_bf16_ms": converted_bf16,
        "fp8_converted_gemm_float8_ms": f[FLOAT8],
        "fp8_gemm_speedup": gemm_speedup,
        "fp8_gemm_saving_ms": gemm_saving,
        "fp8_step_saving_ms": step_b - step_f,
        "fp8_added_outside_gemms_ms": gemm_saving - (step_b - step_f),
        "fp8_unconverted_matmul_ms": f[BF16],
        "fp8_bound_free_casts": free_casts,
        "fp8_bound_all_matmuls_float8": step_b / rest_bf16,
        "fp8_target": target,
        "fp8_target_within_free_cast_bound": free_casts >= target,
    }
    return rows, summary


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--source", required=True, help="a train_throughput.py result with --profile rows")
    p.add_argument("--fp8-row", default="ours_fp8_tensorwise", help="the FP8 row to set against `ours`")
    p.add_argument("--target", type=float, default=1.3, help="the step speedup asked for")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    record = read_result(args.source, "--source")
    rows, summary = bound(record, args.fp8_row, args.target)
    source = {k: record.get(k) for k in ("commit", "command", "device", "versions", "date")}
    write_result("fp8_step_bound", rows, summary, out=args.out, source={"file": Path(args.source).name, **source})


if __name__ == "__main__":
    main()
