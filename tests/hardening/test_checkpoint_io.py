"""Plain-file checkpoints on one CPU process: atomic writes, disk pre-flight, retention, async, dangling `last`,
the shipped recipes' `last.ckpt` across resumes.

A small Lightning demo model keeps each fit to a second or two; what is tested is the checkpoint plumbing
(`lightning_ffpa.checkpoint`), which does not depend on the model.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
from collections import namedtuple
from pathlib import Path

import lightning as L
import pytest
import torch
import yaml
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.plugins.io import AsyncCheckpointIO

from lightning_ffpa.checkpoint import AtomicCheckpointIO, FinalCheckpoint
from lightning_ffpa.checkpoint import atomic as atomic_mod
from lightning_ffpa.errors import ConfigError
from lightning_ffpa.validation import CheckpointError, check_no_dangling_last, preflight

RECIPES = Path(__file__).resolve().parents[2] / "configs"


def _trainer(root: Path, max_steps: int, io=None, **ckpt) -> tuple[L.Trainer, ModelCheckpoint]:
    cb = ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=1, **ckpt)
    trainer = L.Trainer(default_root_dir=root, max_steps=max_steps, accelerator="cpu", logger=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        callbacks=[cb], plugins=[io if io is not None else AtomicCheckpointIO()])
    return trainer, cb


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_failure_mid_save_leaves_no_file_and_keeps_last(tmp_path, monkeypatch, record_property):
    """The writer dies after writing part of the file: no final file, no partial, `last.ckpt` untouched."""
    trainer, _ = _trainer(tmp_path, 2, save_last=True, save_top_k=-1)
    trainer.fit(BoringModel())
    last = tmp_path / "ckpt" / "last.ckpt"
    before = _digest(last)

    def dies_midway(obj, f, *args, **kwargs):
        f.write(b"PK\x03\x04 half a checkpoint")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(atomic_mod.torch, "save", dies_midway)
    trainer, _ = _trainer(tmp_path, 3, save_last=True, save_top_k=-1)
    with pytest.raises(OSError, match="No space left"):
        trainer.fit(BoringModel(), ckpt_path=str(last))
    monkeypatch.undo()
    record_property("hardening", "checkpoint")
    record_property("case", "writer fails mid-save: no half-written file, last.ckpt unchanged")
    assert _names(tmp_path / "ckpt") == ["epoch=0-step=1.ckpt", "epoch=0-step=2.ckpt", "last.ckpt"]
    assert _digest(last) == before
    assert torch.load(last, weights_only=True)["global_step"] == 2


_ZIP_WRITER_FAILED = "[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"  # seen on an H200


@pytest.mark.parametrize("free, expected", [(2**20, OSError), (2**40, RuntimeError)], ids=["full", "not-full"])
def test_torch_writer_failure_on_a_full_disk_is_reported_as_no_space(tmp_path, monkeypatch, free, expected):
    """torch's zip writer reports a failed OS write as a RuntimeError; on a (nearly) full disk that is ENOSPC
    (one line from the CLI), otherwise the writer's own error stands. No partial file either way."""
    def fails(obj, f, *args, **kwargs):
        f.write(b"PK\x03\x04 part")
        raise RuntimeError(_ZIP_WRITER_FAILED)

    monkeypatch.setattr(atomic_mod.torch, "save", fails)
    monkeypatch.setattr(atomic_mod, "free_bytes", lambda d: free)
    with pytest.raises(expected) as err:
        AtomicCheckpointIO().save_checkpoint({"x": torch.zeros(4)}, tmp_path / "a.ckpt")
    assert (err.value.errno == 28) if expected is OSError else "unexpected pos" in str(err.value)
    assert _names(tmp_path) == []


def test_replacing_a_file_is_atomic_and_leaves_no_partial(tmp_path):
    io = AtomicCheckpointIO()
    path = tmp_path / "a" / "last.ckpt"
    io.save_checkpoint({"x": torch.ones(3)}, path)
    io.save_checkpoint({"x": torch.zeros(3)}, path)
    assert torch.equal(torch.load(path, weights_only=True)["x"], torch.zeros(3))
    assert _names(path.parent) == ["last.ckpt"]


