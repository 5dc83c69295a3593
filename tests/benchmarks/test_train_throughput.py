"""benchmarks/train_throughput.py on CPU: the driver runs each row in its own process, resumes, and summarizes."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(_ROOT))

from benchmarks import train_throughput as tt  # noqa: E402
from lightning_ffpa.errors import ConfigError  # noqa: E402

_SMOKE = ["--cpu", "--preset", "tiny", "--layers", "2", "--seqs", "128", "--warmup", "1", "--steps", "1"]
_KEYS = {f"ours_vs_{b}_tps_{k}" for b in ("sdpa_recipe", "flex_recipe", "ours_sdpa_d512") for k in ("8k", "16k", "32k")} | {
    f"ours_sdpa_d512_vs_sdpa_recipe_tps_{k}" for k in ("8k", "16k", "32k")} | {
    f"sliding_path_step_gain_{k}" for k in ("8k", "16k", "32k")} | {
    f"{key}_{k}" for key in ("fp8_full_ft_vs_bf16_tps", "fp8_full_ft_recipe", "fp8_full_ft_peak_mem_gb",
                             "ours_peak_mem_gb", "ours_mfu_bf16eq_spec") for k in ("8k", "16k", "32k")} | {
    "ours_vs_liger_tps_8k", "ours_vs_sdpa_defaults_tps_8k", "ours_mfu_spec_16k", "ours_mfu_measured_peak_16k"}


def _drive(out, rows, launcher=(sys.executable,), extra=()):
    cmd = [*launcher, str(_ROOT / "benchmarks" / "train_throughput.py"), *_SMOKE, "--rows", *rows,
           "--out", str(out), *extra]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(_ROOT), os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.timeout(300)
def test_rows_run_in_their_own_processes_and_resume_keeps_them(tmp_path):
    out = tmp_path / "tt.json"
    result = _drive(out, ["sdpa_defaults", "ours_nocompile"], extra=["--profile", "ours_nocompile"])
    rows = {r["row"]: r for r in result["rows"]}
    assert set(rows) == {"sdpa_defaults", "ours_nocompile"}
    assert not [r["error"] for r in rows.values() if "error" in r]
    assert len({r["pid"] for r in rows.values()} | {os.getpid()}) == 3  # one fresh process per row
    for r in rows.values():
        assert r["step_ms_min"] <= r["step_ms_median"] <= r["step_ms_max"]
        assert r["tokens_per_s_per_gpu"] == pytest.approx(128 / r["step_ms_median"] * 1e3)
        assert 0 < r["lm_head_flops_share"] < 1 and 0 < r["last_loss"] < 20
        assert 0 < r["decoder_linear_flops_share"] < 1 - r["lm_head_flops_share"]  # attention takes the rest
        assert r["mfu_spec"] is None and r["mfu_measured_peak"] is None  # no peak on CPU: no number
        assert {"peak_mem_allocated_gb", "peak_mem_reserved_gb", "memory_phases", "label", "wall_s"} <= set(r)
        assert r["gpu_clocks"] == {"unavailable": "device cpu: no GPU clocks"}  # sampled on a GPU, else why not
    assert rows["ours_nocompile"]["profile"]["wall_ms"] > 0 and "profile" not in rows["sdpa_defaults"]
    assert rows["ours_nocompile"]["optim"] == "product" and rows["sdpa_defaults"]["optim"] == "adamw_default"
    assert rows["ours_nocompile"]["save_mm"] == result["ours_sac_save_mm"]
    assert set(result["summary"]) == _KEYS
    assert all(v is None for v in result["summary"].values())  # no 8k/16k row ran: every key null, with why
    assert set(result["summary_missing"]) == _KEYS
    assert "not in this result" in result["summary_missing"]["ours_vs_sdpa_defaults_tps_8k"]
    assert len(result["calls"]) == 1

    # A second call resumes the file: the finished rows stay, only the new row runs (driver in this process).
    tt.main([*_SMOKE, "--rows", "sdpa_defaults", "liger_recipe", "--out", str(out), "--resume", str(out)])
    again = json.loads(out.read_text())
    assert [r["row"] for r in again["rows"]] == ["sdpa_defaults", "ours_nocompile", "liger_recipe"]
    assert again["rows"][0] == result["rows"][0]
    assert len(again["calls"]) == 2 and again["calls"][1]["rows"] == ["liger_recipe@128"]
    liger = again["rows"][2]
    logs = out.parent / f"{out.stem}_logs"
    assert "1 timed steps, median" in (logs / "sdpa_defaults_128.log").read_text()  # progress, for killed rows
    assert len(result["rows"][0]["warmup_step_s"]) == 1 and result["rows"][0]["build_s"] > 0
    if importlib.util.find_spec("liger_kernel") is None:
        assert liger["error"] == "ModuleNotFoundError: No module named 'liger_kernel'"
        # A failed row runs again in the next call; the failed attempt's log stays beside the new one.
        tt.main([*_SMOKE, "--rows", "liger_recipe", "--out", str(out), "--resume", str(out)])
        assert {p.name for p in logs.glob("liger_recipe_128*.log")} == {"liger_recipe_128.log",
                                                                         "liger_recipe_128.1.log"}


def _args(*extra):
    return tt.parse_args([*_SMOKE, *extra])


def test_plan_is_seq_major_and_leaves_out_finished_rows():
    args = _args("--rows", "ours", "flex_recipe", "--seqs", "128", "256")
    assert tt.plan(args, set()) == [("ours", 128), ("flex_recipe", 128), ("ours", 256), ("flex_recipe", 256)]
    assert tt.plan(args, {("ours", 128)}) == [("flex_recipe", 128), ("ours", 256), ("flex_recipe", 256)]


def test_flex_row_sweeps_its_option_sets_at_the_op_and_uses_the_fastest():
    """CPU: every LARGE_HEAD_DIM_CANDIDATES set is timed on the preset's full-attention op (forward on CPU,
    forward + backward on CUDA); the fastest index is returned."""
    import torch

    from benchmarks import train_rows
    from lightning_ffpa.flex_options import LARGE_HEAD_DIM_CANDIDATES

    best, records = train_rows.sweep_flex_options(128, torch.device("cpu"), "tiny", warmup=0, iters=1)
    assert [r["index"] for r in records] == list(range(len(LARGE_HEAD_DIM_CANDIDATES)))
    assert all(r["ms"] > 0 and r["options"] == LARGE_HEAD_DIM_CANDIDATES[r["index"]] for r in records)
    assert best == min(records, key=lambda r: r["ms"])["index"]


def test_flex_rows_build_their_block_masks_before_the_layers(monkeypatch):
    """The flex rows' attention gets a BlockMask from the mask interface, built once per forward and layer
    type (not per layer: a mask built inside a compiled layer is traced into every layer's graph)."""
    import torch
    import transformers
    from torch.nn.attention.flex_attention import BlockMask

    from benchmarks import train_rows
    from lightning_ffpa._compat import transformers as hf_compat
    from lightning_ffpa.attention import flex, masks
    from lightning_ffpa.presets import build_text_config

    built, seen = [], []
    build = masks.build_block_mask
    monkeypatch.setattr(masks, "build_block_mask", lambda *a, **k: built.append(a[2]) or build(*a, **k))
    forward = flex.flex_forward

    def recorded(q, k, v, bm, *args, **kwargs):
        seen.append(bm)
        return forward(q, k, v, bm, *args, **kwargs)

    monkeypatch.setattr(flex, "flex_forward", recorded)
    train_rows.register_baselines(None)
    cfg = build_text_config("tiny", num_hidden_layers=4)
    model = transformers.Gemma4ForCausalLM(cfg).eval()
    hf_compat.set_attn_implementation(model, "flex")
    with torch.no_grad():
        model(input_ids=torch.randint(0, cfg.vocab_size, (1, 64)), use_cache=False)
    assert sorted(set(cfg.layer_types)) == ["full_attention", "sliding_attention"]
    assert built == [64, 64]  # one mask per layer type
    assert len(seen) == 4 and all(isinstance(bm, BlockMask) for bm in seen)


def test_summary_ratios_and_reasons():
    rows = [dict(row="ours", seq=8192, tokens_per_s_per_gpu=300.0),
            dict(row="sdpa_recipe", seq=8192, tokens_per_s_per_gpu=200.0),
            dict(row="liger_recipe", seq=8192, error="ModuleNotFoundError: No module named 'liger_kernel'"),
            dict(row="ours", seq=16384, tokens_per_s_per_gpu=1.0, mfu_spec=0.5, mfu_measured_peak=0.6)]
    summary, missing = tt.summarize(rows)
    assert set(summary) == _KEYS
    assert summary["ours_vs_sdpa_recipe_tps_8k"] == 1.5 and "ours_vs_sdpa_recipe_tps_8k" not in missing
    assert summary["ours_vs_liger_tps_8k"] is None
    assert "no measurement: ModuleNotFoundError" in missing["ours_vs_liger_tps_8k"]
    assert (summary["ours_mfu_spec_16k"], summary["ours_mfu_measured_peak_16k"]) == (0.5, 0.6)
    assert {k for k, v in summary.items() if v is None} == set(missing)
    # the faster of the compiled and eager Liger rows is the baseline
    rows[2] = dict(row="liger_recipe", seq=8192, tokens_per_s_per_gpu=100.0)
    rows.append(dict(row="liger_recipe_nocompile", seq=8192, tokens_per_s_per_gpu=150.0))
    assert tt.summarize(rows)[0]["ours_vs_liger_tps_8k"] == 2.0 and tt.fastest_row(rows, tt.LIGER_ROWS, 8192, "tokens_per_s_per_gpu")[0] is rows[-1]


def test_the_sdpa_d512_row_splits_the_same_recipe_ratio_by_kernel():
    """ours / ours_sdpa_d512 (FFPA's share) times ours_sdpa_d512 / sdpa_recipe (the sliding path's) is ours /
    sdpa_recipe, per sequence length; a missing row leaves its keys null with the reason."""
    rows = [dict(row="ours", seq=16384, tokens_per_s_per_gpu=300.0),
            dict(row="ours_sdpa_d512", seq=16384, tokens_per_s_per_gpu=250.0),
            dict(row="sdpa_recipe", seq=16384, tokens_per_s_per_gpu=200.0)]
    summary, missing = tt.summarize(rows)
    assert summary["ours_vs_ours_sdpa_d512_tps_16k"] == 1.2
    assert summary["ours_sdpa_d512_vs_sdpa_recipe_tps_16k"] == 1.25
    assert summary["ours_vs_ours_sdpa_d512_tps_16k"] * summary["ours_sdpa_d512_vs_sdpa_recipe_tps_16k"] == \
        pytest.approx(summary["ours_vs_sdpa_recipe_tps_16k"])
    assert "ours_sdpa_d512 at seq 8192 is not in this result" in missing["ours_sdpa_d512_vs_sdpa_recipe_tps_8k"]


def test_the_sdpa_d512_row_is_ours_with_sdpa_on_the_d512_layers_only(monkeypatch):
    """ours_sdpa_d512 is ours' spec with another attention. In a forward of a tiny Gemma4 (2 sliding, 2 full
    layers) its D=512 layers call HF's SDPA (as sdpa_recipe does) and its sliding layers take ours' Flex path, the
    same calls ours makes; its logits equal ours' (the FFPA op's CPU reference on the D=512 layers)."""
    import torch
    import transformers
    from transformers.integrations import sdpa_attention

    from benchmarks import train_rows
    from lightning_ffpa import attention
    from lightning_ffpa._compat import transformers as hf_compat
    from lightning_ffpa.attention import kernels, register_ffpa
    from lightning_ffpa.presets import build_text_config

    same = {k: v for k, v in train_rows.ROWS["ours_sdpa_d512"].items() if k not in ("attn", "label")}
    assert same == {k: v for k, v in train_rows.ROWS["ours"].items() if k not in ("attn", "label")}
    assert "ours_sdpa_d512" in train_rows.DEFAULT_ROWS
    hf_sdpa, original = [], sdpa_attention.sdpa_attention_forward

    def recorded(module, query, *args, **kwargs):
        hf_sdpa.append((query.shape[-1], args[2] is None))  # head dim, and no mask (causal, as sdpa_recipe runs)
        return original(module, query, *args, **kwargs)

    monkeypatch.setattr(sdpa_attention, "sdpa_attention_forward", recorded)
    train_rows.register_baselines(None)
    register_ffpa()
    cfg = build_text_config("tiny")  # sliding, full, sliding, full
    assert cfg.layer_types.count("full_attention") == 2
    torch.manual_seed(0)
    model = transformers.Gemma4ForCausalLM(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, 64))
    logits, counts = {}, {}
    for attn in ("ffpa", "sdpa_d512_ours_sliding"):
        hf_compat.set_attn_implementation(model, attn)
        attention.reset_dispatch_counts()
        with torch.no_grad(), kernels.force_kernel("reference"):
            logits[attn] = model(input_ids=ids, use_cache=False).logits
        counts[attn] = {k: v for k, v in attention.dispatch_counts().items() if v}
    assert counts["ffpa"] == {"ffpa-dense": 2, "flex": 2}
    assert counts["sdpa_d512_ours_sliding"] == {"sdpa": 2, "flex": 2}
    assert hf_sdpa == [(512, True), (512, True)]
    torch.testing.assert_close(logits["sdpa_d512_ours_sliding"], logits["ffpa"], rtol=1e-4, atol=1e-4)


