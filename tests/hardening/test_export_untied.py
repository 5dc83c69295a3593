"""HF export of an UNTIED model (`tie_word_embeddings: false`, its own trained `lm_head`): the head is written
and `from_pretrained` gives the trained module's logits, from a `.ckpt` and from a DCP folder, full weights and
LoRA (adapter and `--merge_lora`). Every other export test uses the tied `tiny` preset."""

from __future__ import annotations

import json

import pytest
import torch
from _export_helpers import dcp_folder, ids, train
from peft import PeftModel
from safetensors import safe_open
from transformers import Gemma4ForCausalLM

from lightning_ffpa.export import export

UNTIED = {"tie_word_embeddings": False}
LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "o_proj", "down_proj"]}


@pytest.fixture(scope="module")
def untied_run(request, tmp_path_factory):
    """A 2-step untied run (all weights, or LoRA over a frozen untied base), its `.ckpt` and its DCP folder."""
    root = tmp_path_factory.mktemp(f"untied_{request.param}")
    lm, ckpt = train(root, lora=LORA if request.param == "lora" else None, config_overrides=UNTIED)
    assert lm.hf_model.lm_head.weight is not lm.hf_model.model.embed_tokens.weight
    return request.param, lm, {"ckpt": ckpt, "dcp": dcp_folder(ckpt, root / "dcp")}


def _tensor_names(out) -> set[str]:
    names = set()
    for shard in out.glob("*.safetensors"):
        with safe_open(shard, "pt") as f:
            names |= set(f.keys())
    return names


@torch.no_grad()
@pytest.mark.parametrize("source", ["ckpt", "dcp"])
@pytest.mark.parametrize("untied_run, merge", [("full", False), ("lora", False), ("lora", True)],
                         ids=["full", "lora_adapter", "lora_merged"], indirect=["untied_run"])
def test_untied_head_round_trips_through_from_pretrained(untied_run, tmp_path, source, merge):
    kind, lm, paths = untied_run
    out = tmp_path / "hf"
    result = export(paths[source], out, merge_lora=merge, max_shard_size="1MB")
    assert "lm_head.weight" in _tensor_names(out)
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    hf = Gemma4ForCausalLM.from_pretrained(out).eval()
    assert hf.lm_head.weight is not hf.model.embed_tokens.weight
    want = lm.model(input_ids=ids()).logits
    if kind == "full":  # the head trained apart from the embedding: both written as trained, bit for bit
        assert torch.equal(hf.lm_head.weight, lm.hf_model.lm_head.weight)
        assert torch.equal(hf(input_ids=ids()).logits, want)
    elif merge:
        torch.testing.assert_close(hf(input_ids=ids()).logits, want, rtol=0, atol=1e-4)
    else:
        peft = PeftModel.from_pretrained(hf, result.adapter_dir).eval()
        torch.testing.assert_close(peft(input_ids=ids()).logits, want, rtol=0, atol=1e-5)