@pytest.mark.parametrize("old_kind", ["file", "link", "folder"])
@pytest.mark.parametrize("new_kind", ["file", "folder"])
def test_publish_replaces_a_checkpoint_of_the_other_layout(tmp_path, old_kind, new_kind):
    """A resume that changed `save_distributed_checkpoint` publishes a DCP folder over `last.ckpt` the file (or its
    link), or the reverse: `os.replace(folder, file)` failed after training (exit 2), leaving `last` on the old step
    and the partial folder behind."""
    final, target = tmp_path / "last.ckpt", tmp_path / "epoch=0-step=2.ckpt"
    target.write_bytes(b"step 2")
    if old_kind == "file":
        final.write_bytes(b"step 2")
    elif old_kind == "link":
        final.symlink_to(target.name)
    else:
        final.mkdir()
        (final / "shard").write_bytes(b"step 2")
    tmp = tmp_path / ".last.ckpt.partial"
    if new_kind == "file":
        tmp.write_bytes(b"step 4")
    else:
        tmp.mkdir()
        (tmp / "shard").write_bytes(b"step 4")
    atomic_mod.publish(tmp, final)
    assert not final.is_symlink() and (final.read_bytes() if new_kind == "file" else (final / "shard").read_bytes()) \
        == b"step 4"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["epoch=0-step=2.ckpt", "last.ckpt"]  # nothing left aside
    assert target.read_bytes() == b"step 2"  # a link's target is not touched


def test_disk_preflight_refuses_before_writing(tmp_path, monkeypatch, record_property):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(2**20, 2**20 - 100, 100))
    trainer, _ = _trainer(tmp_path, 2)
    with pytest.raises(ConfigError) as err:
        trainer.fit(BoringModel())
    record_property("hardening", "checkpoint")
    record_property("case", "disk too small for the checkpoint: one line before writing")
    msg = str(err.value)
    assert msg.startswith("`ModelCheckpoint.dirpath=") and "100 bytes is free" in msg and "\n" not in msg
    assert not (tmp_path / "ckpt").exists() or _names(tmp_path / "ckpt") == []


def test_free_space_estimate_counts_every_tensor(tmp_path, monkeypatch):
    usage = namedtuple("usage", "total used free")
    state = {"state_dict": {"w": torch.zeros(100, 10)}, "optimizer_states": [{"m": torch.zeros(100, 10)}]}
    assert atomic_mod.checkpoint_bytes(state) == 8000
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**6, 0, 8000))  # no room for the 5% margin
    with pytest.raises(ConfigError, match="7.81 KiB"):
        atomic_mod.check_free_space(tmp_path, 8000)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**6, 0, 8500))
    atomic_mod.check_free_space(tmp_path / "not" / "yet", 8000)  # checked on the nearest existing parent


def test_retention_keeps_the_last_k(tmp_path, record_property):
    trainer, cb = _trainer(tmp_path, 5, save_top_k=2, monitor="step", mode="max", save_last="link")
    trainer.fit(BoringModel())
    record_property("hardening", "checkpoint")
    record_property("case", "retention: save_top_k=2 on step keeps the newest 2, last links the newest")
    folder = tmp_path / "ckpt"
    assert _names(folder) == ["epoch=0-step=4.ckpt", "epoch=0-step=5.ckpt", "last.ckpt"]
    assert os.readlink(folder / "last.ckpt") == "epoch=0-step=5.ckpt"


