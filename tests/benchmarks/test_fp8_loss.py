"""benchmarks/fp8_loss.py on CPU: both rows fit through the installed console script (emulated float8 where torchao
is installed), the curves are read back from the CSV logger, and the summary keys follow from them."""

import importlib.util
import json
import shlex
import statistics
import sys
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(_ROOT))
sys.path.insert(0, str(_ROOT / "tests" / "cli"))

from _console import Preloaded  # noqa: E402

from benchmarks import fp8_loss  # noqa: E402
from benchmarks.fit_recipes import console_command  # noqa: E402
from lightning_ffpa.errors import ConfigError  # noqa: E402

TORCHAO = importlib.util.find_spec("torchao") is not None
KEYS = {"fp8_full_ft_loss_recipe", "fp8_full_ft_loss_tolerance", "fp8_full_ft_final_loss_bf16",
        "fp8_full_ft_final_loss_fp8", "fp8_full_ft_final_loss_rel_diff", "fp8_full_ft_first_loss_rel_diff",
        "fp8_full_ft_curve_max_rel_diff", "fp8_full_ft_loss_within_tolerance", "fp8_full_ft_runs_per_row",
        "fp8_full_ft_bf16_spread_rel", "fp8_full_ft_fp8_within_bf16_range"}


@pytest.fixture
def preloaded(tmp_path):
    """The console script run in a process forked from one that imported it once (tests/cli/_console.py): the
    installed script itself, as `run_console` runs it, without paying the imports per row."""
    preloader = Preloaded(tmp_path)
    n = len(console_command())

    def launch(cmd, timeout):
        done = preloader.run(shlex.join(["lightning-ffpa", *cmd[n:]]), _ROOT, timeout)
        return done.returncode, done.stdout + done.stderr

    yield launch
    preloader.close()


@pytest.mark.timeout(240)
def test_cpu_smoke_fits_both_rows_through_the_console_and_writes_the_keys(tmp_path, preloaded):
    out = tmp_path / "fp8_loss.json"
    smoke = ["--cpu", "--fp8", "rowwise", "--steps", "10", "--out", str(out)]
    fp8_loss.main([*smoke, "--rows", "bf16"], launch=preloaded)
    fp8_loss.main([*smoke, "--rows", "fp8", "--resume", str(out)], launch=preloaded)  # the row per call, as on GPU
    result = json.loads(out.read_text())
    assert {"command", "commit", "device", "versions"} <= set(result) and len(result["calls"]) == 2
    assert (result["recipe"], result["steps"], result["fp8"], result["final_steps"]) == ("tiny_fsdp2", 10, "rowwise", 10)
    bf16, fp8 = result["rows"]
    assert (bf16["row"], fp8["row"]) == ("bf16", "fp8") and "error" not in bf16, bf16
    # the same fit but for the strategy's fp8 option (emulated on CPU)
    assert fp8["command"] == bf16["command"].replace(
        " --trainer.default_root_dir", " --trainer.strategy.init_args.fp8 rowwise "
                                       "--trainer.strategy.init_args.fp8_emulate true --trainer.default_root_dir")
    assert bf16["command"].startswith("fit --config <run dir>/recipe.yaml") and "TextDataModule" in bf16["command"]
    assert bf16["logged_steps"] == list(range(10)) and bf16["fp8_converted_layers"] == 0
    # the shipped text as one document of whole 64-token windows (bos and eos included): one per packed row
    assert bf16["kept_bytes"] + 2 == 64 * bf16["windows"] and 0 <= bf16["text_bytes"] - bf16["kept_bytes"] < 64
    assert bf16["final_loss"] == pytest.approx(statistics.fmean(bf16["losses"]))
    assert bf16["losses"][-1] < bf16["losses"][0]  # Shakespeare is learnable
    summary, missing = result["summary"], result["summary_missing"]
    assert set(summary) == KEYS and summary["fp8_full_ft_loss_tolerance"] == 0.01
    if not TORCHAO:  # the fit refuses with the strategy's one line: the row says so, the keys are null with why
        assert "needs torchao" in fp8["error"] and summary["fp8_full_ft_final_loss_rel_diff"] is None
        assert "row fp8: fit exit 2" in missing["fp8_full_ft_final_loss_rel_diff"]
        return
    assert "error" not in fp8, fp8
    assert fp8["fp8_converted_layers"] > 0 and fp8["losses"] != bf16["losses"]  # the float8 casts ran
    assert summary["fp8_full_ft_final_loss_rel_diff"] == pytest.approx(
        abs(fp8["final_loss"] - bf16["final_loss"]) / bf16["final_loss"])
    assert summary["fp8_full_ft_first_loss_rel_diff"] < 0.01  # the same weights and batch at step 0
    assert summary["fp8_full_ft_loss_recipe"] == "rowwise" and set(missing) == {
        "fp8_full_ft_bf16_spread_rel", "fp8_full_ft_fp8_within_bf16_range"}  # one run per row: no spread
    assert summary["fp8_full_ft_loss_within_tolerance"] == (summary["fp8_full_ft_final_loss_rel_diff"] <= 0.01)


