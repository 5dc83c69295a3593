"""fp8_step_bound: the FP8 step's breakdown and bounds from two profiled rows (synthetic kernels, CPU)."""

import json

import pytest

from benchmarks.fp8_step_bound import main
from lightning_ffpa.errors import ConfigError


def _row(name, step_ms, kernels, **kw):
    top = [{"name": n, "calls": 1, "total_ms": ms} for n, ms in kernels]
    total = sum(ms for _, ms in kernels)
    return {"row": name, "seq": 16384, "step_ms_median": step_ms, **kw,
            "profile": {"wall_ms": step_ms, "cuda_busy_ms": total, "cuda_kernel_total_ms": total, "num_kernels": 3,
                        "top_kernels": top}}


def _source(tmp_path):
    rows = [_row("ours", 1000.0, [("nvjet_sm90_tst_192x192_NNN", 600.0), ("kernel_ffpa_fwd", 200.0)]),
            _row("ours_fp8_tensorwise", 900.0, [("nvjet_sm90_qqtst_128x160_TNT", 200.0),
                                                ("nvjet_sm90_tst_192x192_NNN", 200.0),
                                                ("triton_poi_fused__scaled_mm_abs_clamp", 100.0),
                                                ("kernel_ffpa_fwd", 200.0)], fp8="tensorwise")]
    path = tmp_path / "src.json"
    path.write_text(json.dumps({"benchmark": "train_throughput", "commit": "abc", "rows": rows, "summary": {}}))
    return path


def test_breakdown_and_bounds(tmp_path):
    out = tmp_path / "bound.json"
    main(["--source", str(_source(tmp_path)), "--out", str(out)])
    s = json.loads(out.read_text())["summary"]
    assert s["fp8_converted_gemm_bf16_ms"] == 400.0 and s["fp8_converted_gemm_float8_ms"] == 200.0
    assert s["fp8_gemm_speedup"] == 2.0 and s["fp8_gemm_saving_ms"] == 200.0
    assert s["fp8_step_saving_ms"] == 100.0 and s["fp8_added_outside_gemms_ms"] == 100.0
    assert s["fp8_bound_free_casts"] == pytest.approx(1000 / 800)  # Amdahl over the converted GEMMs
    assert s["fp8_bound_all_matmuls_float8"] == pytest.approx(1000 / 800)  # 900 - 200 / 2
    assert s["fp8_target_within_free_cast_bound"] is False


def test_a_row_without_a_profile_is_named(tmp_path):
    with pytest.raises(ConfigError, match="`--fp8-row='ours_fp8_rowwise'`: has no profiled row"):
        main(["--source", str(_source(tmp_path)), "--fp8-row", "ours_fp8_rowwise", "--out", str(tmp_path / "o")])
