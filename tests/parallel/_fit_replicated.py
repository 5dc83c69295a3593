"""Fit Gemma4LM with LoRA under FSDP2Strategy(replicate_frozen=...): in-process (one rank) or by torchrun.

argv: out.json, pretrained_dir, modes ("false,true"). Rank 0 writes {mode: {"losses": [...], "layout": {...}}}.
"""

import json
import os
import sys

import lightning as L
import torch

from lightning_ffpa.data import MockDataModule
from lightning_ffpa.module import Gemma4LM
from lightning_ffpa.parallel import FSDP2Strategy

LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "k_proj", "o_proj", "down_proj"]}


class Record(L.Callback):
    """Per-step losses, and at the start which parameters FSDP2 holds; fresh runs get the same adapters."""

    def __init__(self, set_adapters: bool):
        self.losses, self.layout, self.set_adapters = [], {}, set_adapters

    def on_train_start(self, trainer, pl_module):
        hf = pl_module.hf_model
        params = dict(pl_module.model.named_parameters())
        if self.set_adapters:
            seeded_weights(pl_module.model, seed=1, scale=0.05, trainable_only=True)
        self.layout = dict(
            sharded_frozen=sum(hasattr(p, "device_mesh") for p in params.values() if not p.requires_grad),
            sharded_trainable=sum(hasattr(p, "device_mesh") for p in params.values() if p.requires_grad),
            trainable=sum(p.requires_grad for p in params.values()),
            frozen_whole=all(tuple(p.shape) == tuple(p.to_local().shape) if hasattr(p, "to_local") else True
                             for p in params.values() if not p.requires_grad),
            tied=hf.lm_head.weight is hf.get_input_embeddings().weight)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))


def seeded_weights(model, seed: int, scale: float, trainable_only: bool = False) -> None:
    """Parameters (in name order) from one seeded CPU generator, sharded or not, so runs of two layouts start from
    the same values whatever device or RNG materialised them (on CUDA, sharded draws differ from one GPU's)."""
    from torch.distributed.tensor import distribute_tensor

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            if trainable_only and not p.requires_grad:
                continue
            full = (scale * torch.randn(p.shape, generator=gen)).to(device=p.device, dtype=p.dtype)
            p.copy_(distribute_tensor(full, p.device_mesh, p.placements) if hasattr(p, "device_mesh") else full)


def fit(pretrained, root, replicate, steps=3, ckpt_path=None, devices=1):
    record = Record(set_adapters=ckpt_path is None)  # a resumed run keeps the checkpoint's adapters
    strategy = FSDP2Strategy(param_dtype="fp32", reduce_dtype="fp32", replicate_frozen=replicate)
    callbacks = [record, L.pytorch.callbacks.ModelCheckpoint(dirpath=f"{root}/ckpt", save_last=True)]
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=steps, logger=False,
                        callbacks=callbacks, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, default_root_dir=root)
    module = Gemma4LM(pretrained=str(pretrained), dtype="float32", lora=LORA, learning_rate=1e-2, warmup_steps=0,
                      min_lr_ratio=1.0)  # a constant rate: runs of 3 and 4 steps share their first 3
    trainer.fit(module, MockDataModule(vocab_size=512, seq_length=32, num_samples=16, batch_size=2, seed=5),
                ckpt_path=ckpt_path)
    return record, strategy


def main(out: str, pretrained: str, modes: str) -> None:
    results = {}
    for mode in modes.split(","):
        record, _ = fit(pretrained, f"{os.path.dirname(out)}/{mode}", {"false": False, "true": True}[mode],
                        devices=int(os.environ["WORLD_SIZE"]))
        results[mode] = dict(losses=record.losses, layout=record.layout)
    if int(os.environ.get("RANK", "0")) == 0:
        json.dump(results, open(out, "w"))


if __name__ == "__main__":
    from lightning_ffpa.errors import exit_quickly
    from lightning_ffpa.parallel import close_process_group

    exit_quickly()  # a rank's exit skips the interpreter's exit-time walks of the heap (~1.3 s)
    torch.set_num_threads(1)
    main(*sys.argv[1:4])
    close_process_group()  # as a script with its own Trainer should: no gloo teardown race at exit