def _row(name, losses, **extra):
    return dict(row=name, fp8="tensorwise" if name == "fp8" else "none", losses=losses, first_loss=losses[0],
                final_loss=statistics.fmean(losses[-10:]), **extra)


def test_summary_compares_the_final_losses_against_the_tolerance():
    bf16 = _row("bf16", [5.0] * 5 + [2.0] * 10)
    fp8 = _row("fp8", [5.0] * 5 + [2.03] * 10)
    summary, missing = fp8_loss.summarize([bf16, fp8])
    assert summary["fp8_full_ft_final_loss_rel_diff"] == pytest.approx(0.015)
    assert summary["fp8_full_ft_loss_within_tolerance"] is False and summary["fp8_full_ft_loss_recipe"] == "tensorwise"
    assert summary["fp8_full_ft_curve_max_rel_diff"] == pytest.approx(0.015)
    assert set(missing) == {"fp8_full_ft_bf16_spread_rel", "fp8_full_ft_fp8_within_bf16_range"}
    summary, missing = fp8_loss.summarize([bf16, _row("fp8", [5.0] * 15, error="fit exit timeout after 540 s")])
    assert summary["fp8_full_ft_final_loss_rel_diff"] is None and summary["fp8_full_ft_final_loss_bf16"] == 2.0
    assert missing["fp8_full_ft_final_loss_rel_diff"] == "row fp8: fit exit timeout after 540 s"
    assert "row fp8: not in this result" in fp8_loss.summarize([bf16])[1]["fp8_full_ft_loss_within_tolerance"]


def test_repeated_runs_compare_the_means_and_measure_the_bf16_spread():
    """--repeats: the final losses are each row's mean over its runs; the bf16 runs' spread is measured and the
    fp8 mean judged against their range (two bf16 runs of one command differ on the GPU); a failed run is left out."""
    runs = [_row("bf16", [5.0] * 5 + [2.0] * 10, repeat=0), _row("fp8", [5.0] * 5 + [2.05] * 10, repeat=0),
            _row("bf16", [5.0] * 5 + [2.1] * 10, repeat=1), _row("fp8", [5.0] * 5 + [2.07] * 10, repeat=1),
            _row("fp8", [5.0] * 15, repeat=2, error="fit exit timeout after 540 s")]
    summary, missing = fp8_loss.summarize(runs)
    assert summary["fp8_full_ft_final_loss_bf16"] == pytest.approx(2.05)
    assert summary["fp8_full_ft_final_loss_fp8"] == pytest.approx(2.06)
    assert summary["fp8_full_ft_final_loss_rel_diff"] == pytest.approx(0.01 / 2.05)
    assert summary["fp8_full_ft_curve_max_rel_diff"] == pytest.approx(0.025)  # the first run of each row
    assert summary["fp8_full_ft_bf16_spread_rel"] == pytest.approx(0.1 / 2.05)
    assert summary["fp8_full_ft_fp8_within_bf16_range"] is True and summary["fp8_full_ft_runs_per_row"] == 2
    assert not missing
    outside = fp8_loss.summarize([*runs[:4], _row("fp8", [5.0] * 5 + [2.5] * 10, repeat=2)])[0]
    assert outside["fp8_full_ft_fp8_within_bf16_range"] is False


def test_repeats_alternate_the_rows_and_resume_keeps_finished_runs(tmp_path):
    calls = []

    def launch(cmd, timeout):  # a fit that logs a falling loss (and, for fp8, the strategy's line)
        fp8 = "--trainer.strategy.init_args.fp8" in cmd
        calls.append("fp8" if fp8 else "bf16")
        csv_path = Path(cmd[cmd.index("--trainer.logger.save_dir") + 1]) / "lightning_logs" / "metrics.csv"
        csv_path.parent.mkdir(parents=True)
        csv_path.write_text("step,train/loss\n" + "".join(f"{i},{5 - 0.1 * i}\n" for i in range(10)))
        return 0, "fp8 rowwise: 4 decoder Linear layers train in torchao float8\n" if fp8 else "done\n"

    out = tmp_path / "r.json"
    fp8_loss.main(["--cpu", "--fp8", "rowwise", "--repeats", "2", "--out", str(out)], launch=launch)
    assert calls == ["bf16", "fp8", "bf16", "fp8"]
    rows = json.loads(out.read_text())["rows"]
    assert not any(r.get("error") for r in rows), rows
    assert [(r["row"], r["repeat"]) for r in rows] == [("bf16", 0), ("fp8", 0), ("bf16", 1), ("fp8", 1)]
    assert [r["log"] for r in rows] == ["fp8_loss_bf16.log", "fp8_loss_fp8.log", "fp8_loss_bf16_r1.log",
                                        "fp8_loss_fp8_r1.log"]
    calls.clear()
    fp8_loss.main(["--cpu", "--fp8", "rowwise", "--repeats", "3", "--resume", str(out), "--out", str(out)],
                  launch=launch)
    assert calls == ["bf16", "fp8"]  # only the third run of each row
    with pytest.raises(ConfigError, match="--repeats"):
        fp8_loss.parse_args(["--cpu", "--fp8", "rowwise", "--repeats", "0"])


