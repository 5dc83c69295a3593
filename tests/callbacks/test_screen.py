"""The fit's progress bars show the logger's version as Lightning's tqdm bar does: an integer (`v_num: 3`), and
a small loss (GRPO's, near 0) in scientific notation, not `-0.000`."""

from __future__ import annotations

import time

import lightning.pytorch as pl
import pytest
import torch
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


class _Sleepy(pl.LightningModule):
    """One parameter, SLEEP seconds a step: the bar's rate can be no more than 1 / SLEEP steps a second."""

    SLEEP = 0.05

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))

    def training_step(self, batch, batch_idx):
        time.sleep(self.SLEEP)
        return (self.w - batch).pow(2).mean()

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.ones(2, 1), batch_size=1)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _Rates(pl.Callback):
    """The rate each bar shows after every batch (it runs after the bar: later in the callback list)."""

    def __init__(self, bar) -> None:
        self.bar, self.seen = bar, []

    def on_train_batch_end(self, trainer, *args) -> None:
        if isinstance(self.bar, RichStepProgressBar):
            task = next(t for t in self.bar.progress.tasks if t.id == self.bar.train_progress_bar_id)
            self.seen.append(task.speed or 0.0)
        else:
            shown = self.bar.train_progress_bar.format_dict  # tqdm shows (n - initial) / elapsed until it has a rate
            self.seen.append(shown["rate"] or (shown["n"] - shown["initial"]) / max(shown["elapsed"], 1e-9))


@pytest.mark.parametrize("kind", ["rich", "tqdm"])
def test_the_rate_counts_only_the_steps_this_process_ran(tmp_path, kind):
    """Two-batch epochs, then a resume: the bar starts each epoch (and the resumed run) at the step reached, and
    that jump is no step of its own (it read as 100+ it/s for steps that take 50 ms)."""
    if kind == "rich":
        pytest.importorskip("rich")
    ceiling = 1.2 / _Sleepy.SLEEP
    for max_steps, ckpt in ((6, None), (10, str(tmp_path / "ckpt.ckpt"))):
        bar = RichStepProgressBar() if kind == "rich" else StepProgressBar()
        rates = _Rates(bar)
        trainer = pl.Trainer(accelerator="cpu", max_steps=max_steps, logger=False, enable_checkpointing=False,
                             enable_model_summary=False, callbacks=[bar, rates])
        trainer.fit(_Sleepy(), ckpt_path=ckpt)
        trainer.save_checkpoint(tmp_path / "ckpt.ckpt")
        assert trainer.global_step == max_steps and len(rates.seen) == (6 if ckpt is None else 4)
        assert max(rates.seen) < ceiling, rates.seen
