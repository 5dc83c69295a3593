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


@pytest.mark.timeout(180)
def test_shared_weights_read_a_replicated_base_and_plan_the_merged_copy_over_a_sharded_one(tmp_path):
    """FSDP2 with `replicate_frozen` (frozen base in `ignored_params`: plain tensors on every rank): the engine reads
    it in place, adapters gathered from their shards. Without it the base is sharded DTensors: the plan is the
    merged copy and says why. Both generate the unsharded merged model's tokens."""
    from torch.distributed.fsdp import fully_shard

    from lightning_ffpa.rollout.engine import EngineConfig, RolloutEngine
    from lightning_ffpa.rollout.shared_weights import SHARDED, SharedWeights, WeightsPlan

    cfg = EngineConfig(page_size=4, num_pages=32, max_batch_size=2, max_seq_len=32, attention="dense")
    prompts = [[5, 9, 200, 31], [7, 8]]
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"file://{tmp_path}/store")
    try:
        outputs = {}
        for replicate in (True, False):
            torch.manual_seed(0)
            train = get_peft_model(Gemma4ForCausalLM(build_text_config("tiny")),
                                   LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj"]))
            with torch.no_grad():
                for name, p in train.named_parameters():
                    if "lora_B" in name:
                        p.normal_(0.0, 0.1)
            expected = copy.deepcopy(train).merge_and_unload()
            kw = {"ignored_params": {p for p in train.parameters() if not p.requires_grad}} if replicate else {}
            for layer in train.base_model.model.model.layers:
                fully_shard(layer, **kw)
            fully_shard(train, **kw)
            plan = WeightsPlan(train, "shared", torch.float32, torch.device("cpu"))
            sync = plan.build()
            if replicate:
                assert isinstance(sync, SharedWeights) and plan.aliased_bytes > 0
                assert plan.own_bytes == sum(g.adapter_bytes for g in sync.groups)
            else:
                assert plan.mode == "merged" and plan.why == SHARDED and SHARDED in sync.weights_path
            got = RolloutEngine(sync.inference, cfg).generate(prompts, 6)
            want = RolloutEngine(expected.eval(), cfg).generate(prompts, 6)
            assert [s.output for s in got] == [s.output for s in want]
            outputs[replicate] = [s.output for s in got]
            assert sync.verify_no_drift(num_refreshes=2)["base_sha256"]
        assert outputs[True] == outputs[False]
    finally:
        dist.destroy_process_group()
