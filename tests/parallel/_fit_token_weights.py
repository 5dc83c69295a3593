"""One optimizer step of Gemma4LM under FSDP2Strategy, 2 accumulated micro-batches per rank, the ranks holding
different numbers of labelled tokens (CP=1), or two CP ranks sharing 4-row micro-batches (CP=2); launched by
torchrun. argv: out.json, pretrained_dir, context_parallel_size, loss_impl.

Rank 0 saves the full gradients the optimizer would step with (next to out.json, as .pt), and their norm as
`total_grad_norm` reduces it over the sharded gradients."""

import json
import os
import sys

import lightning as L
import torch
from _token_rows import token_rows  # the script's folder is first on sys.path
from torch.utils.data import DataLoader

from lightning_ffpa.callbacks.attention import FFPAAttention
from lightning_ffpa.metrics import total_grad_norm
from lightning_ffpa.module import Gemma4LM
from lightning_ffpa.parallel import FSDP2Strategy


class _Grads(L.Callback):
    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        full = {n: p.grad.full_tensor() for n, p in pl_module.named_parameters() if p.grad is not None}
        self.norm = float(total_grad_norm(pl_module.parameters()))  # a collective: every rank calls it
        if trainer.global_rank == 0:
            torch.save(full, self.path)


def main(out: str, pretrained: str, cp: int, loss_impl: str) -> None:
    rank = int(os.environ["RANK"])
    grads = _Grads()
    grads.path = out + ".pt"
    strategy = FSDP2Strategy(context_parallel_size=cp, param_dtype="fp32", reduce_dtype="fp32")
    ring = [FFPAAttention()] if cp > 1 else []  # CP needs the ring hook; DP keeps eager, as the reference does
    trainer = L.Trainer(accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), strategy=strategy, max_steps=1,
                        callbacks=[grads, *ring], logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, accumulate_grad_batches=2, use_distributed_sampler=False)
    module = Gemma4LM(pretrained=pretrained, dtype="float32", attn_implementation="eager", warmup_steps=0,
                      loss_impl=loss_impl, loss_chunk_size=16)
    if cp == 1:
        rows, batch_size = token_rows()[4 * rank: 4 * rank + 4], 2  # rank 0: the sparsely labelled rows
    else:
        rows, batch_size = token_rows(), 4  # every CP rank reads the same batch and keeps its shard
    trainer.fit(module, DataLoader(rows, batch_size=batch_size))
    if trainer.global_rank == 0:
        json.dump({"grads": grads.path, "grad_norm": grads.norm}, open(out, "w"))


if __name__ == "__main__":
    from lightning_ffpa.errors import exit_quickly
    from lightning_ffpa.parallel import close_process_group

    exit_quickly()
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4])
    close_process_group()