def test_resume_refuses_another_shape(tmp_path):
    old = tmp_path / "old.json"
    old.write_text(json.dumps(dict(benchmark="train_throughput", rows=[], summary={}, commit="x", preset="tiny",
                                   layers=2, warmup=1, steps=1, dp=1)))
    with pytest.raises(ConfigError, match="--resume.*other settings"):
        tt.load_resume(_args("--resume", str(old)))



def test_resume_keeps_rows_killed_only_after_writing_themselves(tmp_path):
    from benchmarks.report import results_io

    shape = dict(preset="tiny", layers=2)
    rows = [dict(row="ours", seq=64, tokens_per_s_per_gpu=1.0),
            dict(row="flex_recipe", seq=64, tokens_per_s_per_gpu=2.0, process={"pid": 7},  # an older file's record
                 error="timeout: the row's process was killed after 500 s"),
            dict(row="sdpa_recipe", seq=64, error="RuntimeError: CUDA out of memory"),
            dict(row="sdpa_defaults", seq=64, skipped="budget")]
    old = tmp_path / "old.json"
    old.write_text(json.dumps(dict(benchmark="train_throughput", rows=rows, summary={}, commit=results_io._commit(),
                                   **shape)))
    kept, _ = results_io.load_resume(str(old), shape)
    assert [r["row"] for r in kept] == ["ours", "flex_recipe"]

