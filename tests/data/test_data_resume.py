"""Data order under a real Trainer: epochs reshuffle, a resumed run sees the original order, seed is checked."""

import warnings

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_ffpa.data import MockDataModule, TextDataModule
from lightning_ffpa.errors import ConfigError


class Recorder(pl.LightningModule):
    """Records the first token of every row it trains on; the loss only exists to make steps."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.seen = []

    def training_step(self, batch, batch_idx):
        self.seen.append((self.current_epoch, batch["input_ids"][:, 0].tolist()))
        return (self.w * batch["input_ids"].float().mean()).sum()

    def validation_step(self, batch, batch_idx):
        pass

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def _fit(dm, max_epochs, tmp_path, ckpt_path=None, **kwargs):
    model = Recorder()
    trainer = pl.Trainer(
        **kwargs,
        max_epochs=max_epochs,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        num_sanity_val_steps=0,
    )
    trainer.fit(model, datamodule=dm, ckpt_path=ckpt_path)
    return model.seen, trainer


def _mock(seed=0):
    return MockDataModule(vocab_size=1000, seq_length=8, num_samples=24, batch_size=4, seed=seed)


@pytest.mark.timeout(120)
def test_resume_sees_the_same_order(tmp_path):
    full, _ = _fit(_mock(), 2, tmp_path / "a")
    epoch0 = [s for e, s in full if e == 0]
    epoch1 = [s for e, s in full if e == 1]
    assert len(epoch0) == len(epoch1) == 6 and epoch0 != epoch1  # epochs reshuffle

    _, trainer = _fit(_mock(), 1, tmp_path / "b")
    ckpt = str(tmp_path / "epoch0.ckpt")
    trainer.save_checkpoint(ckpt)
    state = torch.load(ckpt, weights_only=False)["MockDataModule"]
    assert state == {"seed": 0, "epoch": 0, "samples_done": 24, "num_replicas": 1, "batch_size": 4,
                     "epoch_samples": 24, "epoch_done": True}
    resumed, _ = _fit(_mock(), 2, tmp_path / "c", ckpt_path=ckpt)
    assert [s for e, s in resumed] == epoch1

    with pytest.raises(ConfigError, match=r"`data\.init_args\.seed=5`: the checkpoint was written with seed 0"):
        _fit(_mock(seed=5), 2, tmp_path / "d", ckpt_path=ckpt)


@pytest.mark.timeout(120)
def test_mid_epoch_resume_continues_with_the_next_batch(tmp_path):
    full, _ = _fit(_mock(), 2, tmp_path / "a")
    every2 = ModelCheckpoint(dirpath=tmp_path / "ckpts", every_n_train_steps=2, save_top_k=-1)
    _fit(_mock(), 2, tmp_path / "b", max_steps=5, callbacks=[every2])
    ckpt = str(tmp_path / "ckpts" / "epoch=0-step=4.ckpt")  # written mid-epoch 0, after 4 of its 6 batches
    assert torch.load(ckpt, weights_only=False)["MockDataModule"]["samples_done"] == 16
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed, _ = _fit(_mock(), 2, tmp_path / "c", ckpt_path=ckpt)
    assert resumed == full[4:]  # the two unseen batches of epoch 0, then all of epoch 1, nothing replayed
    # Lightning's "your dataloader is not resumable" would tell the user the opposite of what happened
    assert not [w for w in caught if "not resumable" in str(w.message)]

    # Lightning resumes the epoch by its count of batches, which a new batch size changes: refused by name
    bigger = MockDataModule(vocab_size=1000, seq_length=8, num_samples=24, batch_size=8, seed=0)
    with pytest.raises(ConfigError, match=r"^`data\.init_args\.batch_size=8`: the checkpoint stopped mid-epoch"):
        _fit(bigger, 1, tmp_path / "d", ckpt_path=ckpt)


@pytest.mark.timeout(180)
def test_mid_epoch_resume_in_a_later_epoch_with_workers(tmp_path):
    """With worker processes the loader draws its indices before Lightning's `set_epoch`: the resumed epoch
    replayed epoch 0's order and dropped the skip."""
    def mock():
        return MockDataModule(vocab_size=1000, seq_length=8, num_samples=24, batch_size=4, seed=0, num_workers=2)

    full, _ = _fit(mock(), 2, tmp_path / "a")
    every2 = ModelCheckpoint(dirpath=tmp_path / "ckpts", every_n_train_steps=2, save_top_k=-1)
    _fit(mock(), 2, tmp_path / "b", max_steps=9, callbacks=[every2])
    resumed, _ = _fit(mock(), 2, tmp_path / "c", ckpt_path=str(tmp_path / "ckpts" / "epoch=1-step=8.ckpt"))
    assert resumed == full[8:]


