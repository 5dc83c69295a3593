"""Gradient accumulation and data parallelism weigh tokens, not micro-batches or ranks: micro-batches holding
different numbers of labelled tokens, accumulated or on two ranks, give the gradient of one batch of 8 rows (the
mean over all of the step's labelled tokens)."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_ffpa.module import Gemma4LM

from ._launch import torchrun_json
from ._token_rows import token_rows


def _assert_same(got: dict, want: dict, rel: float = 1e-4) -> None:
    """Per tensor, relative to its norm: the sums run in another order (weighing micro-batches equally is 29% off)."""
    assert got.keys() == want.keys() and want
    for name, g in want.items():
        assert float((got[name] - g).norm()) <= rel * float(g.norm()) + 1e-8, name


class _Grads(pl.Callback):
    """The gradients the optimizer would step with (read where gradient clipping reads them)."""

    def __init__(self) -> None:
        self.grads: dict[str, torch.Tensor] = {}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.grads = {n: p.grad.clone() for n, p in pl_module.named_parameters() if p.grad is not None}


def _step_grads(batch_size: int, accumulate: int, loss_impl: str = "plain", pretrained: Path = None) -> dict:
    lm = Gemma4LM(pretrained=str(pretrained), dtype="float32", attn_implementation="eager", loss_impl=loss_impl,
                  loss_chunk_size=16, warmup_steps=0)
    grads = _Grads()
    trainer = pl.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, callbacks=[grads],
                         accumulate_grad_batches=accumulate)
    trainer.fit(lm, DataLoader(token_rows(), batch_size=batch_size))
    return grads.grads


@pytest.mark.parametrize("loss_impl", ["plain", "chunked"])
def test_accumulated_gradient_equals_the_big_batch(loss_impl, pretrained):
    whole = _step_grads(8, 1, loss_impl, pretrained=pretrained)
    parts = _step_grads(4, 2, loss_impl, pretrained=pretrained)
    _assert_same(parts, whole)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("cp, loss_impl, port, rel", [(1, "plain", 29641, 1e-4), (2, "plain", 29652, 1e-3),
                                                     (2, "chunked", 29663, 1e-3)], ids=["dp2", "cp2", "cp2-chunked"])
def test_two_ranks_accumulating_give_the_big_batch_gradient(tmp_path, pretrained, cp, loss_impl, port, rel):
    """dp2: each rank accumulates two micro-batches of its own. cp2: both ranks read 4-row micro-batches and keep
    their shard of each (the ring's attention against eager's: up to ~1e-4 apart per tensor)."""
    whole = _step_grads(8, 1, pretrained=pretrained)
    out = torchrun_json(Path(__file__).with_name("_fit_token_weights.py"), tmp_path / "out.json", 2, port,
                        pretrained, cp, loss_impl)
    saved = torch.load(out["grads"], weights_only=True)
    parts = {k.replace("_checkpoint_wrapped_module.", ""): g for k, g in saved.items()}  # FSDP2Strategy's AC wrapper
    _assert_same(parts, whole, rel)
    # `train/grad_norm`'s reduction of FSDP2's gradient shards: the norm of the whole gradient, on every rank
    want = float(torch.stack([g.norm() for g in whole.values()]).norm())
    assert out["grad_norm"] == pytest.approx(want, rel=rel)