def test_gpu_runs_time_at_least_five_steps():
    with pytest.raises(ConfigError, match="--steps"):
        tt.parse_args(["--steps", "3"])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_benchmark_dp2_on_cpu(tmp_path):
    result = _drive(tmp_path / "tt.json", ["sdpa_defaults"], extra=["--dp", "2"])
    assert result["dp"] == 2
    assert not [r["error"] for r in result["rows"] if "error" in r]


def test_kernel_summary_counts_overlap_once():
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


def test_the_fa4_sliding_row_is_ours_with_fa4_on_the_sliding_layers(monkeypatch):
    """ours_fa4_sliding is ours' spec with sliding='fa4', opt-in. Its kernel is resolved as the FFPAAttention
    Callback resolves `sliding: fa4`: refused where FA4 cannot run (here CPU), never Flex under its name. With FA4's
    CPU stand-in, a forward of a tiny Gemma4 sends its sliding layers to FA4 (counted), with ours' logits."""
    import torch
    import transformers

    from benchmarks import train_rows
    from lightning_ffpa import attention
    from lightning_ffpa._compat import transformers as hf_compat
    from lightning_ffpa.attention import fa4, kernels, register_ffpa
    from lightning_ffpa.presets import build_text_config

    spec = train_rows.ROWS["ours_fa4_sliding"]
    assert {k: v for k, v in spec.items() if k not in ("sliding", "label")} == \
        {k: v for k, v in train_rows.ROWS["ours"].items() if k != "label"}
    assert spec["sliding"] == "fa4" and "FA4" in spec["label"] and "ours_fa4_sliding" not in train_rows.DEFAULT_ROWS
    cpu = torch.device("cpu")
    cfg = build_text_config("tiny")  # sliding, full, sliding, full
    with pytest.raises(ConfigError, match="FFPAAttention.sliding.*flash-attn-4 cannot run here"):
        train_rows.sliding_kernel(spec, cpu, cfg)
    assert train_rows.sliding_kernel(train_rows.ROWS["ours"], cpu, cfg) == "flex"
    torch.manual_seed(0)
    model = transformers.Gemma4ForCausalLM(cfg).eval()
    hf_compat.set_attn_implementation(model, "ffpa")
    ids = torch.randint(0, cfg.vocab_size, (1, 64))
    logits, counts = {}, {}
    try:
        with fa4.cpu_stand_in():
            for name in ("ours", "ours_fa4_sliding"):
                register_ffpa(sliding=train_rows.sliding_kernel(train_rows.ROWS[name], cpu, cfg))
                attention.reset_dispatch_counts()
                with torch.no_grad(), kernels.force_kernel("reference"):
                    logits[name] = model(input_ids=ids, use_cache=False).logits
                counts[name] = ({k: v for k, v in attention.dispatch_counts().items() if v},
                                attention.fallback_counts())
    finally:
        register_ffpa(sliding="flex")  # the process-wide backend config goes back to the default
    assert counts["ours"] == ({"ffpa-dense": 2, "flex": 2}, {})
    assert counts["ours_fa4_sliding"] == ({"ffpa-dense": 2, "fa4-dense": 2}, {})
    torch.testing.assert_close(logits["ours_fa4_sliding"], logits["ours"], rtol=1e-4, atol=1e-4)
    assert train_rows.sliding_path_error(spec, *counts["ours_fa4_sliding"]) is None
    assert train_rows.sliding_path_error(train_rows.ROWS["ours"], *counts["ours"]) is None