@pytest.mark.timeout(120)
def test_text_module_trains_with_workers_and_validation(tmp_path, write):
    path = write("a.txt", "\n\n".join(f"document number {i}" for i in range(20)))
    dm = TextDataModule(
        train_file=path, val_fraction=0.2, max_seq_length=32, batch_size=4, num_workers=1, pack=True
    )
    seen, trainer = _fit(dm, 1, tmp_path)
    assert len(seen) == len(dm._train) // 4 + bool(len(dm._train) % 4)
    assert trainer.num_val_batches == [1]


# where `last.ckpt` of a run stopped by `max_steps` is written: `on_train_end`, or `on_train_epoch_end`
SAVE_AT = {
    "train_end": {"every_n_train_steps": 1000},
    "train_epoch_end": {"every_n_epochs": 1, "save_on_train_epoch_end": True},
}


def _fit_steps(max_steps, root, ckpt_path=None, num_samples=40, save_at="train_end"):
    """Fit to `max_steps`; `last.ckpt` is written only where Lightning writes it when `max_steps` stops a run."""
    dm = MockDataModule(vocab_size=1000, seq_length=8, num_samples=num_samples, batch_size=4, seed=0)
    last = ModelCheckpoint(dirpath=root / "ckpts", save_last=True, **SAVE_AT[save_at])
    seen, trainer = _fit(dm, -1, root, ckpt_path=ckpt_path, max_steps=max_steps, callbacks=[last])
    return seen, trainer, str(root / "ckpts" / "last.ckpt")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("save_at", sorted(SAVE_AT))
def test_extending_a_finished_run_continues_its_epoch(tmp_path, save_at):
    full, straight, _ = _fit_steps(14, tmp_path / "a")  # 10 batches per epoch: crosses into epoch 1
    assert [e for e, _ in full] == [0] * 10 + [1] * 4

    first, _, last = _fit_steps(3, tmp_path / "b", save_at=save_at)
    loops = torch.load(last, weights_only=False)["loops"]["fit_loop"]
    assert loops["epoch_progress"]["current"]["processed"] == 1  # Lightning counts the cut epoch as done
    assert torch.load(last, weights_only=False)["MockDataModule"]["samples_done"] == 12
    second, _, _ = _fit_steps(6, tmp_path / "b", ckpt_path=last, save_at=save_at)  # epoch 0, batches 4..6
    # the rest of epoch 0, then epoch 1
    third, extended, _ = _fit_steps(14, tmp_path / "b", ckpt_path=last, save_at=save_at)
    assert first + second + third == full
    assert extended.current_epoch == straight.current_epoch
    assert extended.fit_loop.epoch_loop._batches_that_stepped == straight.fit_loop.epoch_loop._batches_that_stepped

    # the data position saved after the extension is the uninterrupted run's
    straight.save_checkpoint(tmp_path / "a.ckpt")
    extended.save_checkpoint(tmp_path / "b.ckpt")
    a, b = (torch.load(tmp_path / f"{n}.ckpt", weights_only=False) for n in "ab")
    assert a["MockDataModule"] == b["MockDataModule"] == {
        "seed": 0, "epoch": 1, "samples_done": 16, "num_replicas": 1, "batch_size": 4, "epoch_samples": 40,
        "epoch_done": False}
    assert a["loops"]["fit_loop"]["epoch_progress"] == b["loops"]["fit_loop"]["epoch_progress"]


@pytest.mark.timeout(120)
def test_a_run_that_stopped_at_its_epoch_end_starts_the_next_epoch(tmp_path):
    full, _, _ = _fit_steps(12, tmp_path / "a", num_samples=24)  # 6 batches per epoch
    first, _, last = _fit_steps(6, tmp_path / "b", num_samples=24)
    rest, _, _ = _fit_steps(12, tmp_path / "b", ckpt_path=last, num_samples=24)
    assert first + rest == full and [e for e, _ in rest] == [1] * 6


