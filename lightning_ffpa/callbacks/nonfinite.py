"""The non-finite-loss guard: stop, or skip the update, when the loss or the gradients are NaN/inf.

Owns: detecting a non-finite loss (`on_before_backward`) or gradient (`on_before_optimizer_step`),
the `stop` / `skip` decision (the same on every rank), and refusing to write a checkpoint whose weights are
not finite, so the last good checkpoint is never overwritten by a NaN state.
Does not own the loss itself or checkpoint scheduling (`ModelCheckpoint`).

`skip` drops the gradients of that step (AdamW leaves a parameter with `grad=None` untouched, moments
included); the step counter and the LR schedule still advance, as they would with AMP's inf-skipping.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_warn

from lightning_ffpa.errors import TrainingDiverged


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # DTensor shard under FSDP2


# float8 has no isfinite kernel: its non-finite values are bit patterns (e4m3fn: NaN only, all exponent and mantissa
# bits set; e5m2: inf and NaN, all exponent bits set), read through a uint8 view (a LoRA's float8 base).
_FLOAT8_NONFINITE = {torch.float8_e4m3fn: 0x7F, torch.float8_e5m2: 0x7C}


def all_finite(t: torch.Tensor) -> torch.Tensor:
    """Whether every value of `t` is finite, as a 0-d bool tensor where `t` lives (float8 included)."""
    mask = _FLOAT8_NONFINITE.get(t.dtype)
    if mask is None:
        return torch.isfinite(t).all()
    return ((t.view(torch.uint8) & mask) != mask).all()


def count_nonfinite(tensors: Iterable[torch.Tensor], device: torch.device) -> torch.Tensor:
    """How many of `tensors` hold a NaN or inf, as a tensor on `device`, with no device-to-host sync.

    Why: reading each tensor's check on the host (`bool(...)`) waits for the device once per tensor, hundreds
    of times per step for a 60-layer model. Tensors on other devices (CPU-offloaded gradients) are counted
    where they live and only their count moves."""
    flags: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        flags.setdefault(t.device, []).append(all_finite(t))
    total = torch.zeros((), dtype=torch.int64, device=device)
    for group in flags.values():
        total += (~torch.stack(group)).sum().to(device)
    return total


class NonFiniteGuard(pl.Callback):
    """Stop training, or skip the optimizer step, when the loss or any gradient is not finite.

    The loss and gradient checks of a step are read on the host once, at the optimizer step, together with
    the other ranks' in one all-reduce (none on a single process)."""

    def __init__(self, action: Literal["stop", "skip"] = "stop", max_consecutive_skips: int = 10,
                 check_grads: bool = True) -> None:
        """
        Args:
            action: `stop` raises TrainingDiverged (a FloatingPointError; `lightning-ffpa` exits 3) before the
                update; `skip` drops that step's update.
            max_consecutive_skips: with `skip`, skip at most this many non-finite steps in a row; the next one in a row stops the run (diverged).
            check_grads: also check every gradient before the optimizer step (catches inf grads of a finite loss).
        """
        if action not in ("stop", "skip"):
            raise ValueError(f"`NonFiniteGuard.action={action!r}` must be 'stop' or 'skip'")
        if max_consecutive_skips < 1:
            raise ValueError(f"`NonFiniteGuard.max_consecutive_skips={max_consecutive_skips}` must be >= 1")
        self.action, self.max_consecutive_skips, self.check_grads = action, max_consecutive_skips, check_grads
        self.num_skipped = 0  # total steps skipped (reported, and saved in checkpoints)
        self._consecutive = 0
        self._losses: list[torch.Tensor] = []  # this optimizer step's losses (one per accumulated micro-batch)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._losses = []

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        self._losses.append(loss.detach().float().reshape(-1))  # checked at the optimizer step, not here

    def _agree(self, trainer: pl.Trainer, counts: torch.Tensor) -> list[int]:
        """Per-rank counts summed over the ranks; the step's single read on the host."""
        if trainer.world_size > 1:
            counts = trainer.strategy.reduce(counts, reduce_op="sum")
        return [int(n) for n in counts.tolist()]

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        device = trainer.strategy.root_device
        losses, self._losses = self._losses, []
        loss = torch.cat(losses).to(device) if losses else torch.zeros(1, device=device)
        grads = [_local(p.grad) for p in pl_module.parameters() if p.grad is not None] if self.check_grads else []
        bad_loss, bad_grads = self._agree(trainer, torch.stack([count_nonfinite([loss], device),
                                                               count_nonfinite(grads, device)]))
        if not bad_loss and not bad_grads:
            self._consecutive = 0
            return
        local_bad = loss[~torch.isfinite(loss)]
        what = (f"loss {float(local_bad[0])}" if local_bad.numel() else "loss on another rank" if bad_loss
                else f"gradients in {bad_grads} tensor(s)")
        where = f"at step {trainer.global_step + 1} (epoch {trainer.current_epoch})"
        last = getattr(trainer.checkpoint_callback, "last_model_path", "") or getattr(
            trainer.checkpoint_callback, "best_model_path", "")
        if self.action == "stop" or self._consecutive + 1 > self.max_consecutive_skips:
            reason = ("NonFiniteGuard(action='stop')" if self.action == "stop" else
                      f"{self._consecutive + 1} non-finite steps in a row (max_consecutive_skips="
                      f"{self.max_consecutive_skips})")
            raise TrainingDiverged(f"non-finite {what} {where}; stopped by {reason} before the update. "
                                     f"Last good checkpoint: {last or 'none written yet'}")
        self._consecutive += 1
        self.num_skipped += 1
        optimizer.zero_grad(set_to_none=True)  # no grad -> AdamW skips the parameter and its moments
        rank_zero_warn(f"NonFiniteGuard: non-finite {what} {where}; update skipped "
                       f"({self.num_skipped} skipped so far)")

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        device = trainer.strategy.root_device
        params = [(n, _local(p.detach())) for n, p in pl_module.named_parameters()]
        (bad_count,) = self._agree(trainer, count_nonfinite([t for _, t in params], device).reshape(1))
        if bad_count:
            bad = [n for n, t in params if not bool(all_finite(t))]  # names, on the failing path only
            raise TrainingDiverged(
                f"NonFiniteGuard: refusing to write a checkpoint at step {trainer.global_step}: non-finite weights "
                f"in {bad[:5] or 'another rank'}{'...' if len(bad) > 5 else ''}; the previous checkpoints are kept "
                "as they are"
            )

    def state_dict(self) -> dict[str, Any]:
        return {"num_skipped": self.num_skipped}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.num_skipped = int(state_dict.get("num_skipped", 0))
