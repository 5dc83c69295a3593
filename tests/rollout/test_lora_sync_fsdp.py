"""LoRA refresh reads FSDP2-sharded (DTensor) weights through `full_tensor`: one-rank gloo group on CPU."""

import copy
import os

import pytest
import torch
import torch.distributed as dist
from peft import LoraConfig, get_peft_model
from transformers import Gemma4ForCausalLM

from lightning_ffpa.presets import build_text_config
from lightning_ffpa.rollout.lora_sync import LoraSync


@pytest.mark.timeout(120)
def test_refresh_from_fully_sharded_training_model(tmp_path):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"file://{tmp_path}/store")
    try:
        torch.manual_seed(0)
        base = Gemma4ForCausalLM(build_text_config("tiny"))
        inference = copy.deepcopy(base)
        train = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "o_proj"]))
        for name, p in train.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.1)
        expected = copy.deepcopy(train).merge_and_unload()
        for layer in train.base_model.model.model.layers:
            fully_shard(layer)
        fully_shard(train)
        assert any(isinstance(p, DTensor) for p in train.parameters())
        sync = LoraSync(train, inference)
        sync.refresh(full=True)
        for (n, p), (_, q) in zip(expected.named_parameters(), inference.named_parameters()):
            assert not isinstance(q, DTensor)
            torch.testing.assert_close(q, p, atol=1e-6, rtol=1e-6, msg=n)
        assert sync.verify_no_drift(num_refreshes=2)["base_sha256"]
    finally:
        dist.destroy_process_group()