@pytest.mark.timeout(180)
def test_epoch_end_resume_with_workers_trains_the_next_epoch_whole(tmp_path):
    """The early worker iterator took the finished epoch's skip of every sample: the next epoch trained nothing."""
    def mock():
        return MockDataModule(vocab_size=1000, seq_length=8, num_samples=24, batch_size=4, seed=0, num_workers=2)

    full, _ = _fit(mock(), 2, tmp_path / "a")
    _, trainer = _fit(mock(), 1, tmp_path / "b")
    trainer.save_checkpoint(tmp_path / "epoch0.ckpt")
    resumed, _ = _fit(mock(), 2, tmp_path / "c", ckpt_path=str(tmp_path / "epoch0.ckpt"))
    assert resumed == full[6:]


def _fit_bs(batch_size, max_steps, root, ckpt_path=None, every=1000, **kwargs):
    """Fit 24 mock rows at `batch_size` to `max_steps`, saving `last` (and every `every` steps, or at each
    `on_train_epoch_end` for every="epoch")."""
    dm = MockDataModule(vocab_size=1000, seq_length=8, num_samples=24, batch_size=batch_size, seed=0)
    save_at = SAVE_AT["train_epoch_end"] if every == "epoch" else {"every_n_train_steps": every}
    ckpts = ModelCheckpoint(dirpath=root / "ckpts", save_last=True, **save_at)
    seen, _ = _fit(dm, -1, root, ckpt_path=ckpt_path, max_steps=max_steps, callbacks=[ckpts], **kwargs)
    return seen, str(root / "ckpts" / "last.ckpt")


@pytest.mark.timeout(180)
@pytest.mark.parametrize("every", [1000, 6, "epoch"])
@pytest.mark.parametrize(("before", "after"), [(4, 2), (2, 4), (4, 4)])
def test_epoch_end_resume_at_another_batch_size_trains_the_next_epoch_whole(tmp_path, every, before, after):
    """A `last` saved at epoch 0's end (after `max_steps`, by a save at its last batch: every=6 with 6 batches of
    4, or at `on_train_epoch_end`) resumed at batch size 2 started epoch 1 at batch 6 of 12: Lightning kept the saved batch count against the
    new loader's length, and half of epoch 1 was never trained."""
    per_epoch = 24 // after
    ref, _ = _fit_bs(after, 2 * per_epoch, tmp_path / "ref")
    _, last = _fit_bs(before, 24 // before, tmp_path / "a", every=every)
    resumed, _ = _fit_bs(after, 24 // before + per_epoch, tmp_path / "a", ckpt_path=last, every=every)
    assert resumed == ref[per_epoch:]  # all of epoch 1, in its order, at the new batch size


@pytest.mark.timeout(180)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_limited_epoch_end_resume_at_another_batch_size_starts_the_next_epoch(tmp_path, num_workers):
    """With `limit_train_batches` an epoch ends before the sampler's: a `last` at the end of epoch 1 was called
    "mid-epoch" (refused at another batch size), and with workers it replayed epoch 1's unseen rows."""
    def fit(batch_size, max_steps, root, ckpt_path=None):
        dm = MockDataModule(vocab_size=1000, seq_length=8, num_samples=24, batch_size=batch_size, seed=0,
                            num_workers=num_workers)
        ckpts = ModelCheckpoint(dirpath=root / "ckpts", save_last=True)
        seen, _ = _fit(dm, -1, root, ckpt_path=ckpt_path, max_steps=max_steps, callbacks=[ckpts],
                       limit_train_batches=3)
        return seen, str(root / "ckpts" / "last.ckpt")

    ref, _ = fit(2, 8, tmp_path / "ref")  # epochs 0 and 1 of 3 batches, then 2 of epoch 2
    ref4, last = fit(4, 6, tmp_path / "a")
    same, _ = fit(4, 8, tmp_path / "same", ckpt_path=last)
    assert same == fit(4, 8, tmp_path / "ref4")[0][6:]
    resumed, _ = fit(2, 8, tmp_path / "a", ckpt_path=last)
    assert resumed == ref[6:]  # epoch 2's first two batches of 2
