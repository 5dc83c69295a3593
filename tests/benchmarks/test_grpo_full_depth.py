"""CPU smoke of benchmarks/grpo_full_depth.py: the recipe fit through the console script, its steps read back
from the CSV logger, the first step left out of the medians, the decode roofline's byte count (the weights as the fit
stores them, a float8 base included), and the recount of a recorded file."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # `benchmarks` is a folder of scripts
from benchmarks import grpo_full_depth  # noqa: E402


@pytest.mark.timeout(240)
def test_tiny_recipe_row_reads_every_step_and_times_all_but_the_first(tmp_path):
    out = tmp_path / "r.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "grpo_full_depth.py"), "--recipe", "tiny_grpo", "--preset",
           "tiny", "--lengths", "6", "--steps", "3", "--prompt-len", "4", "--page-size", "8", "--logs",
           str(tmp_path), "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=220, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    record = json.loads(out.read_text())
    (row,) = record["rows"]
    assert row["exit_code"] == 0 and "--trainer.callbacks.init_args.sampling.max_new_tokens 6" in row["command"]
    assert [s["step"] for s in row["steps"]] == [0, 1, 2]
    for step in row["steps"]:
        assert step["rollout/generate_s"] > 0 and step["rollout/update_s"] > 0
        assert step["rollout/decode_steps"] >= 5  # 6 new tokens: the prefill samples the first
    assert row["step_s"]["n"] == 2  # the first step (capture, compile) is not timed
    parts = [s["rollout/refresh_s"] + s["rollout/generate_s"] + s["rollout/update_s"] for s in row["steps"][1:]]
    assert row["step_s"]["median"] == pytest.approx(sum(parts) / 2)
    assert row["completion_tokens_per_s"] > 0 and record["summary"]["grpo_full_depth_fits_6"] is True
    assert "`model.lora=None`" in row["memory_estimate_error"]  # tiny_grpo trains every weight: no LoRA estimate
    first = (tmp_path / "grpo_full_depth_6.log").read_text().splitlines()[0]  # the log opens with the command
    assert first.split()[0].endswith("lightning-ffpa") and "fit --config" in first


TINY = ["--recipe", "tiny_grpo", "--preset", "tiny", "--lengths", "6", "--prompt-len", "4", "--page-size", "8"]


@pytest.mark.timeout(240)
def test_a_row_continues_from_its_checkpoint_in_a_later_call_and_times_past_each_calls_first_step(tmp_path):
    """A row longer than one device call: the second call resumes the first's checkpoint through `--ckpt_path`,
    the steps carry on from where it stopped, and each call's first step (capture, compile) is left out."""
    script = [sys.executable, str(ROOT / "benchmarks" / "grpo_full_depth.py"), *TINY, "--logs", str(tmp_path),
              "--run-dir", str(tmp_path / "runs")]
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    proc = subprocess.run([*script, "--steps", "2", "--out", str(first)], capture_output=True, text=True,
                          timeout=110, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (row,) = json.loads(first.read_text())["rows"]
    assert Path(row["checkpoint"]).is_file() and row["max_steps"] == 2
    proc = subprocess.run([*script, "--steps", "2", "--resume", str(first), "--out", str(second)],
                          capture_output=True, text=True, timeout=110, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    record = json.loads(second.read_text())
    (row,) = record["rows"]
    assert [s["step"] for s in row["steps"]] == [0, 1, 2, 3]  # the resumed fit carried on from step 2
    assert [g["steps"] for g in row["segments"]] == [2, 2] and row["max_steps"] == 4
    assert "--ckpt_path" not in row["segments"][0]["command"] and "--ckpt_path" in row["command"]
    assert row["segments"][1]["log"] == "grpo_full_depth_6_2.log" and (tmp_path / "grpo_full_depth_6_2.log").exists()
    parts = [s["rollout/refresh_s"] + s["rollout/generate_s"] + s["rollout/update_s"] for s in row["steps"]]
    assert row["step_s"]["n"] == 2 and row["step_s"]["median"] == pytest.approx((parts[1] + parts[3]) / 2)
    assert record["summary"]["grpo_full_depth_timed_steps_6"] == 2


def test_a_run_dir_already_used_or_a_resume_without_its_checkpoint_is_refused_by_name(tmp_path):
    (tmp_path / "runs" / "grpo_6").mkdir(parents=True)
    (tmp_path / "runs" / "grpo_6" / "old").write_text("")
    with pytest.raises(Exception, match="--run-dir.*already holds a run of 6-token"):
        grpo_full_depth.parse_args([*TINY, "--run-dir", str(tmp_path / "runs")])
    with pytest.raises(Exception, match="--resume.*under --run-dir"):
        grpo_full_depth.parse_args([*TINY, "--resume", str(tmp_path / "r.json")])
    record = {"benchmark": "grpo_full_depth", "rows": [{"completion_len": 6, "checkpoint": None}], "summary": {}}
    (tmp_path / "r.json").write_text(json.dumps(record))
    with pytest.raises(Exception, match="--resume.*no checkpoint left to continue"):
        grpo_full_depth.parse_args([*TINY, "--run-dir", str(tmp_path / "runs"), "--resume", str(tmp_path / "r.json")])


LORA = {"r": 4, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}


def test_decode_bytes_count_each_weight_once_and_sliding_kv_only_within_the_window():
    short = grpo_full_depth.decode_bytes(4, 8, 1, "tiny", None, LORA)
    longer = grpo_full_depth.decode_bytes(4, 400, 1, "tiny", None, LORA)
    two_rows = grpo_full_depth.decode_bytes(4, 400, 2, "tiny", None, LORA)
    assert short < longer < two_rows  # full layers read every position; more rows read more K/V
    weights = two_rows - 2 * (two_rows - longer)  # what does not scale with the rows
    assert weights == pytest.approx(grpo_full_depth.decode_bytes(4, 400, 0, "tiny", None, LORA))


@pytest.mark.parametrize("layers", [None, 2])
def test_fp8_decode_bytes_count_the_lora_bases_at_one_byte_and_their_scales(layers):
    """Counted independently on the meta model: the bf16 count is every weight and the LoRA A/B at two bytes; the
    float8 one is smaller by exactly each target's (out x in) at one byte less, plus its (out,) fp32 scales."""
    from torch import nn

    from lightning_ffpa.rollout.memory import lora_params, meta_model

    model = meta_model("tiny", **({} if layers is None else {"num_hidden_layers": layers}))
    targets = [m for n, m in model.named_modules()
               if isinstance(m, nn.Linear) and n.rsplit(".", 1)[-1] in LORA["target_modules"]]
    assert len(targets) >= 7
    bf16 = grpo_full_depth.decode_bytes(4, 8, 0, "tiny", layers, LORA)
    assert bf16 == sum(p.numel() for p in model.parameters()) * 2 + lora_params(model, 4) * 2
    fp8 = grpo_full_depth.decode_bytes(4, 8, 0, "tiny", layers, {**LORA, "base_dtype": "fp8"})
    saved = sum(m.weight.numel() * (2 - 1) - m.out_features * 4 for m in targets)
    assert saved > 0 and bf16 - fp8 == saved
    kv = grpo_full_depth.decode_bytes(4, 8, 3, "tiny", layers, LORA) - bf16  # the K/V does not depend on it
    assert grpo_full_depth.decode_bytes(4, 8, 3, "tiny", layers, {**LORA, "base_dtype": "fp8"}) - fp8 == kv
    no_lora = grpo_full_depth.decode_bytes(4, 8, 0, "tiny", layers, None)  # a recipe without LoRA: no adapters
    assert no_lora == sum(p.numel() for p in model.parameters()) * 2


def test_base_dtype_fp8_adds_the_fits_override_and_keeps_the_recipes_targets():
    """`--base-dtype fp8` merges `{r, base_dtype: fp8}` over the recipe's LoRA (jsonargparse merges a dict override
    key by key), so the counted targets are the YAML's; the row records it."""
    args = grpo_full_depth.parse_args(["--base-dtype", "fp8"])
    assert grpo_full_depth.fit_overrides(args) == ["--model.init_args.lora", "{r: 16, base_dtype: fp8}"]
    assert args.lora["base_dtype"] == "fp8" and args.lora["r"] == 16
    assert args.lora["target_modules"] == LORA["target_modules"]  # configs/gemma4_grpo.yaml's
    assert "base_dtype" not in grpo_full_depth.parse_args([]).lora


def test_a_base_dtype_in_the_extras_or_a_rank_the_fit_does_not_train_is_refused():
    from lightning_ffpa.errors import ConfigError

    with pytest.raises(ConfigError, match="--extra.*--base-dtype"):
        grpo_full_depth.parse_args(["--extra", "--model.init_args.lora", "{r: 16, base_dtype: fp8}"])
    with pytest.raises(ConfigError, match="--extra"):
        grpo_full_depth.parse_args(["--base-dtype", "fp8", "--extra", "--model.init_args.lora.base_dtype", "fp8"])
    with pytest.raises(ConfigError, match="--lora-r.*r=16"):  # the recipe trains r=16 unless overridden
        grpo_full_depth.parse_args(["--lora-r", "8"])
    assert grpo_full_depth.parse_args(["--lora-r", "8", "--extra", "--model.init_args.lora", "{r: 8}"]).lora["r"] == 8
    assert grpo_full_depth.parse_args(["--lora-r", "8", "--base-dtype", "fp8"]).lora["r"] == 8


def _recorded(tmp_path, command_lora: str, scale: float = 2.0):
    """A result file as the GPU run wrote it, whose byte count is `scale` times today's (tiny preset, r=4)."""
    steps = [{"rollout/refresh_s": 0.1, "rollout/generate_s": g, "rollout/update_s": 0.5, "rollout/decode_steps": 7.0,
              "rollout/completion_length": 8.0, "device/peak_memory_gb": 1.5} for g in (9.0, 1.0, 1.4, 1.2)]
    bw = {"datasheet_bytes_per_s": 1e12, "copy_bytes_per_s": 8e11, "device_name": "H"}
    lora = {**LORA, **({"base_dtype": "fp8"} if "fp8" in command_lora else {})}
    need = scale * grpo_full_depth.decode_bytes(4, 8, 2, "tiny", None, lora)
    row = {"name": "ours_grpo_8", "completion_len": 8, "prompt_len": 4, "exit_code": 0, "wall_s": 12.5,
           "command": f"fit --config /r/configs/gemma4_grpo.yaml --x 1 --model.init_args.lora {command_lora} --y 2 "
                      "--trainer.callbacks.init_args.sampling.max_new_tokens 8 "
                      "--trainer.callbacks.init_args.engine.max_seq_len 16",
           "steps": steps, "step_s": {"median": 1.8}, "peak_mem_gib": 1.5, "completion_tokens_per_s": 9.0,
           "decode_bytes_per_step": need, "decode_s_per_step_upper": 1.2 / 7, "decode_timed_samples": 3,
           "decode_roofline_datasheet": need / (1.2 / 7) / 1e12, "decode_roofline_copy_bw": 0.0}
    record = {"benchmark": "grpo_full_depth", "command": "python benchmarks/grpo_full_depth.py --lengths 8",
              "commit": "abc1234", "tree": {"sha256": "t"}, "date": "2026-12-01", "finished_at": "2026-12-01 10:00:00",
              "device": "NVIDIA H100 80GB HBM3 x1", "versions": {"torch": "9"}, "script_doc": "as run",
              "rows": [row], "summary": {"complete": True, "grpo_full_depth_step_s_8": 1.8, "bandwidth": bw,
                                         "grpo_full_depth_decode_roofline_datasheet_bs2_8": row["decode_roofline_datasheet"]}}
    path = tmp_path / "measured.json"
    path.write_text(json.dumps(record))
    return path, record


RECOUNT = ["--preset", "tiny", "--prompt-len", "4", "--prompts", "1", "--group", "2", "--lora-r", "4", "--lengths", "8"]


def test_recount_recomputes_the_roofline_from_the_recorded_timings_and_keeps_the_measurement(tmp_path):
    """A file that counted twice today's bytes: the recount halves the fractions, from the recorded steps' seconds
    and bandwidth, and leaves every measured field and the measurement's device, date and commit visible."""
    path, before = _recorded(tmp_path, "{r: 4, base_dtype: fp8}")
    out = tmp_path / "recounted.json"
    grpo_full_depth.main(["--recount", str(path), "--base-dtype", "fp8", "--out", str(out), *RECOUNT])
    after = json.loads(out.read_text())
    (row,), (old,) = after["rows"], before["rows"]
    assert row["decode_bytes_per_step"] == pytest.approx(old["decode_bytes_per_step"] / 2)
    assert row["decode_roofline_datasheet"] == pytest.approx(old["decode_roofline_datasheet"] / 2)
    assert row["decode_s_per_step_upper"] == pytest.approx(1.2 / 7)  # the median of the timed steps (not the first)
    assert row["decode_roofline_datasheet_min"] == pytest.approx(row["decode_bytes_per_step"] / (1.4 / 7) / 1e12)
    assert row["decode_roofline_copy_bw"] == pytest.approx(row["decode_bytes_per_step"] / (1.2 / 7) / 8e11)
    assert after["summary"]["grpo_full_depth_decode_roofline_datasheet_bs2_8"] == row["decode_roofline_datasheet"]
    assert row["base_dtype"] == "fp8"
    for key in ("steps", "step_s", "peak_mem_gib", "completion_tokens_per_s", "wall_s", "exit_code", "command"):
        assert row[key] == old[key]
    for key in ("device", "versions", "date", "finished_at", "script_doc"):
        assert after[key] == before[key]
    assert after["summary"]["grpo_full_depth_step_s_8"] == 1.8 and after["summary"]["bandwidth"]["device_name"] == "H"
    assert after["recounted_from"]["file"] == "measured.json" and after["recounted_from"]["commit"] == "abc1234"
    assert after["recounted_from"]["reason"] and after["commit"] != "abc1234"
    assert json.loads(path.read_text()) == before  # the measured file is untouched
    # the memory estimate beside the measured peak (1.5 GiB): configs/gemma4_grpo.yaml at the script's preset,
    # prompt length and group, with the row's command (r=4, fp8 base, 8-token completions, max_seq_len 16)
    from lightning_ffpa.rollout.engine import EngineConfig
    from lightning_ffpa.rollout.memory import GIB, estimate

    est = estimate("tiny", lora_r=4, base_dtype="fp8", train_tokens=2 * 12, max_tokens_per_microbatch=2 * 12,
                   logprob_chunk_size=1024, engine=EngineConfig(page_size=128, num_pages=577, max_batch_size=16,
                                                                max_seq_len=16))
    assert row["memory_estimate_gib"] == pytest.approx(est.total / GIB)
    assert row["memory_estimate_components_gib"] == pytest.approx({k: v / GIB for k, v in est.components().items()})
    assert row["memory_estimate_rel_err"] == pytest.approx((est.total / GIB - 1.5) / 1.5)
    assert after["summary"]["grpo_full_depth_memory_estimate_gib_8"] == row["memory_estimate_gib"]
    assert after["summary"]["grpo_full_depth_memory_estimate_rel_err_8"] == row["memory_estimate_rel_err"]


def test_recount_refuses_a_base_dtype_its_rows_did_not_run(tmp_path):
    from lightning_ffpa.errors import ConfigError

    fp8, _ = _recorded(tmp_path, "{r: 4, base_dtype: fp8}")
    with pytest.raises(ConfigError, match="--base-dtype.*with base_dtype: fp8"):
        grpo_full_depth.main(["--recount", str(fp8), "--out", str(tmp_path / "o.json"), *RECOUNT])
    bf16, _ = _recorded(tmp_path, "{r: 4}")
    with pytest.raises(ConfigError, match="--base-dtype.*without base_dtype: fp8"):
        grpo_full_depth.main(["--recount", str(bf16), "--base-dtype", "fp8", "--out", str(tmp_path / "o.json"),
                              *RECOUNT])
    with pytest.raises(ConfigError, match="--out"):
        grpo_full_depth.parse_args(["--recount", str(bf16)])
    assert not (tmp_path / "o.json").exists()


def test_routed_decode_bytes_count_the_routed_share_of_the_experts():
    """tiny-moe: 4 layers x 4 experts x (gate_up 64x64 + down 64x32) bf16; a routed half drops half of them."""
    experts = 4 * 4 * (64 * 64 + 64 * 32) * 2
    args = grpo_full_depth.parse_args(["--preset", "tiny-moe", "--lengths", "8", "--prompt-len", "4",
                                       "--prompts", "1", "--group", "2", "--count-routed"])
    full = grpo_full_depth.decode_bytes(4, 8, 2, "tiny-moe", None, args.lora)  # the recipe's LoRA
    assert grpo_full_depth.decode_bytes(4, 8, 2, "tiny-moe", None, args.lora, 1.0) == pytest.approx(full)
    assert grpo_full_depth.decode_bytes(4, 8, 2, "tiny-moe", None, args.lora, 0.5) == pytest.approx(full - experts / 2)
    steps = [{"rollout/refresh_s": 0.1, "rollout/generate_s": 1.0, "rollout/update_s": 0.1,
              "rollout/decode_steps": 7.0, "rollout/routed_expert_fraction": f} for f in (1.0, 0.5, 0.5, 0.25)]
    row = {"completion_len": 8, "exit_code": 0, "steps": steps}
    out = grpo_full_depth.summarize([row], {"datasheet_bytes_per_s": 1e12, "copy_bytes_per_s": 1e12}, args)
    assert row["routed_expert_fraction"] == 0.5  # the median of the timed steps (the first is not timed)
    assert row["decode_bytes_per_step_routed"] == pytest.approx(full - experts / 2)
    assert out["grpo_full_depth_decode_routed_roofline_datasheet_bs2_8"] == pytest.approx(
        (full - experts / 2) / (1.0 / 7) / 1e12)
    assert row["decode_roofline_datasheet"] == pytest.approx(full / (1.0 / 7) / 1e12)  # all weights, beside


def test_the_batch_roofline_key_is_its_longest_completions_row():
    """`grpo_full_depth_decode_roofline_datasheet_bs{B}` (the issue's key, no length) reads the longest completion
    length measured at that batch, where steady decode dominates the rollout."""
    args = grpo_full_depth.parse_args(["--preset", "tiny", "--lengths", "8", "16", "--prompt-len", "4",
                                       "--prompts", "1", "--group", "2"])
    rows = [{"completion_len": L, "exit_code": 0,
             "steps": [{"rollout/refresh_s": 0.1, "rollout/generate_s": g, "rollout/update_s": 0.1,
                        "rollout/decode_steps": float(L - 1)} for _ in range(4)]} for L, g in ((16, 2.0), (8, 1.0))]
    out = grpo_full_depth.summarize(rows, {"datasheet_bytes_per_s": 1e12, "copy_bytes_per_s": 1e12}, args)
    assert out["grpo_full_depth_decode_roofline_datasheet_bs2"] == rows[0]["decode_roofline_datasheet"]
    assert out["grpo_full_depth_decode_roofline_datasheet_bs2"] != rows[1]["decode_roofline_datasheet"]


def test_a_gpu_run_times_at_least_three_steps_per_row(monkeypatch):
    """The first step captures and compiles: a GPU run needs --steps >= 4 for three timed samples (one line
    naming the option, before any row runs); on CPU the smoke run may time fewer."""
    import torch

    from lightning_ffpa.errors import ConfigError

    assert grpo_full_depth.parse_args(["--steps", "3"]).steps == 3  # CPU: no timing claims
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ConfigError, match="--steps"):
        grpo_full_depth.parse_args(["--steps", "3"])
    assert grpo_full_depth.parse_args(["--steps", "4"]).steps == 4
    assert grpo_full_depth.parse_args([]).steps >= 4  # the default times enough


def test_a_row_cut_by_its_timeout_after_steady_steps_fits():
    """A row the timeout cut after three steps at 68.9 of 80 GB was recorded as "does not fit" (exit code != 0)."""
    from benchmarks.grpo_full_depth import fits

    def row(rc, steps, oom=False):
        return {"exit_code": rc, "steps": [{}] * steps, "segments": [{"out_of_memory": oom}]}

    assert fits(row(0, 4)) is True and fits(row("timeout", 3)) is True
    assert fits(row("timeout", 1)) is None and fits(row(1, 2)) is None  # the first step only, or another stop
    assert fits(row(1, 1, oom=True)) is False and fits(row("timeout", 3, oom=True)) is False
