"""Mock data: shapes, per-index determinism, seeded epoch order, sharding across ranks."""

from types import SimpleNamespace

import pytest
import torch

from lightning_ffpa.data import MockDataModule, MockDataset
from lightning_ffpa.data.sampler import ResumableSampler


def test_mock_rows_are_deterministic_per_index():
    a = MockDataset(num_samples=16, seq_length=32, vocab_size=512, seed=3)
    b = MockDataset(num_samples=16, seq_length=32, vocab_size=512, seed=3)
    c = MockDataset(num_samples=16, seq_length=32, vocab_size=512, seed=4)
    assert torch.equal(a[5]["input_ids"], b[5]["input_ids"])  # same seed and index
    assert torch.equal(a[5]["input_ids"], a[5]["input_ids"])  # re-reading does not advance any state
    assert not torch.equal(a[5]["input_ids"], a[6]["input_ids"])
    assert not torch.equal(a[5]["input_ids"], c[5]["input_ids"])
    ids = torch.stack([a[i]["input_ids"] for i in range(16)])
    assert ids.min() >= 0 and ids.max() < 512 and ids.unique().numel() > 256
    with pytest.raises(IndexError):
        a[16]


def test_mock_batches_shapes_and_epoch_order():
    dm = MockDataModule(vocab_size=100, seq_length=12, num_samples=20, batch_size=4, seed=1)
    loader = dm.train_dataloader()
    batch = next(iter(loader))
    assert set(batch) == {"input_ids", "labels", "attention_mask"}
    assert all(v.shape == (4, 12) and v.dtype == torch.long for v in batch.values())
    assert torch.equal(batch["labels"], batch["input_ids"]) and bool(batch["attention_mask"].all())
    assert dm.max_seq_length == 12

    def epoch_ids(dm, epoch):
        loader = dm.train_dataloader()
        loader.sampler.set_epoch(epoch)  # what Lightning's fit loop does at each epoch start
        return torch.cat([b["input_ids"] for b in loader])

    fresh = MockDataModule(vocab_size=100, seq_length=12, num_samples=20, batch_size=4, seed=1)
    assert torch.equal(epoch_ids(dm, 1), epoch_ids(fresh, 1))  # (seed, epoch) fixes the order
    assert not torch.equal(epoch_ids(dm, 0), epoch_ids(dm, 1))  # epochs reshuffle
    assert dm.val_dataloader() == []


def test_mock_sharded_ranks_split_the_data():
    seen = []
    for rank in range(2):
        dm = MockDataModule(vocab_size=100, seq_length=4, num_samples=10, batch_size=5, seed=0)
        dm.trainer = SimpleNamespace(distributed_sampler_kwargs={"num_replicas": 2, "rank": rank})
        seen.append({tuple(r) for b in dm.train_dataloader() for r in b["input_ids"].tolist()})
    assert len(seen[0]) == len(seen[1]) == 5 and not seen[0] & seen[1]


def test_mock_state_dict_refuses_other_seed():
    dm = MockDataModule(seed=1)
    dm.train_dataloader().sampler.set_epoch(2)
    state = dm.state_dict()
    assert state == {"seed": 1, "epoch": 2, "samples_done": 0, "num_replicas": 1, "batch_size": 8,
                     "epoch_samples": len(dm.train_dataloader().sampler), "epoch_done": False}
    MockDataModule(seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match=r"`data\.init_args\.seed=2`: the checkpoint was written with seed 1"):
        MockDataModule(seed=2).load_state_dict(state)
    # mid-epoch on 2 ranks cannot continue on 1; at an epoch boundary (0 samples done) it can
    with pytest.raises(ValueError, match=r"mid-epoch on 2 data-parallel ranks, this run has 1"):
        MockDataModule(seed=1).load_state_dict({**state, "samples_done": 8, "num_replicas": 2})
    MockDataModule(seed=1).load_state_dict({**state, "num_replicas": 2})
    # mid-epoch on other data (another row count): the rest of that epoch is not where the checkpoint left it
    with pytest.raises(ValueError, match=r"^`data`: the training set has 1000 rows now \(1000 per data-parallel "
                                         r"rank\) but the checkpoint's epoch had 1024 per rank"):
        MockDataModule(seed=1, num_samples=1000).load_state_dict({**state, "samples_done": 8})
    MockDataModule(seed=1, num_samples=1000).load_state_dict(state)  # at an epoch boundary it can