def test_async_plain_save_completes_and_resumes(tmp_path, record_property):
    io = AsyncCheckpointIO(AtomicCheckpointIO())
    trainer, _ = _trainer(tmp_path, 3, io=io, save_last=True)
    model = BoringModel()
    trainer.fit(model)  # teardown waits for the background writes
    last = tmp_path / "ckpt" / "last.ckpt"
    saved = torch.load(last, weights_only=True)
    assert saved["global_step"] == 3
    assert all(torch.equal(saved["state_dict"][k], v) for k, v in model.state_dict().items())
    trainer, _ = _trainer(tmp_path, 5, io=AsyncCheckpointIO(AtomicCheckpointIO()), save_last=True)
    trainer.fit(BoringModel(), ckpt_path=str(last))
    record_property("hardening", "checkpoint")
    record_property("case", "async plain-file save (AsyncCheckpointIO + AtomicCheckpointIO) completes and resumes")
    assert trainer.global_step == 5
    assert torch.load(last, weights_only=True)["global_step"] == 5
    assert not [n for n in _names(tmp_path / "ckpt") if n.endswith(".partial")]


def test_dangling_last_link_is_refused_by_name(tmp_path):
    """A background save killed before its rename leaves `last.ckpt` pointing at nothing; say so."""
    folder = tmp_path / "ckpt"
    folder.mkdir()
    torch.save({"global_step": 2}, folder / "epoch=0-step=2.ckpt")
    os.symlink("epoch=0-step=3.ckpt", folder / "last.ckpt")
    trainer = type("T", (), {"checkpoint_callbacks": [ModelCheckpoint(dirpath=folder)]})()
    with pytest.raises(CheckpointError, match=r"last.ckpt points to 'epoch=0-step=3.ckpt'.*epoch=0-step=2.ckpt"):
        check_no_dangling_last(trainer)


def test_last_without_a_last_file_names_the_newest_checkpoint(tmp_path, record_property):
    """`--ckpt_path last` where ModelCheckpoint's save_last is off: Lightning warned and trained from scratch over
    the earlier run's checkpoints (and the fresh-run refusal's advice was this very `last`); the pre-flight names
    the newest file instead."""
    trainer, _ = _trainer(tmp_path, max_steps=2)
    trainer.fit(BoringModel())
    newest = tmp_path / "ckpt" / "epoch=0-step=2.ckpt"
    assert newest.exists() and not list((tmp_path / "ckpt").glob("last*"))
    digest = _digest(newest)
    resumed, _ = _trainer(tmp_path, max_steps=4)
    with pytest.raises(CheckpointError, match=rf"^`ckpt_path='last'`: .*has no `last` checkpoint .*save_last is off.*"
                                              rf"`--ckpt_path {re.escape(str(newest))}`$"):
        preflight(resumed, BoringModel(), None, "last")
    record_property("hardening", "checkpoint")
    record_property("case", "`--ckpt_path last` with save_last off and checkpoints saved: refused, newest named")
    record_property("data_lost", int(_digest(newest) != digest))


def test_a_dcp_folder_needs_a_sharding_strategy(tmp_path):
    """validate/test/predict/fit with a DCP folder under a single-device strategy failed with "Is a directory"."""
    from types import SimpleNamespace

    from lightning.pytorch.strategies import SingleDeviceStrategy

    from lightning_ffpa.errors import CheckpointError
    from lightning_ffpa.parallel import FSDP2Strategy
    from lightning_ffpa.validation import check_strategy_loads

    folder = tmp_path / "step=2.ckpt"
    folder.mkdir()
    single = SimpleNamespace(strategy=SingleDeviceStrategy("cpu"))
    with pytest.raises(CheckpointError, match=r"is a distributed checkpoint folder, which SingleDeviceStrategy"):
        check_strategy_loads(single, folder)
    check_strategy_loads(SimpleNamespace(strategy=FSDP2Strategy()), folder)
    check_strategy_loads(single, None)


