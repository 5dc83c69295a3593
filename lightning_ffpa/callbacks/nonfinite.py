"""The non-finite-loss guard: stop, or skip the update, when the loss or the gradients are NaN/inf.

Owns: detecting a non-finite loss (`on_before_backward`) or gradient (`on_before_optimizer_step`),
the `stop` / `skip` decision (the same on every rank), and refusing to write a checkpoint whose weights are
not finite, so the last good checkpoint is never overwritten by a NaN state.
Does not own the loss itself or checkpoint scheduling (`ModelCheckpoint`).

`skip` drops the gradients of that step (AdamW leaves a parameter with `grad=None` untouched, moments
included); the step counter and the LR schedule still advance, as they would with AMP's inf-skipping.
"""

from __future__ import annotations

from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_warn


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # DTensor shard under FSDP2


class NonFiniteGuard(pl.Callback):
    """Stop training, or skip the optimizer step, when the loss or any gradient is not finite."""

    def __init__(self, action: Literal["stop", "skip"] = "stop", max_consecutive_skips: int = 10,
                 check_grads: bool = True) -> None:
        """
        Args:
            action: `stop` raises FloatingPointError before the update; `skip` drops that step's update.
            max_consecutive_skips: with `skip`, stop after this many non-finite steps in a row (diverged).
            check_grads: also check every gradient before the optimizer step (catches inf grads of a finite loss).
        """
        if action not in ("stop", "skip"):
            raise ValueError(f"`NonFiniteGuard.action={action!r}` must be 'stop' or 'skip'")
        if max_consecutive_skips < 1:
            raise ValueError(f"`NonFiniteGuard.max_consecutive_skips={max_consecutive_skips}` must be >= 1")
        self.action, self.max_consecutive_skips, self.check_grads = action, max_consecutive_skips, check_grads
        self.num_skipped = 0  # total steps skipped (reported, and saved in checkpoints)
        self._consecutive = 0
        self._bad_loss: float | None = None

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        finite = bool(torch.isfinite(loss.detach()).all())
        self._bad_loss = None if finite else float(loss.detach().float().mean())

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        bad_grads = 0
        if self.check_grads:
            bad_grads = sum(1 for p in pl_module.parameters()
                            if p.grad is not None and not bool(torch.isfinite(_local(p.grad)).all()))
        ok = trainer.strategy.reduce_boolean_decision(self._bad_loss is None and bad_grads == 0, all=True)
        if ok:
            self._consecutive = 0
            return
        what = (f"loss {self._bad_loss}" if self._bad_loss is not None else f"{bad_grads} non-finite gradient(s)")
        where = f"at step {trainer.global_step + 1} (epoch {trainer.current_epoch})"
        last = getattr(trainer.checkpoint_callback, "last_model_path", "") or getattr(
            trainer.checkpoint_callback, "best_model_path", "")
        if self.action == "stop" or self._consecutive + 1 > self.max_consecutive_skips:
            reason = ("NonFiniteGuard(action='stop')" if self.action == "stop" else
                      f"{self._consecutive + 1} non-finite steps in a row (max_consecutive_skips="
                      f"{self.max_consecutive_skips})")
            raise FloatingPointError(f"non-finite {what} {where}; stopped by {reason} before the update. "
                                     f"Last good checkpoint: {last or 'none written yet'}")
        self._consecutive += 1
        self.num_skipped += 1
        optimizer.zero_grad(set_to_none=True)  # no grad -> AdamW skips the parameter and its moments
        rank_zero_warn(f"NonFiniteGuard: non-finite {what} {where}; update skipped "
                       f"({self.num_skipped} skipped so far)")

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        bad = [n for n, p in pl_module.named_parameters() if not bool(torch.isfinite(_local(p.detach())).all())]
        if not trainer.strategy.reduce_boolean_decision(not bad, all=True):
            raise FloatingPointError(
                f"NonFiniteGuard: refusing to write a checkpoint at step {trainer.global_step}: non-finite weights "
                f"in {bad[:5]}{'...' if len(bad) > 5 else ''}; the previous checkpoints are kept as they are"
            )

    def state_dict(self) -> dict[str, Any]:
        return {"num_skipped": self.num_skipped}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.num_skipped = int(state_dict.get("num_skipped", 0))
