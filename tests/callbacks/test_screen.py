"""The fit's progress bars show the logger's version as Lightning's tqdm bar does: an integer (`v_num: 3`)."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
from lightning.pytorch.callbacks.progress.tqdm_progress import Tqdm
from lightning.pytorch.loggers import CSVLogger

from lightning_ffpa.callbacks.screen import RichStepProgressBar, StepProgressBar


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
