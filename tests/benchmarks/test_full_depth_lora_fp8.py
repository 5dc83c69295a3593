"""benchmarks/full_depth_lora.py's float8-base row on CPU: its spec (ours_lora but `base_dtype: fp8`), its smoke run
(the conversion and matmul paths recorded), its summary keys and its refusal of a run that took no float8 base."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(_ROOT))

from benchmarks import full_depth_lora as fdl  # noqa: E402

_SPEC = dict(seq=64, preset="tiny", layers=2, dtype="float32", warmup=1, steps=2, smoke=True)
_FP8_KEYS = {f"fp8_base_lora_{k}_{t}" for k in ("vs_bf16_tps", "peak_mem_ratio") for t in ("8k", "16k")}


def test_the_fp8_row_is_ours_lora_with_a_float8_base_and_asked_for_by_name(tmp_path):
    """Its label names the one difference; its LoRA and CLI words are ours_lora's with `base_dtype: fp8`; the
    default --rows leaves it out."""
    assert "base_dtype: fp8" in fdl.ROWS["ours_lora_fp8base"] and "ours_lora" in fdl.ROWS["ours_lora_fp8base"]
    assert fdl.lora_of("ours_lora_fp8base") == {**fdl.LORA, "base_dtype": "fp8"}
    assert fdl.lora_of("ours_lora") == fdl.LORA and "base_dtype" not in fdl.LORA
    words = fdl.cli_args({**_SPEC, "row": "ours_lora_fp8base"}, tmp_path)
    ours = fdl.cli_args({**_SPEC, "row": "ours_lora"}, tmp_path)
    i = words.index("--model.init_args.lora") + 1
    assert words[:i] + words[i + 1:] == ours[:i] + ours[i + 1:]
    assert json.loads(words[i]) == {**json.loads(ours[i]), "base_dtype": "fp8"}
    from lightning_ffpa.cli import build

    assert build(words, run=False).model.hparams.lora["base_dtype"] == "fp8"
    assert "ours_lora_fp8base" not in fdl.parse_args([]).rows
    assert fdl.parse_args(["--rows", "ours_lora", "ours_lora_fp8base"]).rows == ["ours_lora", "ours_lora_fp8base"]


def test_all_linear_stores_every_decoder_linear_in_float8_and_leaves_the_tied_head():
    """The rows' `target_modules: all-linear` on the tiny preset: peft leaves the (tied) lm_head out, so
    quantize_lora_bases takes it, and every decoder Linear's base becomes float8."""
    import torch
    import transformers
    from torch import nn

    from lightning_ffpa.fp8_base import Float8BaseLinear, quantize_lora_bases
    from lightning_ffpa.lora import apply_lora
    from lightning_ffpa.presets import build_text_config

    cfg = build_text_config("tiny", **fdl.config_overrides({**_SPEC, "row": "ours_lora_fp8base"}))
    model = transformers.Gemma4ForCausalLM(cfg)
    assert model.lm_head.weight is model.get_input_embeddings().weight  # tied: a float8 head would be refused
    linears = sum(isinstance(m, nn.Linear) for m in model.model.layers.modules())
    peft = apply_lora(model, fdl.lora_of("ours_lora_fp8base"))
    report = quantize_lora_bases(peft)
    assert report["converted"] == linears > 0
    assert type(peft.get_base_model().lm_head) is nn.Linear
    assert peft.get_base_model().lm_head.weight.dtype == torch.float32
    assert sum(isinstance(m, Float8BaseLinear) for m in peft.modules()) == linears