def test_an_epoch_end_checkpoint_resumes_at_another_batch_size():
    """The checkpoint says whether its epoch was done: one that `limit_train_batches` ended after 3 batches of 16
    (48 of 1024 samples) was refused as "stopped mid-epoch"; a checkpoint from before the flag says it by samples."""
    saved = {**MockDataModule(seed=1, batch_size=16).state_dict(), "samples_done": 48, "epoch_samples": 1024}
    other = MockDataModule(seed=1, batch_size=8)
    assert other.resume_conflict({**saved, "epoch_done": True}, 1) is None
    assert other.resume_conflict({**saved, "epoch_done": False}, 1)[0] == "data.init_args.batch_size"
    older = {k: v for k, v in saved.items() if k != "epoch_done"}
    assert other.resume_conflict(older, 1)[0] == "data.init_args.batch_size"
    assert other.resume_conflict({**older, "samples_done": 1024}, 1) is None


def test_only_fit_resumes_the_training_data():
    """`validate` from a mid-epoch checkpoint at another batch size was refused as if it resumed the epoch."""
    from lightning.pytorch.trainer.states import TrainerFn

    state = {**MockDataModule(seed=1).state_dict(), "samples_done": 16}
    for fn, refused in ((TrainerFn.FITTING, True), (TrainerFn.VALIDATING, False), (TrainerFn.TESTING, False)):
        dm = MockDataModule(seed=1, batch_size=4)
        dm.trainer = SimpleNamespace(state=SimpleNamespace(fn=fn), distributed_sampler_kwargs=None)
        if refused:
            with pytest.raises(ValueError, match=r"`data\.init_args\.batch_size=4`: the checkpoint stopped mid-epoch"):
                dm.load_state_dict(state)
        else:
            dm.load_state_dict(state)


def test_resumable_sampler_skips_once_and_only_its_epoch():
    sampler = ResumableSampler(list(range(10)), num_replicas=1, rank=0, seed=0)
    sampler.set_epoch(3)
    order = list(sampler)
    sampler.set_epoch(0)
    sampler.skip_once(epoch=3, num_samples=4)  # moves to epoch 3: workers may draw before Lightning's set_epoch
    assert list(sampler) == order[4:]
    assert list(sampler) == order  # one-shot
    sampler.skip_once(epoch=2, num_samples=4)
    sampler.set_epoch(3)  # the checkpoint's epoch had ended: Lightning moves on
    assert list(sampler) == order  # a skip for another epoch is dropped


def test_mock_bad_args_name_option():
    with pytest.raises(ValueError, match=r"`data\.init_args\.seq_length=0`"):
        MockDataModule(seq_length=0)
    with pytest.raises(ValueError, match=r"`data\.init_args\.batch_size=0`"):
        MockDataModule(batch_size=0)


def test_preflight_refuses_a_mid_epoch_resume_on_another_layout_before_any_process_starts(tmp_path):
    """The data's resume checks run in the pre-flight on the layout the run will have (2 CPU ranks here),
    so the mismatch is one error before spawning, not one per rank after."""
    import lightning as L

    from lightning_ffpa.parallel import FSDP2Strategy
    from lightning_ffpa.validation import check_data_resumes

    dm = MockDataModule(seed=1)
    saved = {**dm.state_dict(), "samples_done": 8}  # stopped mid-epoch on one rank
    state = {"MockDataModule": saved}
    two_ranks = L.Trainer(accelerator="cpu", devices=2, strategy=FSDP2Strategy(), logger=False)
    with pytest.raises(ValueError, match=r"`trainer\.devices`: the checkpoint stopped mid-epoch on 1 data-parallel "
                                         r"rank, this run has 2"):
        check_data_resumes(two_ranks, dm, state)
    cp2 = L.Trainer(accelerator="cpu", devices=2, strategy=FSDP2Strategy(context_parallel_size=2), logger=False)
    check_data_resumes(cp2, dm, state)  # CP 2 on 2 ranks: one data-parallel rank, as saved
    with pytest.raises(ValueError, match=r"`data\.init_args\.seed=2`"):
        check_data_resumes(cp2, MockDataModule(seed=2), state)


def test_no_validation_rows_runs_no_batch_without_lightnings_warning(recwarn):
    """`num_val_samples=0` (the tiny recipes') gave [] and Lightning's "Total length of `list` across ranks is zero.
    Please make sure this was your intention." on every run: it was the intention."""
    import lightning as L

    from lightning_ffpa.module import Gemma4LM

    trainer = L.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    dm = MockDataModule(vocab_size=512, seq_length=16, num_samples=4, num_val_samples=0, batch_size=2)
    trainer.fit(Gemma4LM(preset="tiny", config_overrides={"num_hidden_layers": 1}), dm)
    assert trainer.global_step == 1 and sum(trainer.num_val_batches) == 0
    assert not [w for w in recwarn if "across ranks is zero" in str(w.message)]
