"""Fit the tiny Gemma4 for a few steps under FSDP2Strategy (launched by torchrun from the tests).

Writes the global mean loss per step (and the strategy's view of the mesh) to argv[1] on rank 0.
"""

import json
import sys

import lightning as L
import torch
import transformers
from torch.utils.data import DataLoader, TensorDataset

from lightning_ffpa.loss import linear_cross_entropy
from lightning_ffpa.parallel import FSDP2Strategy, causal_lm_hidden_states
from lightning_ffpa.presets import build_text_config


class TinyLM(L.LightningModule):
    """A plain module: no configure_model, so the strategy applies `parallelize` itself."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        cfg = build_text_config("tiny")
        cfg._attn_implementation = "sdpa"
        self.model = transformers.Gemma4ForCausalLM(cfg)
        self.losses = []

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        hidden = causal_lm_hidden_states(self.model, input_ids=ids)  # (B, S, H)
        labels = ids[:, 1:].reshape(-1)
        loss = linear_cross_entropy(hidden[:, :-1].reshape(-1, hidden.shape[-1]), self.model.lm_head.weight,
                                    labels, softcap=self.model.config.final_logit_softcapping)
        self.losses.append(self.all_gather(loss.detach()).mean().item())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def main(out: str, ac: str) -> None:
    # One global batch of 4, seen every step: the loss must fall, and dp=2 splits it 2 + 2.
    data = TensorDataset(torch.randint(0, 512, (4, 32), generator=torch.Generator().manual_seed(3)))
    strategy = FSDP2Strategy(activation_checkpointing=ac, param_dtype="fp32", reduce_dtype="fp32")
    trainer = L.Trainer(accelerator="cpu", devices=int(__import__("os").environ["WORLD_SIZE"]), strategy=strategy,
                        max_steps=3, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, use_distributed_sampler=True)
    module = TinyLM()
    per_rank_batch = 4 // trainer.world_size
    trainer.fit(module, DataLoader(data, batch_size=per_rank_batch, shuffle=False))
    if trainer.global_rank == 0:
        mesh = strategy.device_mesh
        json.dump({"losses": module.losses, "mesh_dims": list(mesh.mesh_dim_names), "mesh_shape": list(mesh.shape),
                   "sampler": strategy.distributed_sampler_kwargs, "cp": strategy.context_parallel_size},
                  open(out, "w"))


if __name__ == "__main__":
    from lightning_ffpa.errors import exit_quickly
    from lightning_ffpa.parallel import close_process_group

    exit_quickly()  # a rank's exit skips the interpreter's exit-time walks of the heap (~1.3 s)
    main(sys.argv[1], sys.argv[2])
    close_process_group()  # as a script with its own Trainer should: no gloo teardown race at exit