@pytest.mark.timeout(200)
def test_the_fp8_row_records_its_conversion_and_matmul_paths_in_a_cpu_smoke_run(tmp_path):
    """The script's CPU smoke of the row (its own process, the CLI build): the start-up report (how many base
    weights became float8, the module's line, the path) and the timed steps' matmul path counts."""
    out = tmp_path / "fdl.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(_ROOT), os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1")
    cmd = [sys.executable, str(_ROOT / "benchmarks" / "full_depth_lora.py"), "--smoke", "--warmup", "1", "--steps",
           "2", "--rows", "ours_lora_fp8base", "--out", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    (row,) = result["rows"]
    assert "error" not in row, row.get("error")
    assert row["row"] == "ours_lora_fp8base" and row["lora"] == fdl.lora_of("ours_lora_fp8base")
    converted = row["fp8_base_conversion"]["converted"]
    assert converted > 0 and row["fp8_base_conversion"]["was_dtype"] == "float32"
    assert row["fp8_base_conversion"]["fp8_bytes"] < row["fp8_base_conversion"]["was_bytes"]
    assert row["fp8_base_startup"].startswith(f"lora.base_dtype fp8: {converted} LoRA base weights stored as "
                                              "float8_e4m3fn")
    assert row["fp8_base_matmul_path"][0] == "dequantize"
    # timed steps only (the warm-up's calls reset): every converted base once per forward, 2 steps, CPU's path
    assert row["fp8_base_paths"] == {"dequantize": 2 * converted}
    assert row["static_memory"]["params_by_dtype"]["torch.float8_e4m3fn"] > 0
    assert _FP8_KEYS <= set(result["summary"]) and all(result["summary"][k] is None for k in _FP8_KEYS)
    assert "row ours_lora at seq 8192 is not in this result" in result["summary_missing"]["fp8_base_lora_vs_bf16_tps_8k"]


def test_summary_gives_the_float8_base_ratios_and_why_one_is_missing():
    rows = [dict(row="ours_lora", seq=8192, tokens_per_s=2000.0, peak_mem_allocated_gb=90.0),
            dict(row="ours_lora_fp8base", seq=8192, tokens_per_s=2500.0, peak_mem_allocated_gb=54.0),
            dict(row="ours_lora", seq=16384, tokens_per_s=2400.0, peak_mem_allocated_gb=117.0),
            dict(row="ours_lora_fp8base", seq=16384, error="no float8 matmul (scaled_mm) ran on CUDA in the timed steps")]
    summary, missing = fdl.summarize(rows)
    assert summary["fp8_base_lora_vs_bf16_tps_8k"] == 1.25
    assert summary["fp8_base_lora_peak_mem_ratio_8k"] == 0.6
    assert "fp8_base_lora_vs_bf16_tps_8k" not in missing and "fp8_base_lora_peak_mem_ratio_8k" not in missing
    for key in ("fp8_base_lora_vs_bf16_tps_16k", "fp8_base_lora_peak_mem_ratio_16k"):
        assert summary[key] is None and "no float8 matmul (scaled_mm) ran" in missing[key]
    # CPU rows: tokens/s but no device memory
    summary, missing = fdl.summarize([{**r, "seq": 8192, "peak_mem_allocated_gb": None} for r in rows[:2]])
    assert summary["fp8_base_lora_vs_bf16_tps_8k"] == 1.25 and summary["fp8_base_lora_peak_mem_ratio_8k"] is None
    assert "recorded no peak_mem_allocated_gb" in missing["fp8_base_lora_peak_mem_ratio_8k"]
    summary, missing = fdl.summarize(rows[:1])
    assert "row ours_lora_fp8base at seq 8192 is not in this result" in missing["fp8_base_lora_vs_bf16_tps_8k"]


def test_a_row_labelled_fp8_that_ran_no_float8_matmul_is_an_error():
    conversion = {"converted": 420, "fp8_bytes": 1, "was_bytes": 2, "was_dtype": "bfloat16"}
    ok_gpu = dict(fp8_base_conversion=conversion, fp8_base_paths={"scaled_mm": 2100})
    assert fdl.fp8_base_error(ok_gpu, "cuda") is None
    assert fdl.fp8_base_error(dict(ok_gpu, fp8_base_paths={"dequantize": 840}), "cpu") is None
    # a bf16 run: nothing converted, or no float8-base call counted in the timed steps
    assert "no LoRA base weight was stored in float8" in fdl.fp8_base_error(dict(ok_gpu, fp8_base_conversion=None), "cuda")
    assert "no float8-base matmul ran" in fdl.fp8_base_error(dict(ok_gpu, fp8_base_paths={}), "cuda")
    # CUDA that only dequantised (activations not bf16, or forced): no float8 tensor-core matmul ran
    why = fdl.fp8_base_error(dict(ok_gpu, fp8_base_paths={"dequantize_fallback": 2100}), "cuda")
    assert "no float8 matmul (scaled_mm) ran on CUDA" in why and "dequantize_fallback" in why
