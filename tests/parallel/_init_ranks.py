"""Build the preset tiny Gemma4LM with LoRA under FSDP2Strategy (launched by torchrun), and in one process.

Both start from seed 0 and random weights: the strategy materialises the meta-device build on its ranks, the
one-process build materialises the same meta-device model unsharded. Rank 0 writes to argv[1] which parameters
differ, which were sharded, which `lora_A` weights were compared, and the embedding adapter's (max |x|, std).
"""

import json
import os
import sys

import lightning as L
import torch
from torch.utils.data import DataLoader

from lightning_ffpa.module import Gemma4LM
from lightning_ffpa.parallel import FSDP2Strategy
from lightning_ffpa.parallel.strategy import materialize

OPTIONS = dict(preset="tiny", dtype="float32", lora={"r": 4, "target_modules": ["q_proj", "v_proj", "embed_tokens"]})


def sharded_build() -> tuple[dict[str, torch.Tensor], list[str]]:
    """Whole parameters of the strategy's build (`fit` with no steps runs its set-up only), and the sharded names."""
    trainer = L.Trainer(accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), max_steps=0, logger=False,
                        strategy=FSDP2Strategy(activation_checkpointing="none", param_dtype="fp32"),
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    module = Gemma4LM(**OPTIONS)
    L.seed_everything(0, verbose=False)  # also the seed Lightning's set-up re-applies (PL_GLOBAL_SEED)
    trainer.fit(module, DataLoader([torch.zeros(8, dtype=torch.long)]))
    params = dict(module.model.named_parameters())
    sharded = [n for n, p in params.items() if hasattr(p, "device_mesh") and p.to_local().shape != p.shape]
    whole = {n: p.full_tensor() if hasattr(p, "device_mesh") else p for n, p in params.items()}  # every rank
    return {n: t.detach().clone() for n, t in whole.items()}, sharded


def one_process_build() -> dict[str, torch.Tensor]:
    """The same model built and initialised by the same functions, unsharded."""
    module = Gemma4LM(**OPTIONS)
    L.seed_everything(0, verbose=False)  # also the seed Lightning's set-up re-applies (PL_GLOBAL_SEED)
    module.model = module.build_model(device="meta")
    materialize(module.model, torch.device("cpu"))
    module._needs_weight_init = True  # as `configure_model` leaves it under FSDP2Strategy
    module.load_sharded_weights()
    return {n: p.detach() for n, p in module.model.named_parameters()}


def main(out: str) -> None:
    got, sharded = sharded_build()
    if int(os.environ["RANK"]) != 0:
        return
    want = one_process_build()
    embedding = {n: [float(t.abs().max()), float(t.std())] for n, t in want.items() if ".lora_embedding_" in n}
    json.dump({"names": sorted(want), "sharded": sharded, "lora_A": [n for n in want if ".lora_A." in n],
               "lora_embedding": embedding, "differ": [n for n in want if not torch.equal(got[n], want[n])]},
              open(out, "w"))


if __name__ == "__main__":
    from lightning_ffpa.errors import exit_quickly
    from lightning_ffpa.parallel import close_process_group

    exit_quickly()  # a rank's exit skips the interpreter's exit-time walks of the heap (~1.3 s)
    main(sys.argv[1])
    close_process_group()  # as a script with its own Trainer should: no gloo teardown race at exit