def test_a_row_is_refused_where_its_log_does_not_show_the_fp8_it_was_asked_for():
    args = fp8_loss.parse_args(["--cpu", "--fp8", "tensorwise"])
    row = _row("fp8", [5.0] * 10, exit_code=0, logged_steps=list(range(10)), skipped_updates=0)
    said = "fp8 tensorwise: 26 decoder Linear layers train in torchao float8, 0 kept in high precision"
    assert fp8_loss.check_row(row, args, f"...\n{said}\n...") is None
    assert "does not say that fp8 tensorwise converted" in fp8_loss.check_row(row, args, "no such line")
    assert "does not say" in fp8_loss.check_row(row, args, said.replace("tensorwise", "rowwise"))
    assert "converted layers to float8" in fp8_loss.check_row(dict(row, row="bf16"), args, said)
    assert "non-finite" in fp8_loss.check_row(dict(row, skipped_updates=1), args, said)
    assert "logged the loss of 9 steps" in fp8_loss.check_row(dict(row, logged_steps=list(range(9))), args, said)


def test_the_gpu_recipe_drops_only_its_checkpoints():
    cfg, changes = fp8_loss.derived_recipe("gemma4_ffpa")
    assert changes == ["trainer.callbacks: lightning.pytorch.callbacks.ModelCheckpoint dropped",
                       "trainer.enable_checkpointing: false"]
    names = [c["class_path"].rsplit(".", 1)[-1] for c in cfg["trainer"]["callbacks"]]
    assert "ModelCheckpoint" not in names and {"FFPAAttention", "TokenThroughput", "NonFiniteGuard"} <= set(names)
    assert cfg["trainer"]["strategy"]["init_args"]["param_dtype"] == "bf16"  # the recipe's bf16 stays as shipped
    args = fp8_loss.parse_args(["--fp8", "rowwise"])
    assert (args.recipe, args.steps, args.seq, args.lr) == ("gemma4_ffpa", 200, 4096, 1e-4)
    words = fp8_loss.fit_overrides(args, "fp8", Path("text.jsonl"))
    assert words[:4] == ["--trainer.devices", "1", "--model.init_args.config_overrides", "{num_hidden_layers: 6}"]
    assert words[-2:] == ["--trainer.strategy.init_args.fp8", "rowwise"]  # never emulated on GPU


def test_bad_options_are_one_line_before_any_fit(tmp_path):
    with pytest.raises(ConfigError, match="--steps.*at least 200"):
        fp8_loss.parse_args(["--fp8", "rowwise", "--steps", "100"])
    with pytest.raises(ConfigError, match="--seq.*must fit the shipped text"):
        fp8_loss.parse_args(["--cpu", "--fp8", "rowwise", "--seq", "1000000"])
    with pytest.raises(ConfigError, match="--fp8.*one of them"):
        fp8_loss.parse_args(["--cpu"])
    tt = tmp_path / "tt.json"
    tt.write_text(json.dumps(dict(benchmark="train_throughput", rows=[], summary={"fp8_full_ft_recipe_16k": None},
                                  summary_missing={"fp8_full_ft_vs_bf16_tps_16k": "row ours at seq 16384 is not in "
                                                                                  "this result"})))
    with pytest.raises(ConfigError, match="--fp8-from.*no fp8_full_ft_recipe_16k.*row ours at seq 16384"):
        fp8_loss.parse_args(["--cpu", "--fp8-from", str(tt)])
    tt.write_text(json.dumps(dict(benchmark="train_throughput", rows=[], summary={"fp8_full_ft_recipe_16k": "tensorwise"})))
    assert fp8_loss.parse_args(["--cpu", "--fp8-from", str(tt)]).fp8 == "tensorwise"
