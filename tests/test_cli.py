"""The `lightning-ffpa` CLI in-process (`cli.build`): shipped YAMLs parse, the tiny fit runs, bad input fails early.

The console scripts themselves (exit codes, one error line, packaged recipes) are tested in tests/cli/.
"""

import csv
import json
import math
import os
from pathlib import Path

import pytest

from lightning_ffpa.cli import build

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_parses(config, capsys):
    with pytest.raises(SystemExit) as exit_info:
        build(["fit", "--config", str(config), "--print_config"])
    assert exit_info.value.code == 0
    assert "class_path" in capsys.readouterr().out


def test_dotted_override_reaches_the_module(capsys):
    cfg = CONFIGS[0].parent / "tiny.yaml"
    with pytest.raises(SystemExit):
        build(["fit", "--config", str(cfg), "--model.init_args.learning_rate", "0.123", "--print_config"])
    assert "learning_rate: 0.123" in capsys.readouterr().out


def _fit_tiny(tmp_path, *extra):
    cfg = CONFIGS[0].parent / "tiny.yaml"
    logger = {"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": str(tmp_path)}}
    return build([
        "fit", "--config", str(cfg), f"--trainer.default_root_dir={tmp_path}", f"--trainer.logger={logger}",
        "--trainer.callbacks=[]", "--trainer.enable_checkpointing=false", "--trainer.enable_progress_bar=false",
        *extra,
    ])


GOLDEN = Path(__file__).parent / "assets" / "tiny_loss_curve.json"


@pytest.fixture(scope="module")
def tiny_rows(tmp_path_factory):
    """The logged rows of 30 steps of configs/tiny.yaml, run once through the real CLI."""
    tmp_path = tmp_path_factory.mktemp("tiny_fit")
    cli = _fit_tiny(tmp_path, "--trainer.max_steps=30", "--trainer.limit_val_batches=0",
                    "--trainer.log_every_n_steps=1")
    return [r for r in csv.DictReader(open(Path(cli.trainer.logger.log_dir) / "metrics.csv")) if r.get("train/loss")]


@pytest.fixture(scope="module")
def tiny_losses(tiny_rows):
    """Per-step training loss of that run."""
    return [float(r["train/loss"]) for r in tiny_rows]


def test_train_perplexity_is_logged_every_step(tiny_rows):
    """`train/ppl` is the step's exp(loss) (a Metric logged on_step needs its forward, not only update)."""
    for r in tiny_rows:
        assert float(r["train/ppl"]) == pytest.approx(math.exp(float(r["train/loss"])), rel=1e-4), r


def test_fit_tiny_end_to_end_loss_falls(tiny_losses):
    assert len(tiny_losses) == 30
    assert sum(tiny_losses[-5:]) / 5 < sum(tiny_losses[:5]) / 5 - 0.5


def test_tiny_loss_curve_matches_golden(tiny_losses):
    """Loss-affecting changes must update tests/assets/tiny_loss_curve.json deliberately:
    LIGHTNING_FFPA_UPDATE_GOLDEN=1 pytest tests/test_cli.py -k golden."""
    if os.environ.get("LIGHTNING_FFPA_UPDATE_GOLDEN"):
        import torch
        import transformers

        versions = {"torch": torch.__version__, "transformers": transformers.__version__}
        GOLDEN.write_text(json.dumps({"config": "configs/tiny.yaml", "steps": 30, "versions": versions,
                                     "loss": tiny_losses}, indent=1))
    golden = json.loads(GOLDEN.read_text())["loss"]
    # CPU kernels differ slightly across instruction sets; real changes move the curve by far more.
    # A torch or transformers release can move it too: the file records the versions it was made with.
    assert tiny_losses == pytest.approx(golden, abs=2e-3), json.loads(GOLDEN.read_text()).get("versions")


@pytest.mark.parametrize(
    "args, option",
    [
        (["--data.init_args.train_file=/nonexistent.txt"], "data.init_args.train_file"),
        (["--model.init_args.attn_implementation=flash9"], "attn_implementation"),
        (["--data.init_args.max_seq_length=4096"], "data.max_seq_length"),
    ],
)
def test_bad_input_fails_before_training(tmp_path, args, option, capsys):
    with pytest.raises((ValueError, FileNotFoundError, SystemExit)) as err:
        _fit_tiny(tmp_path, *args)
    assert option in str(err.value) + capsys.readouterr().err
    assert not list(tmp_path.rglob("*.ckpt"))