def test_an_fa4_row_whose_calls_fell_back_to_flex_is_an_error():
    from benchmarks import train_rows

    spec = train_rows.ROWS["ours_fa4_sliding"]
    why = train_rows.sliding_path_error(spec, {"ffpa-dense": 2, "fa4-dense": 0, "flex": 2}, {"fa4_unavailable": 2})
    assert why and "fa4" in why and "fa4_unavailable" in why
    assert train_rows.sliding_path_error(spec, {"ffpa-dense": 2, "fa4-dense": 1, "flex": 1}, {"fa4_dtype": 1})
    assert train_rows.sliding_path_error(spec, {"ffpa-dense": 2, "fa4-dense": 2}, {}) is None


def test_sliding_path_step_gain_is_the_fa4_rows_tokens_over_ours():
    rows = [dict(row="ours", seq=8192, tokens_per_s_per_gpu=200.0),
            dict(row="ours_fa4_sliding", seq=8192, tokens_per_s_per_gpu=210.0),
            dict(row="ours", seq=16384, tokens_per_s_per_gpu=100.0),
            dict(row="ours_fa4_sliding", seq=16384, error="ConfigError: FFPAAttention.sliding: fa4: flash-attn-4 ...")]
    summary, missing = tt.summarize(rows)
    assert summary["sliding_path_step_gain_8k"] == pytest.approx(1.05)
    assert summary["sliding_path_step_gain_16k"] is None
    assert "ours_fa4_sliding at seq 16384 has no measurement: ConfigError" in missing["sliding_path_step_gain_16k"]
    assert "not in this result" in missing["sliding_path_step_gain_32k"]


