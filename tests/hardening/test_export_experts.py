"""LoRA on the MoE expert stacks (`model.lora.target_parameters`, peft's parameter LoRA) on the tiny-moe preset:
training moves the expert adapters, and both exports give the trained model's logits: the PEFT adapter over the
exported base, and `--merge_lora`, whose merged expert stacks load with HF's `from_pretrained`."""

from __future__ import annotations

import pytest
import torch
from _export_helpers import ids as _ids
from _export_helpers import train as _train
from peft import PeftModel
from transformers import Gemma4ForCausalLM

from lightning_ffpa.export import export

EXPERTS = ["experts.gate_up_proj", "experts.down_proj"]
LORA = {"r": 2, "lora_alpha": 4, "target_modules": ["q_proj", "o_proj"], "target_parameters": EXPERTS}
LAYERS = 4  # tiny-moe: every layer has an expert block


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return _train(tmp_path_factory.mktemp("experts"), lora=LORA, preset="tiny-moe")


@torch.no_grad()
def test_expert_lora_trains_and_both_exports_give_the_trained_logits(trained, tmp_path):
    lm, ckpt = trained
    ids = _ids()
    want = lm.model(input_ids=ids).logits
    expert_b = [p for n, p in lm.model.named_parameters() if ".experts." in n and "lora_B" in n]
    assert len(expert_b) == 2 * LAYERS and all(p.abs().sum() > 0 for p in expert_b)  # trained, not a no-op

    merged = export(ckpt, tmp_path / "merged", merge_lora=True)
    assert sorted(n for n in merged.merged if ".experts." in n) == sorted(
        f"model.layers.{i}.experts.{p.split('.')[-1]}" for i in range(LAYERS) for p in EXPERTS)
    assert len(merged.merged) == 4 * LAYERS  # q_proj, o_proj and the two stacks
    hf = Gemma4ForCausalLM.from_pretrained(tmp_path / "merged").eval()
    torch.testing.assert_close(hf(input_ids=ids).logits, want, rtol=0, atol=1e-4)

    adapter = export(ckpt, tmp_path / "adapter_run")
    base = Gemma4ForCausalLM.from_pretrained(tmp_path / "adapter_run")
    peft = PeftModel.from_pretrained(base, adapter.adapter_dir).eval()
    # peft folds W + sBA into each stack where training ran the adapters unmerged: fp32 sums in another order
    # (1.4e-5 apart seen under another thread count; a wrong adapter is off by far more)
    torch.testing.assert_close(peft(input_ids=ids).logits, want, rtol=0, atol=1e-4)
