"""Fit Gemma4LM (a pretrained tiny checkpoint) for a few steps per (loss_impl, LoRA) case; in-process or by torchrun.

argv: out.json, pretrained_dir, context_parallel_size (0: no strategy), accelerator, dtype, cases
("plain:0,chunked:1,...": loss_impl and 0/1 for LoRA). Rank 0 writes {"plain:0": [loss per step], ...}.
"""

import json
import os
import sys

import lightning as L
import torch

from lightning_ffpa.attention import backend, kernels
from lightning_ffpa.callbacks.attention import FFPAAttention
from lightning_ffpa.data import MockDataModule
from lightning_ffpa.module import Gemma4LM
from lightning_ffpa.parallel import FSDP2Strategy

LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"]}
STEPS = 2


class _Losses(L.Callback):
    def __init__(self):
        self.losses = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))


def fit_losses(pretrained: str, loss_impl: str, lora: bool, cp: int, accelerator: str = "cpu",
               dtype: str = "float32") -> tuple[list[float], int, int, dict[str, int]]:
    """Per-step training losses of one case (global over the CP group), trainable and total parameter tensors,
    and the FFPA kernel calls per kernel (`reference` on CPU, `cutedsl` on the GPU)."""
    L.seed_everything(0)
    backend.reset_dispatch_counts()
    low = dtype != "float32"
    if cp == 0:
        strategy, devices = "auto", 1
        module_dtype = dtype
    else:
        mp = "bf16" if low else "fp32"
        strategy = FSDP2Strategy(context_parallel_size=cp, param_dtype=mp, reduce_dtype="fp32")
        devices, module_dtype = int(os.environ.get("WORLD_SIZE", "1")), "float32"  # fp32 masters, bf16 compute
    losses = _Losses()
    trainer = L.Trainer(accelerator=accelerator, devices=devices, strategy=strategy, max_steps=STEPS,
                        callbacks=[FFPAAttention(), losses], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)
    # loss_chunk_size 24 < 2 x 32 tokens: the chunked loss runs several chunks and a ragged last one.
    module = Gemma4LM(pretrained=pretrained, dtype=module_dtype, loss_impl=loss_impl, loss_chunk_size=24,
                      lora=LORA if lora else None, learning_rate=1e-2, warmup_steps=0)
    data = MockDataModule(vocab_size=512, seq_length=32, num_samples=8, batch_size=2, seed=5)
    # CPU: the FFPA dispatch runs its CPU reference op; GPU bf16: the real kernels, failing loudly if unusable.
    force = "reference" if accelerator == "cpu" else ("cutedsl" if low else None)
    with kernels.force_kernel(force):
        trainer.fit(module, data)
    params = list(module.model.parameters())
    return losses.losses, sum(p.requires_grad for p in params), len(params), kernels.kernel_counts()


def main(out: str, pretrained: str, cp: int, accelerator: str, dtype: str, cases: str) -> None:
    results = {}
    for case in cases.split(","):
        impl, lora = case.split(":")
        results[case] = fit_losses(pretrained, impl, lora == "1", cp, accelerator, dtype)
    if int(os.environ.get("RANK", "0")) == 0:
        json.dump(results, open(out, "w"))


if __name__ == "__main__":
    from lightning_ffpa.errors import exit_quickly
    from lightning_ffpa.parallel import close_process_group

    exit_quickly()  # a rank's exit skips the interpreter's exit-time walks of the heap (~1.3 s)
    torch.set_num_threads(1)
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5], sys.argv[6])
    close_process_group()  # as a script with its own Trainer should: no gloo teardown race at exit
