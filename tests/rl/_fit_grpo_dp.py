"""GRPO fit with LoRA on WORLD_SIZE ranks (torchrun, gloo CPU): the same 4 prompts per step whatever the rank
count (2 per rank on 2 ranks), and completions that are a fixed function of (prompt, index in its group), so
runs on 1 and 2 ranks see the same rollouts; only how the step is split over ranks differs.

argv: out.json, strategy ("ddp" or "fsdp2"), pretrained dir (the same base whatever builds it: FSDP2 materialises
on meta and would draw other random weights), and optionally "drop_odd": DAPO's dynamic sampling on, and the
prompts at odd places of the sampler's order (marked by first token DROP_MARK; on 2 ranks, all of rank 1's) get
completions that tie within their group, so those groups are dropped. Rank 0 writes {"losses": [...], "adapters": {name: values},
"per_rank": [{"dropped": [...], "loss_tokens": [...]} per rank]}.
"""

import hashlib
import json
import os
import sys
from types import SimpleNamespace

import lightning as L
import torch
from torch.utils.data import DataLoader

from lightning_ffpa.callbacks.rollout import RolloutCallback
from lightning_ffpa.data.prompts import collate_prompts
from lightning_ffpa.rl.module import GRPOModule
from lightning_ffpa.rl.rewards import token_range_reward
from lightning_ffpa.rollout.engine import EngineConfig
from lightning_ffpa.rollout.sampler import SamplingParams
from tests.parallel._fit_replicated import seeded_weights

G, MAX_NEW, STEPS, PROMPTS_PER_STEP = 4, 6, 2, 4
DROP_MARK = 2  # first token of the prompts whose groups tie under drop_odd
LORA = {"r": 2, "lora_alpha": 4, "target_modules": ["q_proj", "v_proj", "o_proj"]}


def fixed_generate(prompts, sampling=None):
    """Completion j of a prompt: tokens from a hash of (prompt, j mod G); lengths 1..MAX_NEW, EOS-free."""
    out = []
    for i, p in enumerate(prompts):
        tie = p[0] == DROP_MARK  # every completion of the group the same: equal rewards
        digest = hashlib.sha256(f"{p}/{0 if tie else i % G}".encode()).digest()
        n = 1 + digest[0] % MAX_NEW
        ids = [b % 128 for b in digest[1:1 + n]]
        out.append(SimpleNamespace(output=ids, logprobs=[-1.0] * n, finish_reason="length" if n == MAX_NEW else "stop"))
    return out


class FixedRollout(RolloutCallback):
    def on_fit_start(self, trainer, pl_module):
        super().on_fit_start(trainer, pl_module)
        self.engine.generate = fixed_generate


class Record(L.Callback):
    def __init__(self):
        self.losses, self.dropped, self.loss_tokens = [], [], []

    def on_train_start(self, trainer, pl_module):
        # the same adapters whatever materialised them (FSDP2 builds on meta and draws in another order)
        seeded_weights(pl_module.model, seed=1, scale=0.05, trainable_only=True)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(trainer.callback_metrics["train/loss"]))
        self.dropped.append(float(trainer.callback_metrics["rollout/dropped_groups"]))  # this rank's
        self.loss_tokens.append(int(batch["completion_mask"].sum()))


def main(out: str, strategy: str, pretrained: str, mode: str = "") -> None:
    world = int(os.environ["WORLD_SIZE"])
    L.seed_everything(0)
    torch.manual_seed(0)
    prompts = [{"prompt_ids": torch.randint(3, 512, (4,)).tolist()} for _ in range(PROMPTS_PER_STEP * STEPS)]
    if mode == "drop_odd":
        # Lightning's DistributedSampler shuffles (seed 0, epoch 0) and deals order[r::world] to rank r
        order = torch.randperm(len(prompts), generator=torch.Generator().manual_seed(0)).tolist()
        for k in order[1::2]:
            prompts[k]["prompt_ids"][0] = DROP_MARK
    # Lightning's DistributedSampler (shuffled, seed 0) deals order[r::world] to rank r, so each step's global batch
    # is the one-rank batch.
    loader = DataLoader(prompts, batch_size=PROMPTS_PER_STEP // world, collate_fn=collate_prompts)
    if strategy == "fsdp2":
        from lightning_ffpa.parallel import FSDP2Strategy

        strategy = FSDP2Strategy(param_dtype="fp32", reduce_dtype="fp32", replicate_frozen=True)
    rollout = FixedRollout([token_range_reward], num_generations=G, sampling=SamplingParams(max_new_tokens=MAX_NEW),
                           engine=EngineConfig(page_size=8, num_pages=32, max_batch_size=16, max_seq_len=16,
                                               attention="dense"), eos_token_ids=[])
    record = Record()
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=STEPS, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[rollout, record])
    module = GRPOModule(pretrained=pretrained, lora=LORA, learning_rate=1e-2,
                        loss_type="dapo", scale_rewards="batch", beta=0.04, max_tokens_per_microbatch=40,
                        sampler_is_cap=None, dynamic_sampling=mode == "drop_odd")
    trainer.fit(module, train_dataloaders=loader)
    adapters = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().flatten().tolist()
                for n, p in module.model.named_parameters() if p.requires_grad}
    per_rank = [None] * world
    mine = {"dropped": record.dropped, "loss_tokens": record.loss_tokens}
    if world > 1:
        torch.distributed.all_gather_object(per_rank, mine)
    else:
        per_rank = [mine]
    if trainer.global_rank == 0:
        json.dump({"losses": record.losses, "adapters": adapters, "steps": trainer.global_step, "per_rank": per_rank},
                  open(out, "w"))


if __name__ == "__main__":
    from lightning_ffpa.errors import exit_quickly
    from lightning_ffpa.parallel import close_process_group

    exit_quickly()  # a rank's exit skips the interpreter's exit-time walks of the heap (~1.3 s)
    torch.set_num_threads(1)
    main(*sys.argv[1:5])
    close_process_group()  # as a script with its own Trainer should: no gloo teardown race at exit
