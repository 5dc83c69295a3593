"""StepLearningRateMonitor: one learning-rate row per optimizer step, under gradient accumulation too."""

import csv

import lightning as L
import pytest
from lightning.pytorch.callbacks import LearningRateMonitor
from lightning.pytorch.loggers import CSVLogger

from lightning_ffpa.callbacks import StepLearningRateMonitor
from lightning_ffpa.data import MockDataModule
from lightning_ffpa.module import Gemma4LM


def _lr_rows(tmp_path, monitor) -> list[int]:
    trainer = L.Trainer(accelerator="cpu", max_steps=3, accumulate_grad_batches=2, log_every_n_steps=1,
                        logger=CSVLogger(tmp_path), callbacks=[monitor], enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)
    trainer.fit(Gemma4LM(preset="tiny", warmup_steps=1),
                MockDataModule(vocab_size=512, seq_length=16, batch_size=2, num_samples=64))
    with open(trainer.logger.log_dir + "/metrics.csv") as f:
        return [int(r["step"]) for r in csv.DictReader(f) if r.get("lr-AdamW/pg1")]


@pytest.mark.parametrize("monitor, rows", [(LearningRateMonitor, [0, 0, 1, 1, 2, 2]),  # Lightning's: per micro-batch
                                           (StepLearningRateMonitor, [0, 1, 2])])
def test_one_learning_rate_row_per_optimizer_step(tmp_path, monitor, rows):
    assert _lr_rows(tmp_path, monitor()) == rows
