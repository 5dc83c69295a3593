"""benchmarks/full_depth_lora.py on CPU: rows in their own processes, ours through the CLI build, resume, LoRA FLOPs."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(_ROOT))

from benchmarks import full_depth_lora as fdl  # noqa: E402
from lightning_ffpa.errors import ConfigError  # noqa: E402

_SMOKE = ["--smoke", "--warmup", "1", "--steps", "2"]
_KEYS = {f"full_depth_lora_{k}_{t}" for t in ("8k", "16k") for k in (
    "ours_vs_sdpa_recipe_tps", "ours_vs_unsloth_tps", "ours_offload_vs_unsloth_tps",
    "ours_offload_replicated_vs_unsloth_tps", "peak_mem_gb_ours", "peak_mem_gb_ours_offload",
    "peak_mem_gb_ours_offload_replicated", "peak_mem_gb_sdpa_recipe", "peak_mem_gb_unsloth", "unsloth_baseline")} | {
    f"fp8_base_lora_{k}_{t}" for t in ("8k", "16k") for k in ("vs_bf16_tps", "peak_mem_ratio")} | {
    f"ours_vs_unsloth_shipped_recipe_tps_{t}" for t in ("8k", "16k")}


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("fdl") / "fdl.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(_ROOT), os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1")
    cmd = [sys.executable, str(_ROOT / "benchmarks" / "full_depth_lora.py"), *_SMOKE,
           "--rows", "ours_lora", "hf_peft_sdpa_recipe", "--profile", "ours_lora", "hf_peft_sdpa_recipe", "--out", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, json.loads(out.read_text())


@pytest.mark.timeout(300)
def test_rows_run_in_their_own_processes_and_ours_goes_through_the_cli(smoke_run):
    _, result = smoke_run
    rows = {r["row"]: r for r in result["rows"]}
    assert set(rows) == {"ours_lora", "hf_peft_sdpa_recipe"}
    assert not [(r.get("error"), r.get("log_tail")) for r in rows.values() if "error" in r]
    pids = {r["process"]["pid"] for r in rows.values()}
    assert len(pids) == 2 and os.getpid() not in pids  # one fresh process per row
    assert {r["process"]["parent_pid"] for r in rows.values()} != {os.getpid()}  # children of the script's driver
    for r in rows.values():
        assert r["seq"] == 64 and r["timed_steps"] == 2
        assert r["step_ms_min"] <= r["step_ms_median"] <= r["step_ms_max"]
        assert r["tokens_per_s"] == pytest.approx(64 / r["step_ms_median"] * 1e3)
        assert r["mfu_spec"] is None and r["peak_mem_allocated_gb"] is None  # CPU: no peak, no number
        # warm-up, 2 timed, 1 profiled (CPU: no CUDA kernels, the wall time of the extra step)
        assert len(r["losses"]) == 4 and all(0 < v < 20 for v in r["losses"])
        assert r["profile"]["wall_ms"] > 0 and r["profile"]["top_kernels"] == []
        assert r["gpu_clocks"] == {"unavailable": "device cpu: no GPU clocks"}  # sampled over the timed steps on a GPU
    ours, hf = rows["ours_lora"], rows["hf_peft_sdpa_recipe"]
    # ours: the shipped recipe built by the CLI, its checks and callbacks, no checkpoint written
    assert ours["built_by"] == "lightning_ffpa.cli.build" and ours["strategy"] == "FSDP2Strategy"
    assert ours["cli_args"][:2] == ["--config", str(fdl.CONFIG)]
    assert {"FFPAAttention", "TokenThroughput", "NonFiniteGuard"} <= set(ours["callbacks"])
    assert "ModelCheckpoint" not in ours["callbacks"] and ours["checkpoint_files"] == []
    assert ours["dropped_callbacks"] == ["lightning.pytorch.callbacks.ModelCheckpoint"]
    assert ours["global_step"] == 4 and ours["attn_implementation"] == "ffpa"
    # timed steps only: 2 steps x 1 full layer through FFPA (the CPU reference kernel), the sliding layer not
    assert ours["dispatch"]["ffpa-dense"] == 2 and ours["kernels"]["reference"] == 2
    assert ours["token_throughput_logged"]["train/device/items_per_sec"] > 0
    assert ours["activation_offload"] is None  # the offload row's strategy option is off in the recipe
    # HF + PEFT: the same FSDP2 recipe as ours, as run (the frozen base placed alike: kept out of FSDP2 on one GPU)
    assert hf["strategy_settings"] == ours["strategy_settings"]
    assert ours["strategy_settings"]["replicate_frozen"] == "auto"
    assert ours["strategy_settings"]["frozen_placement"]["replicated"] is True
    assert ours["strategy_settings"]["frozen_params_in_fsdp2"] == 0 < ours["strategy_settings"]["frozen_tensors"]
    # HF + PEFT: SDPA, no FFPA backend, the same adapters
    assert hf["attn_implementation"] == "sdpa" and sum(hf["dispatch"].values()) == 0
    assert ours["static_memory"]["trainable_params"] == hf["static_memory"]["trainable_params"] > 0
    assert ours["static_memory"]["frozen_params"] == hf["static_memory"]["frozen_params"]
    assert ours["lora_tflops_per_step"] == pytest.approx(hf["lora_tflops_per_step"])
    # no 8k/16k row ran: every key null, with why
    assert set(result["summary"]) == _KEYS and all(v is None for v in result["summary"].values())
    assert set(result["summary_missing"]) == _KEYS
    assert "unsloth_lora at seq 8192 is not in this result" in result["summary_missing"][
        "full_depth_lora_ours_vs_unsloth_tps_8k"]


def test_resume_keeps_finished_rows_and_refuses_other_settings(smoke_run, tmp_path):
    path, result = smoke_run
    out = tmp_path / "again.json"
    fdl.main([*_SMOKE, "--rows", "ours_lora", "hf_peft_sdpa_recipe", "--resume", str(path), "--out", str(out)])
    again = json.loads(out.read_text())
    assert [r["process"]["pid"] for r in again["rows"]] == [r["process"]["pid"] for r in result["rows"]]
    assert len(again["calls"]) == 2 and again["calls"][1]["rows"] == []  # nothing left to run
    with pytest.raises(ConfigError, match="--resume"):
        fdl.main(["--smoke", "--warmup", "1", "--steps", "3", "--resume", str(path), "--out", str(out)])


def test_summary_gives_ratios_and_reasons():
    rows = [dict(row="ours_lora", seq=8192, tokens_per_s=300.0, peak_mem_allocated_gb=90.0),
            dict(row="hf_peft_sdpa_recipe", seq=8192, tokens_per_s=200.0, peak_mem_allocated_gb=100.0),
            dict(row="unsloth_lora", seq=8192, error="import unsloth: ModuleNotFoundError: x")]
    summary, missing = fdl.summarize(rows)
    assert summary["full_depth_lora_ours_vs_sdpa_recipe_tps_8k"] == 1.5
    assert summary["full_depth_lora_peak_mem_gb_sdpa_recipe_8k"] == 100.0
    assert summary["full_depth_lora_ours_vs_unsloth_tps_8k"] is None
    assert "ModuleNotFoundError" in missing["full_depth_lora_ours_vs_unsloth_tps_8k"]
    assert "full_depth_lora_ours_vs_sdpa_recipe_tps_8k" not in missing
    # Unsloth's two checkpointing options: the faster is the baseline, its peak the one compared
    rows += [dict(row="unsloth_lora_gc", seq=8192, tokens_per_s=250.0, peak_mem_allocated_gb=80.0)]
    summary, _ = fdl.summarize(rows)
    assert summary["full_depth_lora_unsloth_baseline_8k"] == "unsloth_lora_gc"
    assert summary["full_depth_lora_ours_vs_unsloth_tps_8k"] == 1.2
    assert summary["ours_vs_unsloth_shipped_recipe_tps_8k"] == 1.2  # the recipe ships ours_lora (bf16 base)
    assert summary["full_depth_lora_peak_mem_gb_unsloth_8k"] == 80.0
    rows += [dict(row="unsloth_lora", seq=8192, tokens_per_s=275.0, peak_mem_allocated_gb=60.0)]  # a later one
    assert fdl.summarize(rows)[0]["full_depth_lora_unsloth_baseline_8k"] == "unsloth_lora"


def test_lora_flops_drop_only_the_frozen_weight_gradients():
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model

    from lightning_ffpa.callbacks.throughput import train_flops_per_batch
    from lightning_ffpa.presets import build_text_config

    cfg = build_text_config("tiny", num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"])
    with torch.device("meta"):
        base = transformers.Gemma4ForCausalLM(cfg)
    full, seq = train_flops_per_batch(base, 1, 64), 64
    matmul = sum(p.numel() for layer in base.model.layers for p in layer.parameters() if p.dim() == 2)
    matmul += base.lm_head.weight.numel()
    peft = get_peft_model(base, LoraConfig(task_type="CAUSAL_LM", **fdl.LORA))
    adapters = sum(p.numel() for p in peft.parameters() if p.requires_grad)
    # frozen matmuls: forward + input gradient (4 x params x tokens); adapters: 6 x; attention unchanged.
    # The rows count with the function TokenThroughput logs with (one count for both)
    assert train_flops_per_batch(peft.get_base_model(), 1, seq) == full - 2 * matmul * seq + 6 * adapters * seq


@pytest.mark.timeout(200)
def test_unsloth_row_imports_unsloth_first_in_its_own_process_and_records_what_it_tried(tmp_path):
    """The row's process (the script's child) has imported none of transformers, peft and trl when it imports
    Unsloth, which patches them; in a process that has (this one), the row is refused with one line, untimed."""
    from benchmarks.unsloth_row import measure_unsloth

    if importlib.util.find_spec("unsloth") is not None:
        pytest.skip("unsloth is installed here: the row would train")
    spec = dict(row="unsloth_lora", seq=64, preset="tiny", layers=2, dtype="float32", warmup=1, steps=2,
                smoke=True, lora=fdl.LORA)
    import transformers  # noqa: F401 - as in this test process

    refused = measure_unsloth(spec)
    assert refused["error"].startswith("import unsloth: ") and "Unsloth must come first" in refused["error"]
    assert refused["tried"] == [] and "transformers" in refused["imported_before_unsloth"]
    out = tmp_path / "u.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(_ROOT), os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(_ROOT / "benchmarks" / "full_depth_lora.py"), *_SMOKE, "--rows",
                           "unsloth_lora", "--out", str(out)], env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (row,) = json.loads(out.read_text())["rows"]
    assert row["imported_before_unsloth"] == []  # Unsloth came first in the row's process
    assert row["error"] == "import unsloth: ModuleNotFoundError: No module named 'unsloth'"
    assert [t["step"] for t in row["tried"]] == ["import unsloth"] and not row["tried"][0]["ok"]
    assert row["versions"]["unsloth"] is None and row["versions"]["torch"]


def test_a_row_killed_after_writing_its_row_keeps_its_measurement(tmp_path, monkeypatch):
    """The Unsloth row's case: the whole row measured and written, then a slow exit past the timeout. The live
    driver keeps it (how it ended in `process.exit`); an older file's re-summary (`--summarize`) does the same,
    while a row killed mid-measurement, or one whose child failed, stays without a measurement."""
    from benchmarks.row_process import KILLED_AFTER_ROW, run_row

    script = tmp_path / "slow_exit.py"
    script.write_text("import time\nfrom benchmarks.row_process import row_main\n\n"
                      "row_main(None, lambda spec: {'tokens_per_s': 5.0})\ntime.sleep(60)\n")
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).resolve().parents[2]))
    row = run_row(script, {"row": "unsloth_lora", "seq": 8192}, tmp_path / "row.log", 4.0)
    assert "error" not in row and row["process"]["exit"] == KILLED_AFTER_ROW and row["tokens_per_s"] == 5.0

    timeout = "timeout: the row's process was killed after 330 s (its log ends with the Python stacks it had then)"
    child = {"pid": 7, "parent_pid": 6, "rc": -9}
    rows = [dict(row="ours_lora", seq=8192, tokens_per_s=300.0, peak_mem_allocated_gb=90.0, process=child),
            dict(row="unsloth_lora", seq=8192, tokens_per_s=150.0, peak_mem_allocated_gb=60.0, process=child,
                 error=timeout),
            dict(row="ours_lora", seq=16384, process={"rc": -9}, error=timeout),  # killed before it wrote
            dict(row="unsloth_lora", seq=16384, tokens_per_s=1.0, process=child, error=timeout,
                 traceback_tail="Traceback ...")]  # the child's own failure, then the kill
    path = tmp_path / "old.json"
    path.write_text(json.dumps(dict(benchmark="full_depth_lora", rows=rows, summary={"x": None})))
    fdl.main(["--summarize", str(path)])
    record = json.loads(path.read_text())
    assert record["summary"]["full_depth_lora_ours_vs_unsloth_tps_8k"] == 2.0
    assert record["summary"]["full_depth_lora_ours_vs_unsloth_tps_16k"] is None
    assert "no measurement" in record["summary_missing"]["full_depth_lora_ours_vs_unsloth_tps_16k"]
    assert record["summary_recomputed"]["by"] == "full_depth_lora.py --summarize"
    assert record["summary_recomputed"]["summary_at_run"] == {"x": None} and record["rows"] == rows
    fdl.main(["--summarize", str(path)])  # again: what the run itself wrote is still the one kept
    assert json.loads(path.read_text())["summary_recomputed"]["summary_at_run"] == {"x": None}


def test_the_offload_row_is_the_recipe_with_full_ac_and_activation_offload(tmp_path):
    """Its CLI words are ours_lora's plus the strategy options (full AC, offload, the frozen base sharded) and the
    loss chunk; the CLI parses them, and a CPU run of them is refused by the pre-flight (nothing to offload
    from) with the option named."""
    spec = dict(row="ours_lora_offload", seq=64, preset="tiny", layers=2, dtype="float32", warmup=1, steps=2,
                smoke=True)
    words, recipe = fdl.cli_args(spec, tmp_path), fdl.cli_args({**spec, "row": "ours_lora"}, tmp_path)
    extra = ["--trainer.strategy.init_args.activation_checkpointing", "full",
             "--trainer.strategy.init_args.activation_offload", "true", "--model.init_args.loss_chunk_size", "1024",
             "--trainer.strategy.init_args.replicate_frozen", "false"]
    assert sorted(words) == sorted(recipe + extra)
    from lightning_ffpa.cli import build
    from lightning_ffpa.validation import preflight

    cli = build(words, run=False)
    assert cli.trainer.strategy.activation_offload and cli.trainer.strategy.activation_checkpointing == "full"
    assert cli.model.hparams.loss_chunk_size == 1024
    with pytest.raises(ValueError, match="`trainer.strategy.init_args.activation_offload=True` moves saved activations from cuda"):
        preflight(cli.trainer, cli.model, cli.datamodule, None)


def test_the_replicated_offload_row_adds_only_replicate_frozen(tmp_path):
    """Its CLI words are the offload row's with `replicate_frozen` auto for false, which the CLI parses into the
    strategy (the offload row pins false: the product's default is auto)."""
    spec = dict(row="ours_lora_offload_replicated", seq=64, preset="tiny", layers=2, dtype="float32", warmup=1,
                steps=2, smoke=True)
    words, offload = fdl.cli_args(spec, tmp_path), fdl.cli_args({**spec, "row": "ours_lora_offload"}, tmp_path)
    flag = "--trainer.strategy.init_args.replicate_frozen"
    assert offload[offload.index(flag) + 1] == "false" and words[words.index(flag) + 1] == "auto"
    i = words.index(flag) + 1
    assert words[:i] + ["false"] + words[i + 1:] == offload
    from lightning_ffpa.cli import build

    assert build(words, run=False).trainer.strategy.replicate_frozen == "auto"
    assert build(offload, run=False).trainer.strategy.replicate_frozen is False


def test_the_hf_peft_row_takes_ours_strategy_options_from_the_recipe(tmp_path):
    """The HF + PEFT row's FSDP2Strategy options are the ones ours_lora's CLI parses into its strategy (the
    recipe's, with this run's overrides): `replicate_frozen` among them, which the row once left at False."""
    from lightning_ffpa.cli import build
    from lightning_ffpa.parallel import FSDP2Strategy

    for smoke, dtype in ((True, "float32"), (False, "bfloat16")):
        spec = dict(row="hf_peft_sdpa_recipe", seq=64, preset="tiny", layers=2, dtype=dtype, warmup=1, steps=2,
                    smoke=smoke)
        options = fdl.strategy_init_args(spec)
        assert options["replicate_frozen"] == "auto" and options["compile"] is not smoke
        words = fdl.cli_args({**spec, "row": "ours_lora"}, tmp_path)
        words += [] if smoke else ["--trainer.accelerator", "cpu"]  # parsed here without a GPU; no strategy option
        ours = build(words, run=False).trainer.strategy
        built = FSDP2Strategy(**options)
        for name in ("activation_checkpointing", "sac_save_mm", "sac_extra_save_ops", "param_dtype", "reduce_dtype",
                     "reshard_after_forward", "cpu_offload", "replicate_frozen", "activation_offload", "compile",
                     "context_parallel_size"):
            assert getattr(built, name) == getattr(ours, name), name


def test_profile_names_only_rows_that_run():
    """A --profile row that --rows does not run is one line naming the option (it was silently never profiled)."""
    with pytest.raises(ConfigError, match="--profile"):
        fdl.parse_args(["--smoke", "--rows", "ours_lora", "--profile", "hf_peft_sdpa_recipe"])
    assert fdl.parse_args(["--smoke", "--rows", "ours_lora", "--profile", "ours_lora"]).profile == ["ours_lora"]
