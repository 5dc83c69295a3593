"""FSDP2Strategy's sharded checkpoints on 2 gloo ranks (one torchrun launch of `_dcp_ranks.py`).

Each rank writes its own shard; folders appear only when complete; the last 2 are kept (ModelCheckpoint
`save_top_k=2, monitor=step`); async saves complete and resume bit-exactly; a too-small disk on one rank is
refused on both before writing; a write that fails on one rank mid-save leaves `last` on the previous folder.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "parallel"))
from _launch import torchrun_json  # noqa: E402

SCRIPT = Path(__file__).with_name("_dcp_ranks.py")
SHARDS = [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"]  # one shard file per rank

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    root = tmp_path_factory.mktemp("dcp")
    return torchrun_json(SCRIPT, root / "report.json", 2, 29641, root, timeout=400)


def _kept(listing: dict, steps: list[int]) -> None:
    assert listing == {**{f"epoch=0-step={s}.ckpt": SHARDS for s in steps},
                       "last.ckpt": f"-> epoch=0-step={steps[-1]}.ckpt"}, listing  # no .partial left


def test_sync_saves_are_sharded_and_only_the_last_two_kept(report, record_property):
    record_property("hardening", "checkpoint")
    record_property("case", "FSDP2 (2 ranks): one shard per rank, last 2 kept, last -> newest")
    _kept(report["sync"], [3, 4])


def test_async_saves_complete_and_resume(report, record_property):
    record_property("hardening", "checkpoint")
    record_property("case", "FSDP2 (2 ranks): async DCP save completes and resumes bit-exactly")
    assert report["async_saved"] == 4  # every step's save was published
    _kept(report["async"], [3, 4])
    assert report["resumed_start_hash"] == report["async_end_hash"]  # weights restored from the async save
    assert report["resumed_step"] == 6
    _kept(report["async_after_resume"], [5, 6])


def test_too_small_disk_on_one_rank_is_refused_everywhere_before_writing(report, record_property):
    record_property("hardening", "checkpoint")
    record_property("case", "FSDP2 (2 ranks): one rank's disk too small -> one line, nothing written")
    assert report["full"].startswith("`ModelCheckpoint.dirpath=") and "is free" in report["full"]
    assert "\n" not in report["full"]
    assert report["full_listing"] == {}


def test_failed_write_on_one_rank_leaves_last_on_the_previous_checkpoint(report, record_property):
    record_property("hardening", "checkpoint")
    record_property("case", "FSDP2 (2 ranks): write fails mid-save on rank 1 -> nothing published, last unchanged")
    assert report["fail"].startswith("OSError: [Errno 28]"), report["fail"]
    _kept(report["fail_listing"], [1, 2])


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_async_dcp_save_on_one_gpu_with_nccl(tmp_path):
    """On CUDA the training group is NCCL; the background save runs on its own gloo group and publishes."""
    import lightning as L
    import torch
    from _dcp_ranks import HashAtStart, Net, weights_hash
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_ffpa.parallel import FSDP2Strategy

    data = DataLoader(TensorDataset(torch.randn(32, 16, generator=torch.Generator().manual_seed(1))), batch_size=4)

    def fit(steps, ckpt_path=None):
        start = HashAtStart()
        trainer = L.Trainer(accelerator="gpu", devices=1, max_steps=steps, logger=False, enable_progress_bar=False,
                            strategy=FSDP2Strategy(async_save=True, param_dtype="fp32", reduce_dtype="fp32",
                                                   activation_checkpointing="none", compile=False),
                            callbacks=[ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=2,
                                                       monitor="step", mode="max", save_last="link"), start])
        module = Net()
        trainer.fit(module, data, ckpt_path=ckpt_path)
        return trainer, module, start

    trainer, module, _ = fit(3)
    assert trainer.strategy._dcp_writer.num_saved == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["epoch=0-step=2.ckpt", "epoch=0-step=3.ckpt", "last.ckpt"]
    end = weights_hash(module)
    _, _, start = fit(4, ckpt_path="last")
    assert start.hash == end


@pytest.mark.parametrize("free, full", [(2**20, True), (2**40, False)], ids=["full", "not-full"])
def test_a_rank_whose_torch_writer_failed_on_a_full_disk_is_reported_as_no_space(tmp_path, monkeypatch, free, full):
    """DCP wraps each rank's failure; torch's zip-writer RuntimeError on a (nearly) full disk becomes ENOSPC."""
    from lightning_ffpa.checkpoint import atomic, sharded

    class Failed(Exception):  # DCP's CheckpointException carries {rank: (exception, traceback summary)}
        failures = {1: (RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"), "tb")}

    monkeypatch.setattr(atomic, "free_bytes", lambda d: free)
    got = sharded._disk_full(Failed(), tmp_path)
    assert (got is not None and got.errno == 28 and "rank 1" in str(got)) if full else got is None
