"""Fit a tiny MoE Gemma4 checkpoint twice under FSDP2Strategy on the same ranks, expert_parallel_size=1 then 2;
launched by torchrun (2 or 4 gloo ranks on CPU, or one rank per GPU).

argv: out.json, pretrained_dir, the experts implementation (grouped_mm or eager), accelerator (cpu or gpu),
gradient_clip_val, [checkpoint_dir: the EP=2 run saves a DCP checkpoint there after its 2 steps, and runs
"resumed_1" and "resumed_2" train 2 more steps from it with expert_parallel_size 1 and 2]. Rank 0
writes, per run: its per-step losses and first batch, each step's gradients as the optimizer used them (after
clipping) of the expert stacks (gathered whole) and of the routers, and the norm of all of them, the placement of
the expert stacks, and what the all-to-all moved (and which local-experts path ran) on each rank.
"""

import json
import os
import sys

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_ffpa.data import MockDataModule
from lightning_ffpa.experts import EXPERT_STACKS
from lightning_ffpa.module import Gemma4LM
from lightning_ffpa.parallel import FSDP2Strategy


class _Record(L.Callback):
    def __init__(self, experts: str):
        self.experts = experts
        self.losses, self.grads, self.grad_norms, self.first_batch = [], [], [], None

    def on_fit_start(self, trainer, pl_module):
        pl_module.hf_model.config.get_text_config()._experts_implementation = self.experts  # HF's and EP's path

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.first_batch is None:
            self.first_batch = {k: batch[k].tolist() for k in ("input_ids", "labels")}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))
        step, square_sum = {}, 0.0  # the gradients the optimizer stepped with: after clipping
        for name, p in pl_module.named_parameters():
            if p.grad is None:
                continue
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad  # every rank joins
            square_sum += float(g.square().sum())
            if name.rsplit(".", 1)[-1] in EXPERT_STACKS or "router" in name:
                step[name] = g.tolist()
        self.grads.append(step)
        self.grad_norms.append(square_sum**0.5)


def fit(ep: int, pretrained: str, experts: str, accelerator: str, clip: float, max_steps: int = 2,
        save_to: str | None = None, resume: str | None = None) -> dict:
    L.seed_everything(0)
    record = _Record(experts)
    strategy = FSDP2Strategy(expert_parallel_size=ep, param_dtype="fp32", reduce_dtype="fp32")
    saves = [ModelCheckpoint(dirpath=save_to, every_n_train_steps=max_steps, save_top_k=-1)] if save_to else []
    trainer = L.Trainer(accelerator=accelerator, devices=int(os.environ["WORLD_SIZE"]),
                        strategy=strategy, max_steps=max_steps, callbacks=[record, *saves], gradient_clip_val=clip,
                        logger=False, enable_checkpointing=bool(saves), enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0)
    module = Gemma4LM(pretrained=pretrained, dtype="float32", learning_rate=1e-2, warmup_steps=0)
    data = MockDataModule(vocab_size=512, seq_length=32, num_samples=8, batch_size=2, seed=5)
    trainer.fit(module, data, ckpt_path=resume)
    experts = [m for m in module.modules() if hasattr(m, "expert_parallel")]
    stats = [dict(m.expert_parallel.stats) for m in experts]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, stats)
    stack = next((p for n, p in module.named_parameters() if n.endswith("experts.gate_up_proj")), None)
    return {"losses": record.losses, "first_batch": record.first_batch, "grads": record.grads,
            "grad_norms": record.grad_norms, "mesh_dims": list(strategy.parallel_dims.mesh_dim_names),
            "ep_modules": len(experts), "stats": gathered,
            "stack_local_rows": (stack.to_local() if hasattr(stack, "to_local") else stack).shape[0],
            "stack_rows": stack.shape[0]}


def main(out: str, pretrained: str, experts: str, accelerator: str, clip: float, ckpt_dir: str | None = None) -> None:
    if accelerator == "cpu":
        torch.use_deterministic_algorithms(True)
    runs = {"1": fit(1, pretrained, experts, accelerator, clip),
            "2": fit(2, pretrained, experts, accelerator, clip, save_to=ckpt_dir)}
    if ckpt_dir is not None:
        saved = os.path.join(ckpt_dir, sorted(os.listdir(ckpt_dir))[-1])  # one checkpoint, after step 2
        for ep in (1, 2):
            runs[f"resumed_{ep}"] = fit(ep, pretrained, experts, accelerator, clip, max_steps=4, resume=saved)
    if dist.get_rank() == 0:
        json.dump(runs, open(out, "w"))


if __name__ == "__main__":
    from lightning_ffpa.errors import exit_quickly
    from lightning_ffpa.parallel import close_process_group

    exit_quickly()  # a rank's exit skips the interpreter's exit-time walks of the heap (~1.3 s)
    main(*sys.argv[1:5], float(sys.argv[5]), *sys.argv[6:])
    close_process_group()
