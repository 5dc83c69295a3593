"""NonFiniteGuard: `stop` ends the run before the NaN update and keeps the last good checkpoint; `skip`
drops exactly the poisoned update and training continues with finite weights."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from _helpers import tree_hash

from lightning_ffpa.callbacks.nonfinite import NonFiniteGuard
from lightning_ffpa.data import MockDataModule
from lightning_ffpa.module import Gemma4LM

POISON_AT = 3  # the optimizer step whose loss is NaN


class _PoisonedLM(Gemma4LM):
    """Gemma4LM whose loss is NaN at one step, returned as is (the guard, not the module, reacts).

    Gemma4LM.training_step raises FloatingPointError itself today, which leaves `skip` no way to work;
    this mirrors the proposed module change (return the loss, let the guard decide).
    """

    def training_step(self, batch, batch_idx):
        loss, _ = self.compute_loss(batch)
        if self.global_step + 1 == POISON_AT:
            loss = loss * float("nan")
        return loss


class _Weights(pl.Callback):
    """Checksum of the weights after every optimizer step."""

    def __init__(self) -> None:
        self.sums: dict[int, float] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.sums[trainer.global_step] = float(sum(p.double().sum() for p in pl_module.parameters()))


def _fit(tmp_path, action, max_steps=5):
    torch.manual_seed(0)
    lm = _PoisonedLM(preset="tiny", dtype="float32", warmup_steps=1)
    ckpt = pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=1, save_top_k=-1, save_last=True)
    weights, guard = _Weights(), NonFiniteGuard(action=action)
    trainer = pl.Trainer(max_steps=max_steps, accelerator="cpu", logger=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[guard, weights, ckpt])
    dm = MockDataModule(seq_length=16, num_samples=8, batch_size=2)
    return trainer, lm, dm, guard, weights


def test_stop_keeps_last_good_checkpoint(tmp_path, record_property):
    trainer, lm, dm, _, _ = _fit(tmp_path, "stop")
    with pytest.raises(FloatingPointError, match=rf"non-finite loss nan at step {POISON_AT}.*action='stop'"):
        trainer.fit(lm, dm)
    names = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    last = torch.load(tmp_path / "ckpt" / "last.ckpt", map_location="cpu", weights_only=True)
    finite = all(torch.isfinite(t).all() for t in last["state_dict"].values())
    record_property("hardening", "fault")
    record_property("case", f"NaN loss at step {POISON_AT}, action=stop")
    record_property("data_lost", int(last["global_step"] != POISON_AT - 1) + int(not finite))
    assert last["global_step"] == POISON_AT - 1 and finite
    assert not any(f"step={POISON_AT}" in n for n in names), names


def test_skip_drops_only_the_poisoned_update(tmp_path, record_property):
    trainer, lm, dm, guard, weights = _fit(tmp_path, "skip")
    with pytest.warns(UserWarning, match="update skipped"):
        trainer.fit(lm, dm)
    assert trainer.global_step == 5 and guard.num_skipped == 1
    assert weights.sums[POISON_AT] == weights.sums[POISON_AT - 1]  # the NaN step changed nothing
    assert weights.sums[POISON_AT + 1] != weights.sums[POISON_AT]  # and training went on
    last = torch.load(tmp_path / "ckpt" / "last.ckpt", map_location="cpu", weights_only=True)
    finite = all(torch.isfinite(t).all() for t in last["state_dict"].values())
    record_property("hardening", "fault")
    record_property("case", f"NaN loss at step {POISON_AT}, action=skip")
    record_property("data_lost", int(not finite))
    assert finite and last["global_step"] == 5


def test_refuses_to_write_a_checkpoint_of_non_finite_weights(tmp_path, record_property):
    trainer, lm, dm, _, _ = _fit(tmp_path, "stop", max_steps=2)
    trainer.fit(lm, dm)
    before = tree_hash(tmp_path / "ckpt")
    with torch.no_grad():
        next(lm.parameters()).fill_(float("inf"))
    with pytest.raises(FloatingPointError, match="refusing to write a checkpoint"):
        trainer.save_checkpoint(tmp_path / "ckpt" / "last.ckpt")
    changed = before != tree_hash(tmp_path / "ckpt")
    record_property("hardening", "fault")
    record_property("case", "save requested with inf weights")
    record_property("data_lost", int(changed))
    assert not changed


def test_real_module_lets_the_guard_skip(tmp_path):
    lm = Gemma4LM(preset="tiny", dtype="float32")
    lm.configure_model()
    with torch.no_grad():
        lm.model.get_input_embeddings().weight.fill_(float("nan"))
    batch = MockDataModule(seq_length=8, num_samples=2, batch_size=2).train_dataloader().__iter__().__next__()
    loss = lm.training_step(batch, 0)
    assert not torch.isfinite(loss)


class _HostReads(pl.Callback):
    """Counts reads of a tensor's value on the host (`bool`, `item`, `tolist`) inside the guard's step hook."""

    def __init__(self, guard: NonFiniteGuard, monkeypatch) -> None:
        self.reads: list[int] = []
        counter = {"n": 0}
        hook = guard.on_before_optimizer_step

        def counted(name):
            original = getattr(torch.Tensor, name)

            def read(self, *args, **kwargs):
                counter["n"] += 1
                return original(self, *args, **kwargs)
            return read

        def wrapped(trainer, pl_module, optimizer):
            with monkeypatch.context() as m:
                for name in ("__bool__", "item", "tolist"):
                    m.setattr(torch.Tensor, name, counted(name))
                counter["n"] = 0
                hook(trainer, pl_module, optimizer)
            self.reads.append(counter["n"])

        guard.on_before_optimizer_step = wrapped


def test_a_step_reads_the_checks_on_the_host_once(tmp_path, monkeypatch):
    """The loss and every gradient are checked with one host read per step, not one per parameter."""
    torch.manual_seed(0)
    lm = Gemma4LM(preset="tiny", dtype="float32", warmup_steps=1)
    guard = NonFiniteGuard(action="skip")
    reads = _HostReads(guard, monkeypatch)
    trainer = pl.Trainer(max_steps=3, accelerator="cpu", logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, callbacks=[guard],
                         accumulate_grad_batches=2)
    trainer.fit(lm, MockDataModule(seq_length=16, num_samples=16, batch_size=2))
    assert sum(p.grad is not None for p in lm.parameters()) > 10
    assert reads.reads == [1, 1, 1]


def test_a_nan_in_an_earlier_micro_batch_is_not_hidden_by_a_later_finite_one(tmp_path):
    guard = NonFiniteGuard(action="stop", check_grads=False)
    trainer = pl.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False)
    lm = torch.nn.Linear(2, 2)
    guard.on_before_backward(trainer, lm, torch.tensor(float("nan")))
    guard.on_before_backward(trainer, lm, torch.tensor(1.0))
    with pytest.raises(FloatingPointError, match="non-finite loss nan"):
        guard.on_before_optimizer_step(trainer, lm, None)


def test_an_inf_gradient_of_a_finite_loss_is_named_with_its_count():
    guard = NonFiniteGuard(action="stop")
    trainer = pl.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False)
    lm = torch.nn.Linear(2, 2)
    lm.weight.grad, lm.bias.grad = torch.full((2, 2), float("inf")), torch.zeros(2)
    guard.on_before_backward(trainer, lm, torch.tensor(1.0))
    with pytest.raises(FloatingPointError, match=r"non-finite gradients in 1 tensor\(s\) at step 1"):
        guard.on_before_optimizer_step(trainer, lm, None)


@pytest.mark.parametrize("max_skips", [1, 3])
def test_skip_stops_after_exactly_max_consecutive_skips(max_skips):
    """`max_consecutive_skips=N`: N non-finite steps in a row are skipped, the (N+1)th stops the run; a finite
    step in between starts the count again."""
    guard = NonFiniteGuard(action="skip", max_consecutive_skips=max_skips)
    trainer = pl.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False)
    lm = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(lm.parameters(), lr=0.1)

    def step(loss: float) -> None:
        guard.on_before_backward(trainer, lm, torch.tensor(loss))
        guard.on_before_optimizer_step(trainer, lm, optimizer)

    with pytest.warns(UserWarning, match="update skipped"):
        for _ in range(max_skips):
            step(float("nan"))
    step(1.0)  # finite: the run of skips ends
    with pytest.warns(UserWarning, match="update skipped"):
        for _ in range(max_skips):
            step(float("nan"))
    assert guard.num_skipped == 2 * max_skips
    with pytest.raises(FloatingPointError, match=rf"{max_skips + 1} non-finite steps in a row "
                                                 rf"\(max_consecutive_skips={max_skips}\)"):
        step(float("nan"))
    assert guard.num_skipped == 2 * max_skips


def test_float8_tensors_are_checked_by_their_bit_patterns():
    """A LoRA's float8 base (`model.lora.base_dtype: fp8`) is among the weights a checkpoint save checks; torch has
    no isfinite for float8, so its NaN (e4m3fn) and inf/NaN (e5m2) patterns are read as bits."""
    from lightning_ffpa.callbacks.nonfinite import all_finite, count_nonfinite

    for dtype, bad in ((torch.float8_e4m3fn, [float("nan")]), (torch.float8_e5m2, [float("nan"), float("inf")])):
        ok = torch.tensor([0.0, -448.0 if dtype == torch.float8_e4m3fn else -57344.0, 1e-3, 3.0]).to(dtype)
        assert bool(all_finite(ok)), dtype
        for value in bad:
            poisoned = ok.clone()
            poisoned[1] = torch.tensor(value).to(dtype)
            assert not bool(all_finite(poisoned)), (dtype, value)
            assert int(count_nonfinite([ok, poisoned, torch.ones(2)], torch.device("cpu"))) == 1
