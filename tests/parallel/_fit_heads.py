"""Train a policy beside a frozen reference and a value head under FSDP2Strategy on 2 gloo ranks.

The strategy must shard the trained HF model (not the frozen one found first) and the head beside it, so both
stay equal on every rank. Writes what each rank holds after the fit to argv[1] on rank 0.
"""

import json
import os
import sys

import lightning as L
import torch
import transformers
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

from lightning_ffpa.parallel import FSDP2Strategy
from lightning_ffpa.presets import build_text_config


def _tiny() -> transformers.Gemma4ForCausalLM:
    cfg = build_text_config("tiny")
    cfg._attn_implementation = "sdpa"
    return transformers.Gemma4ForCausalLM(cfg)


class PolicyWithHead(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.ref = _tiny().requires_grad_(False)  # built first: the strategy must not pick it
        self.policy = _tiny()
        self.value_head = torch.nn.Linear(self.policy.config.hidden_size, 1)

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        out = self.policy(input_ids=ids, output_hidden_states=True)
        with torch.no_grad():
            ref = self.ref(input_ids=ids).logits
        value = self.value_head(out.hidden_states[-1]).mean()
        return (out.logits - ref).pow(2).mean() + value.pow(2)

    def configure_optimizers(self):
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.1)


def _full_sum(p: torch.Tensor) -> float:
    return float((p.full_tensor() if isinstance(p, DTensor) else p).detach().double().sum())


def main(out: str) -> None:
    # each rank reads different rows: a parameter left out of FSDP2 would take different steps on each
    data = TensorDataset(torch.randint(0, 512, (4, 16), generator=torch.Generator().manual_seed(3)))
    strategy = FSDP2Strategy(activation_checkpointing="selective", param_dtype="fp32", reduce_dtype="fp32")
    trainer = L.Trainer(accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), strategy=strategy, max_steps=2,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, use_distributed_sampler=True)
    module = PolicyWithHead()
    trainer.fit(module, DataLoader(data, batch_size=2, shuffle=False))
    mine = {"policy_q": _full_sum(module.policy.model.layers[0].self_attn.q_proj.weight),
            "value_head": _full_sum(module.value_head.weight),
            "policy_sharded": isinstance(module.policy.model.layers[0].self_attn.q_proj.weight, DTensor),
            "ref_sharded": isinstance(module.ref.model.layers[0].self_attn.q_proj.weight, DTensor)}
    ranks = [None] * trainer.world_size
    torch.distributed.all_gather_object(ranks, mine)
    if trainer.global_rank == 0:
        json.dump(ranks, open(out, "w"))


if __name__ == "__main__":
    from lightning_ffpa.parallel import close_process_group

    main(sys.argv[1])
    close_process_group()
