"""A callback for resume tests run as subprocesses: one line per trained batch (step, loss, batch hash).

Lines are flushed as they are written; the loss is an exact hex float so runs compare bitwise.
"""

from __future__ import annotations

import hashlib

import lightning.pytorch as pl


class StepLog(pl.Callback):
    """Append `global_step epoch loss_hex input_ids_sha1` after every training batch."""

    def __init__(self, path: str) -> None:
        """
        Args:
            path: File the lines are appended to.
        """
        self.path = path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        digest = hashlib.sha1(batch["input_ids"].cpu().numpy().tobytes()).hexdigest()[:16]
        with open(self.path, "a") as f:
            f.write(f"{trainer.global_step} {trainer.current_epoch} {float(loss).hex()} {digest}\n")


def read(path) -> list[tuple[int, int, str, str]]:
    """The (step, epoch, loss_hex, batch_digest) lines of a log."""
    with open(path) as f:
        return [(int(s), int(e), loss, d) for s, e, loss, d in (line.split() for line in f)]
