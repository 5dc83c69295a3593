"""Resuming a run from a checkpoint written after its fit loop ended (`max_steps` or `max_epochs` reached).

Owns: rewriting the fit-loop counters of such a checkpoint so that Lightning continues where the data
stopped. When `max_steps` is reached, Lightning ends the epoch loop and still runs the epoch-end
bookkeeping (`epoch_progress.processed`, `on_train_epoch_end`, then `on_train_end`, where
`ModelCheckpoint(save_last=True)` writes `last`). Resumed with a larger `max_steps`, such a checkpoint
(Lightning 2.6) either starts the next epoch and skips the rest of a cut epoch, or, when the stop fell on
the epoch's last batch, skips the whole next epoch. The data position (`SeededDataModule.state_dict`) is
right in both cases; the loop counters are not. The rewrite turns them into the counters a checkpoint
written at `on_train_batch_end` of the same step holds, a state Lightning resumes correctly (mid-epoch,
or into the next epoch after a last batch). A checkpoint whose epoch had trained its last batch is rewritten
so the next epoch starts at its first batch under any batch count an epoch (`start_next_epoch`). Does not own
the data position (`base.py`, `sampler.py`).
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.utilities import rank_zero_info

from lightning_ffpa._compat import lightning as lightning_compat


def loaded_loops_state(trainer: Any) -> dict[str, Any] | None:
    """The `loops` part of the checkpoint the trainer is restoring (before it restores its loops), or None."""
    # Lightning keeps the loaded dict on its private checkpoint connector between restoring the modules
    # (which calls `LightningDataModule.load_state_dict`) and restoring the loops; there is no public hook
    # that sees the whole checkpoint from a datamodule.
    checkpoint = lightning_compat.loaded_checkpoint(trainer)
    return None if checkpoint is None else checkpoint.get("loops")


def saved_after_fit_end(fit_loop: dict[str, Any]) -> bool:
    """True for the counters Lightning resumes wrongly: the epoch bookkeeping ran after the step's batch
    was done, and either the epoch was cut before its last batch or `on_train_end` had completed it."""
    epoch = fit_loop.get("epoch_progress", {}).get("current", {})
    batches = fit_loop.get("epoch_loop.batch_progress", {})
    cur = batches.get("current", {})
    if not epoch or not cur:
        return False
    epoch_processed = epoch["processed"] == epoch["started"] == epoch["ready"] > 0
    batch_done = cur["ready"] == cur["started"] == cur["processed"] == cur["completed"] > 0
    # a checkpoint of `on_train_epoch_end` after a full epoch (completed == processed - 1) resumes fine
    cut_or_ended = not batches.get("is_last_batch", True) or epoch["completed"] == epoch["processed"]
    return epoch_processed and batch_done and cut_or_ended


def _to_batch_end(fit_loop: dict[str, Any]) -> None:
    """Rewrite, in place, counters saved after the step's batch was done (fit end, `on_train_epoch_end`) into what
    `on_train_batch_end` of the same step would have saved: the batch not yet `completed` (the resume completes
    it), the epoch not yet `processed`, the step not yet counted as stepped."""
    for scope in ("total", "current"):
        progress = fit_loop["epoch_progress"][scope]
        progress["processed"] -= 1
        progress["completed"] = progress["processed"]
        fit_loop["epoch_loop.batch_progress"][scope]["completed"] -= 1
    loop_state = fit_loop.get("epoch_loop.state_dict", {})
    if "_batches_that_stepped" in loop_state:
        loop_state["_batches_that_stepped"] -= 1


def continue_after_fit_end(loops: dict[str, Any]) -> bool:
    """Rewrite, in place, the counters of a checkpoint written after the fit loop ended; True if changed."""
    fit_loop = loops.get("fit_loop")
    if not isinstance(fit_loop, dict) or not saved_after_fit_end(fit_loop):
        return False
    _to_batch_end(fit_loop)
    epoch = fit_loop["epoch_progress"]["current"]["processed"]
    batches = fit_loop["epoch_loop.batch_progress"]["current"]["processed"]
    rank_zero_info(
        f"Resuming after batch {batches} of epoch {epoch}, where the checkpointed run stopped; "
        "training continues with the batch that follows it"
    )
    return True


def start_next_epoch(loops: dict[str, Any], batches: int) -> bool:
    """Rewrite, in place, the counters of a checkpoint whose epoch had trained its last batch so that Lightning
    starts the next epoch at its first batch, whatever this run's batch count an epoch; True if changed.

    The target is what `on_train_batch_end` of the epoch's last batch saves, a state Lightning resumes into the
    next epoch only when `is_last_batch` is set (not where `limit_train_batches` ended the epoch) and the saved
    batch count reaches this run's `num_training_batches` (not under another batch size). So both are set, the
    count to `batches`, this run's loader length (`limit_train_batches` only lowers it)."""
    fit_loop = loops.get("fit_loop")
    progress = fit_loop.get("epoch_loop.batch_progress") if isinstance(fit_loop, dict) else None
    if not progress or "epoch_progress" not in fit_loop:
        return False
    total = progress["total"]
    if total["completed"] == total["processed"] > 0:  # saved after the batch completed: fit end, epoch end
        _to_batch_end(fit_loop)
    elif total["completed"] != total["processed"] - 1:
        return False  # not saved at a step boundary: leave Lightning's counters alone
    batches = max(int(batches), 1)
    progress["current"].update(ready=batches, started=batches, processed=batches, completed=batches - 1)
    progress["is_last_batch"] = True
    epoch = fit_loop["epoch_progress"]["current"]["processed"]
    rank_zero_info(f"Resuming at the start of epoch {epoch + 1}: the checkpointed run had trained all of epoch {epoch}")
    return True
