"""Fit a tiny MoE Gemma4 checkpoint twice under FSDP2Strategy on the same ranks, expert_parallel_size=1 then 2;
launched by torchrun (2 gloo ranks).

argv: out.json, pretrained_dir. Rank 0 writes, per run: its per-step losses and first batch, each step's gradients
of the expert stacks (gathered whole) and of the routers, the placement of the expert stacks, and what the
all-to-all moved on each rank.
"""

import json
import sys

import lightning as L
import torch
import torch.distributed as dist

from lightning_ffpa.data import MockDataModule
from lightning_ffpa.module import Gemma4LM
from lightning_ffpa.parallel import FSDP2Strategy
from lightning_ffpa.parallel.expert_parallel import EXPERT_STACKS


class _Record(L.Callback):
    def __init__(self):
        self.losses, self.grads, self.first_batch = [], [], None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.first_batch is None:
            self.first_batch = {k: batch[k].tolist() for k in ("input_ids", "labels")}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        step = {}
        for name, p in pl_module.named_parameters():
            if name.rsplit(".", 1)[-1] in EXPERT_STACKS or "router" in name:
                g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad  # every rank joins
                step[name] = g.tolist()
        self.grads.append(step)


def fit(ep: int, pretrained: str) -> dict:
    L.seed_everything(0)
    record = _Record()
    strategy = FSDP2Strategy(expert_parallel_size=ep, param_dtype="fp32", reduce_dtype="fp32")
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=2, callbacks=[record],
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0)
    module = Gemma4LM(pretrained=pretrained, dtype="float32", learning_rate=1e-2, warmup_steps=0)
    data = MockDataModule(vocab_size=512, seq_length=32, num_samples=8, batch_size=2, seed=5)
    trainer.fit(module, data)
    experts = [m for m in module.modules() if hasattr(m, "expert_parallel")]
    stats = [dict(m.expert_parallel.stats) for m in experts]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, stats)
    stack = next((p for n, p in module.named_parameters() if n.endswith("experts.gate_up_proj")), None)
    return {"losses": record.losses, "first_batch": record.first_batch, "grads": record.grads, "mesh_dims": list(strategy.parallel_dims.mesh_dim_names),
            "ep_modules": len(experts), "stats": gathered,
            "stack_local_rows": (stack.to_local() if hasattr(stack, "to_local") else stack).shape[0],
            "stack_rows": stack.shape[0]}


def main(out: str, pretrained: str) -> None:
    torch.use_deterministic_algorithms(True)
    runs = {str(ep): fit(ep, pretrained) for ep in (1, 2)}
    if dist.get_rank() == 0:
        json.dump(runs, open(out, "w"))


if __name__ == "__main__":
    from lightning_ffpa.parallel import close_process_group

    main(sys.argv[1], sys.argv[2])
    close_process_group()
