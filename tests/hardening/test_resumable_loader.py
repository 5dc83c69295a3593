"""ResumableDataLoader under a real Trainer: a mid-epoch resume serves exactly the batches not yet seen.

In-process and model-free (a 1-parameter module), so it runs in about a second. It also pins the Lightning
behaviour the loader exists for: a plain DataLoader restarts the epoch, repeating and dropping batches.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

from lightning_ffpa.checkpoint import ResumableDataLoader, ResumableSampler


class _Seen(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.seen: list[list[int]] = []

    def training_step(self, batch, batch_idx):
        self.seen.append(batch.tolist())
        return (self.w * batch.float()).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _loader(resumable: bool, n: int = 10, bs: int = 2):
    data = torch.arange(n)
    if resumable:
        return ResumableDataLoader(data, sampler=ResumableSampler(data, num_replicas=1, rank=0, seed=3), batch_size=bs)
    return DataLoader(data, sampler=DistributedSampler(data, num_replicas=1, rank=0, seed=3), batch_size=bs)


def _trainer(tmp_path, max_steps, ckpt=None):
    cbs = [pl.callbacks.ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=3, save_top_k=-1)] if ckpt else []
    return pl.Trainer(max_steps=max_steps, accelerator="cpu", logger=False, enable_progress_bar=False,
                      enable_model_summary=False, enable_checkpointing=bool(ckpt), callbacks=cbs)


@pytest.mark.parametrize("resumable", [True, False])
def test_mid_epoch_resume_serves_the_rest_of_the_epoch(tmp_path, resumable):
    ref = _Seen()
    _trainer(tmp_path / "ref", 12).fit(ref, _loader(resumable))  # 5 batches per epoch: 2.4 epochs
    first = _Seen()
    _trainer(tmp_path / "a", 3, ckpt=True).fit(first, _loader(resumable))  # checkpoint at step 3, mid-epoch 0
    resumed = _Seen()
    _trainer(tmp_path / "b", 12).fit(resumed, _loader(resumable), ckpt_path=str(tmp_path / "a" / "epoch=0-step=3.ckpt"))
    if resumable:
        assert first.seen + resumed.seen == ref.seen
    else:
        # what the loader fixes: Lightning restarts a plain loader at batch 0, so epoch 0 repeats its first batches
        assert first.seen + resumed.seen != ref.seen
        assert resumed.seen[:2] == ref.seen[:2]


def test_checkpoint_on_last_batch_starts_next_epoch_at_zero():
    loader = _loader(True)
    loader.load_state_dict({"epoch": 0, "batches": 5, "batch_size": 2, "num_replicas": 1, "num_samples": 10})
    loader.sampler.set_epoch(1)  # Lightning moves to epoch 1 when the checkpoint closed epoch 0
    ref = _loader(True)
    ref.sampler.set_epoch(1)
    assert [b.tolist() for b in loader] == [b.tolist() for b in ref]


@pytest.mark.parametrize("key, value, option", [("batch_size", 4, "data.batch_size"),
                                                 ("num_replicas", 2, "data-parallel size")])
def test_changed_geometry_is_refused_by_name(key, value, option):
    state = {"epoch": 0, "batches": 2, "batch_size": 2, "num_replicas": 1, "num_samples": 10, key: value}
    with pytest.raises(ValueError, match=option):
        _loader(True).load_state_dict(state)