@pytest.mark.parametrize("recipe", ["tiny.yaml", "gemma4_ffpa.yaml"])
def test_a_resumed_recipe_keeps_writing_last_ckpt(tmp_path, recipe, record_property):
    """A resumed run re-points or replaces `last.ckpt`, never starts a `last-v1.ckpt` beside a stale one.

    The state saved in the first top-k checkpoint predates its `last` link, so a run resumed from it (through
    `last`, by path, or after a requeue) did not know `last.ckpt` was its own and wrote `last-v1.ckpt`.
    """
    recipe_cfg = yaml.safe_load((RECIPES / recipe).read_text())
    args = next(c["init_args"] for c in recipe_cfg["trainer"]["callbacks"]
                if c["class_path"].endswith(".ModelCheckpoint"))
    folder = tmp_path / "ckpt"

    def fit(max_steps: int, ckpt_path: str | None = None) -> None:
        cb = ModelCheckpoint(dirpath=folder, **{**args, "every_n_train_steps": 2})
        trainer = L.Trainer(default_root_dir=tmp_path, max_steps=max_steps, accelerator="cpu", logger=False,
                            enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                            callbacks=[cb], plugins=[AtomicCheckpointIO()])
        trainer.fit(BoringModel(), ckpt_path=ckpt_path)

    last = folder / "last.ckpt"
    fit(2)
    assert os.readlink(last) == "epoch=0-step=2.ckpt"
    fit(3, "last")  # no top-k save at step 3: `last` becomes a full file (Lightning's documented fallback)
    record_property("hardening", "checkpoint")
    record_property("case", f"{recipe}: a resumed run keeps writing last.ckpt, never last-v1.ckpt")
    assert _names(folder) == ["epoch=0-step=2.ckpt", "last.ckpt"]
    assert not last.is_symlink() and torch.load(last, weights_only=True)["global_step"] == 3
    fit(4, "last")  # resumes at step 3 (the newest state), saves step 4 and links `last` to it
    step4 = [n for n in _names(folder) if n.endswith("-step=4.ckpt")]
    assert _names(folder) == sorted(["epoch=0-step=2.ckpt", *step4, "last.ckpt"]) and len(step4) == 1
    assert os.readlink(last) == step4[0] and torch.load(last, weights_only=True)["global_step"] == 4


def test_the_final_save_of_an_epoch_that_ran_to_its_end_names_that_epoch(tmp_path, record_property):
    """An epoch of 4 steps, saves every 3: `FinalCheckpoint` saves step 4 after the epoch's end, when Lightning
    already counts the next epoch; its file is named for the epoch step 4 ran in (it said `epoch=1-step=4`)."""
    trainer = L.Trainer(max_epochs=1, limit_train_batches=4, limit_val_batches=0, accelerator="cpu", logger=False,
                        enable_progress_bar=False, enable_model_summary=False, plugins=[AtomicCheckpointIO()],
                        callbacks=[ModelCheckpoint(tmp_path / "ckpt", every_n_train_steps=3, save_top_k=-1),
                                   FinalCheckpoint()])
    trainer.fit(BoringModel())
    assert _names(tmp_path / "ckpt") == ["epoch=0-step=3.ckpt", "epoch=0-step=4.ckpt"]
    record_property("hardening", "checkpoint")
    record_property("case", "the final save after an epoch's end is named for that epoch")
    record_property("data_lost", 0)


@pytest.mark.parametrize("fast_dev_run", [True, 2])
def test_a_fast_dev_run_leaves_no_checkpoint(tmp_path, fast_dev_run, record_property):
    """Lightning suppresses checkpointing under `fast_dev_run`; `FinalCheckpoint` saved `last.ckpt` anyway, so the
    next real fit in that folder was refused (or resumed the smoke test's weights with `--ckpt_path last`)."""
    trainer = L.Trainer(fast_dev_run=fast_dev_run, accelerator="cpu", enable_progress_bar=False,
                        enable_model_summary=False, plugins=[AtomicCheckpointIO()],
                        callbacks=[ModelCheckpoint(tmp_path / "ckpt", every_n_train_steps=1, save_last=True),
                                   FinalCheckpoint()])
    trainer.fit(BoringModel())
    assert trainer.global_step > 0
    assert not (tmp_path / "ckpt").exists() or _names(tmp_path / "ckpt") == []
    record_property("hardening", "checkpoint")
    record_property("case", f"fast_dev_run={fast_dev_run} writes no checkpoint")
    record_property("data_lost", 0)