def test_the_fp8_rows_are_ours_with_only_the_strategys_fp8_option_changed():
    import torch

    from benchmarks import train_rows

    ours = train_rows.ROWS["ours"]
    assert train_rows.FP8_ROWS == ("ours_fp8_rowwise", "ours_fp8_tensorwise")
    for name, recipe in zip(train_rows.FP8_ROWS, ("rowwise", "tensorwise")):
        spec = train_rows.ROWS[name]
        assert {k: v for k, v in spec.items() if k not in ("fp8", "label")} == \
            {k: v for k, v in ours.items() if k != "label"}
        assert spec["fp8"] == recipe and f"ours with FSDP2Strategy(fp8='{recipe}')" in spec["label"]
        assert "lm_head and embeddings stay bf16" in spec["label"] and name not in train_rows.DEFAULT_ROWS
        # a GPU row never emulates (below SM89 it fails); only the CPU smoke run emulates, and times nothing
        assert train_rows.row_fp8(spec, torch.device("cuda")) == train_rows.Float8Training(recipe, emulate=False)
        assert train_rows.row_fp8(spec, torch.device("cpu")) == train_rows.Float8Training(recipe, emulate=True)
    assert not train_rows.row_fp8(ours, torch.device("cuda")).enabled


def test_an_fp8_row_without_torchao_fails_with_the_strategys_one_line_before_building(monkeypatch):
    """Never a silent bf16 row: the row's build stops at the strategy's refusal (here: no torchao), before any
    model exists."""
    import torch

    from benchmarks import train_rows
    from lightning_ffpa.parallel import fp8

    monkeypatch.setattr(fp8, "torchao_available", lambda: False)
    monkeypatch.setattr(train_rows, "build_text_config", lambda *a, **k: pytest.fail("built past the refusal"))
    with pytest.raises(ConfigError, match=r"fp8.*rowwise.*needs torchao"):
        train_rows.build_model(train_rows.ROWS["ours_fp8_rowwise"], None, 2, torch.device("cpu"), "tiny")


