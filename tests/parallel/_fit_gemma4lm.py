"""Fit Gemma4LM (pretrained tiny checkpoint) under FSDP2Strategy + FFPAAttention; launched by torchrun.

argv: out.json, context_parallel_size, pretrained_dir. Rank 0 writes the per-step global losses.
"""

import json
import os
import sys

import lightning as L

from lightning_ffpa.callbacks.attention import FFPAAttention
from lightning_ffpa.data import MockDataModule
from lightning_ffpa.module import Gemma4LM
from lightning_ffpa.parallel import FSDP2Strategy


class _Losses(L.Callback):
    def __init__(self):
        self.losses = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))


def main(out: str, cp: int, pretrained: str) -> None:
    L.seed_everything(0)
    losses = _Losses()
    strategy = FSDP2Strategy(context_parallel_size=cp, param_dtype="fp32", reduce_dtype="fp32")
    trainer = L.Trainer(accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), strategy=strategy, max_steps=3,
                        callbacks=[FFPAAttention(), losses], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)
    module = Gemma4LM(pretrained=pretrained, dtype="float32", learning_rate=1e-4, warmup_steps=0)
    data = MockDataModule(vocab_size=512, seq_length=32, num_samples=8, batch_size=2, seed=5)
    trainer.fit(module, data)
    if trainer.global_rank == 0:
        json.dump({"losses": losses.losses, "cp": strategy.context_parallel_size}, open(out, "w"))


if __name__ == "__main__":
    from lightning_ffpa.errors import exit_quickly
    from lightning_ffpa.parallel import close_process_group

    exit_quickly()  # a rank's exit skips the interpreter's exit-time walks of the heap (~1.3 s)
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
    close_process_group()  # as a script with its own Trainer should: no gloo teardown race at exit
