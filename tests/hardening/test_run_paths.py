"""Checkpoints and logs follow `trainer.default_root_dir`: shipped configs name no other path, and `last` is
found again by the next run even with a versioned logger."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
import yaml
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from lightning_ffpa._compat import lightning as lightning_compat
from lightning_ffpa.checkpoint.paths import root_checkpoint_dirs

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.name)
def test_shipped_configs_name_no_path_but_default_root_dir(config):
    trainer = yaml.safe_load(config.read_text())["trainer"]
    loggers = trainer.get("logger")
    assert loggers in (None, False), f"{config.name}: loggers default to default_root_dir; got {loggers}"
    for cb in trainer.get("callbacks") or []:
        assert "dirpath" not in (cb.get("init_args") or {}), f"{config.name}: {cb}"


def test_last_is_found_under_default_root_dir_by_the_next_run(tmp_path):
    def trainer():
        return L.Trainer(default_root_dir=tmp_path, logger=CSVLogger(tmp_path), max_steps=1, accelerator="cpu",
                         callbacks=[ModelCheckpoint(save_last=True)], enable_progress_bar=False)

    first = trainer()
    assert root_checkpoint_dirs(first) == [str((tmp_path / "checkpoints").resolve())]
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    torch.save({"global_step": 1}, folder / "last.ckpt")
    second = trainer()  # a new logger version: Lightning alone would look in version_1/checkpoints
    root_checkpoint_dirs(second)
    assert Path(lightning_compat.resolve_ckpt_path(second, "last")) == (folder / "last.ckpt").resolve()
