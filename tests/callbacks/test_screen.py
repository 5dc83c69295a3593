"""The fit's progress bars show the logger's version as Lightning's tqdm bar does: an integer (`v_num: 3`), and
a small loss (GRPO's, near 0) in scientific notation, not `-0.000`."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
from lightning.pytorch.callbacks.progress.tqdm_progress import Tqdm
from lightning.pytorch.loggers import CSVLogger

from lightning_ffpa.callbacks.screen import RichStepProgressBar, StepProgressBar, format_metric


def _trainer(tmp_path, bar) -> pl.Trainer:
    return pl.Trainer(accelerator="cpu", logger=CSVLogger(tmp_path, version=3), callbacks=[bar],
                      enable_model_summary=False)


def test_rich_bar_shows_the_version_as_an_integer(tmp_path):
    pytest.importorskip("rich")
    bar = RichStepProgressBar()
    metrics = bar.get_metrics(_trainer(tmp_path, bar), pl.LightningModule())
    value = metrics["v_num"]
    shown = value if isinstance(value, str) else f"{value:{bar.theme.metrics_format}}"  # what rich's column does
    assert shown == "3"


def test_tqdm_bar_shows_the_version_as_an_integer(tmp_path):
    bar = StepProgressBar()
    metrics = bar.get_metrics(_trainer(tmp_path, bar), pl.LightningModule())
    assert Tqdm.format_num(metrics["v_num"]) == "3"


@pytest.mark.parametrize("value, shown", [(-2.3141e-5, "-2.31e-05"), (2.3456, "2.346"), (0.0, "0.000"), (-0.0, "0.000"),
                                          (1.5e-3, "0.002"), (123456.0, "1.23e+05"), (float("nan"), "nan")])
def test_metric_format_keeps_small_numbers_readable(value, shown):
    assert format_metric(value) == shown


def test_rich_bar_shows_a_small_loss_in_scientific_notation(tmp_path, monkeypatch):
    """What rich's metrics column prints for a GRPO loss of -2.3e-5 (it prints a string as it is)."""
    pytest.importorskip("rich")
    bar = RichStepProgressBar()
    trainer = _trainer(tmp_path, bar)
    monkeypatch.setattr(pl.Trainer, "progress_bar_metrics", property(lambda self: {"train/loss": -2.3e-5}))
    value = bar.get_metrics(trainer, pl.LightningModule())["train/loss"]
    shown = value if isinstance(value, str) else f"{value:{bar.theme.metrics_format}}"
    assert shown == "-2.30e-05"