def test_an_fp8_row_that_converted_nothing_fails_loudly():
    import transformers

    from benchmarks import train_rows
    from lightning_ffpa.presets import build_text_config

    model = transformers.Gemma4ForCausalLM(build_text_config("tiny"))
    rowwise = train_rows.Float8Training("rowwise", emulate=True)
    with pytest.raises(RuntimeError, match="0 converted modules and the model holds 0 Float8Linear"):
        train_rows.fp8_layout(model, rowwise)
    model.fp8_layout = {"converted": ["0.mlp.up_proj"], "kept": []}  # recorded, yet no module was swapped
    with pytest.raises(RuntimeError, match="1 converted modules and the model holds 0 Float8Linear"):
        train_rows.fp8_layout(model, rowwise)
    assert train_rows.fp8_layout(model, train_rows.Float8Training()) == {}  # a bf16 row records nothing


@pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="torchao is the fp8 extra")
def test_an_fp8_rows_layout_counts_the_converted_modules():
    import transformers

    from benchmarks import train_rows
    from lightning_ffpa.parallel import parallelize
    from lightning_ffpa.presets import build_text_config

    model = transformers.Gemma4ForCausalLM(build_text_config("tiny"))
    rowwise = train_rows.Float8Training("rowwise", emulate=True)
    parallelize(model, None, fp8=rowwise)
    layout = train_rows.fp8_layout(model, rowwise)
    assert layout["fp8_converted"] == len(model.fp8_layout["converted"]) > 0
    assert layout["lm_head_type"] == "Linear" and layout["fp8_emulate"] and not layout["fp8_float8_all_gather"]


def test_the_fp8_summary_takes_the_faster_recipe_against_ours():
    rows = [dict(row="ours", seq=16384, tokens_per_s_per_gpu=100.0, peak_mem_allocated_gb=70.0, mfu_spec=0.44),
            dict(row="ours_fp8_rowwise", seq=16384, fp8="rowwise", tokens_per_s_per_gpu=120.0,
                 peak_mem_allocated_gb=66.0, mfu_spec=0.528),
            dict(row="ours_fp8_tensorwise", seq=16384, fp8="tensorwise", tokens_per_s_per_gpu=135.0,
                 peak_mem_allocated_gb=64.0, mfu_spec=0.594),
            dict(row="ours", seq=8192, tokens_per_s_per_gpu=100.0, peak_mem_allocated_gb=69.0, mfu_spec=0.41),
            dict(row="ours_fp8_rowwise", seq=8192, fp8="rowwise", tokens_per_s_per_gpu=110.0,
                 peak_mem_allocated_gb=65.0, mfu_spec=0.45),
            dict(row="ours_fp8_tensorwise", seq=8192, fp8="tensorwise",
                 error="ConfigError: fp8: 'tensorwise': needs FP8 tensor cores (CUDA capability >= 8.9)")]
    summary, missing = tt.summarize(rows)
    assert summary["fp8_full_ft_vs_bf16_tps_16k"] == pytest.approx(1.35)
    assert summary["fp8_full_ft_recipe_16k"] == "tensorwise"
    assert (summary["fp8_full_ft_peak_mem_gb_16k"], summary["ours_peak_mem_gb_16k"]) == (64.0, 70.0)
    assert summary["ours_mfu_bf16eq_spec_16k"] == 0.594
    # a failed recipe row is not a candidate: the other one is compared, and the failure stays in its row
    assert summary["fp8_full_ft_vs_bf16_tps_8k"] == pytest.approx(1.1) and summary["fp8_full_ft_recipe_8k"] == "rowwise"
    assert "fp8_full_ft_vs_bf16_tps_16k" not in missing and "ours_mfu_bf16eq_spec_8k" not in missing
    assert summary["fp8_full_ft_vs_bf16_tps_32k"] is None
    assert "ours_fp8_rowwise at seq 32768 is not in this result" in missing["fp8_full_ft_vs_bf16_tps_32k"]
    rows[-2] = dict(rows[-2], error="RuntimeError: fp8=rowwise: parallelize recorded 0 converted modules")
    summary, missing = tt.summarize(rows)
    assert summary["fp8_full_ft_vs_bf16_tps_8k"] is None and summary["ours_mfu_bf16eq_spec_8k"] is None
    assert "recorded 0 converted modules" in missing["fp8_full_ft_vs_bf16_tps_8k"]
    assert "needs FP8 tensor cores" in missing["fp8_full_ft_recipe_8k"]
    assert summary["ours_peak_mem_gb_8k"] == 69.0
