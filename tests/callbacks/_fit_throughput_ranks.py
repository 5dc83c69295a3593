"""Two gloo ranks (DDP, CPU) fit 3 steps under TokenThroughput, rank 0 with 2-row batches of 3 targets a row and
100 FLOPs a batch, rank 1 with 3-row batches of 7 targets a row and 300 FLOPs; launched by torchrun.
argv: out.json. Rank 0 writes every logged row, as [step, metrics]."""

import json
import os
import sys

import lightning as L
import torch
from lightning.pytorch.loggers import Logger
from torch.utils.data import DataLoader

from lightning_ffpa.callbacks import TokenThroughput


class _Recorder(Logger):
    name, version = "recorder", 0

    def __init__(self):
        super().__init__()
        self.rows = []

    def log_metrics(self, metrics, step=None):
        self.rows.append([step, {k: float(v) for k, v in metrics.items()}])

    def log_hyperparams(self, *args, **kwargs):
        pass


class _Tiny(L.LightningModule):
    def __init__(self, flops: float):
        super().__init__()
        self.flops_per_batch = flops  # this rank's, as Lightning reads it
        self.head = torch.nn.Linear(1, 1)

    def training_step(self, batch, batch_idx):
        return self.head(batch["input_ids"].float()[..., None]).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _rows(n_rows: int, targets: int) -> list[dict]:
    labels = torch.full((8,), -100)
    labels[: targets + 1] = 1  # the first label is no target: `targets` shifted ones
    return [{"input_ids": torch.ones(8, dtype=torch.long), "labels": labels} for _ in range(n_rows)]


def main(out: str) -> None:
    rank = int(os.environ["RANK"])
    batch, targets, flops = (2, 3, 100.0) if rank == 0 else (3, 7, 300.0)
    recorder = _Recorder()
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=3, logger=recorder,
                        log_every_n_steps=1, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, use_distributed_sampler=False,
                        callbacks=[TokenThroughput(window_size=2)])
    trainer.fit(_Tiny(flops), DataLoader(_rows(3 * batch, targets), batch_size=batch))
    if rank == 0:
        json.dump(recorder.rows, open(out, "w"))


if __name__ == "__main__":
    from lightning_ffpa.parallel import close_process_group

    main(sys.argv[1])
    close_process_group()
