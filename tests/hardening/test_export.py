"""HF export: a trained tiny checkpoint (.ckpt and DCP folder) -> safetensors -> `from_pretrained` gives the
same logits; LoRA as a PEFT adapter and merged in fp32; shards are read one group at a time."""

from __future__ import annotations

import json

import lightning.pytorch as pl
import pytest
import torch
from peft import PeftModel
from transformers import Gemma4ForCausalLM

from lightning_ffpa import export as export_mod
from lightning_ffpa.data import MockDataModule
from lightning_ffpa.export import export, run
from lightning_ffpa.module import Gemma4LM

LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "o_proj", "down_proj"]}


def _train(tmp_path, lora=None):
    torch.manual_seed(0)
    lm = Gemma4LM(preset="tiny", dtype="float32", lora=lora, learning_rate=1e-2, warmup_steps=0)
    trainer = pl.Trainer(max_steps=2, accelerator="cpu", logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False)
    trainer.fit(lm, MockDataModule(seq_length=16, num_samples=4, batch_size=2))
    path = tmp_path / "run.ckpt"
    trainer.save_checkpoint(path)
    return lm.eval(), path


def _ids():
    return torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return _train(tmp_path_factory.mktemp("plain"))


@pytest.fixture(scope="module")
def trained_lora(tmp_path_factory):
    return _train(tmp_path_factory.mktemp("lora"), lora=LORA)


def _dcp_folder(ckpt, dst):
    import torch.distributed.checkpoint as dcp

    from lightning_ffpa.checkpoint._compat import lightning_dcp_meta_filename

    state = torch.load(ckpt, map_location="cpu", weights_only=True)
    dcp.save({"state_dict": state.pop("state_dict")}, checkpoint_id=str(dst), no_dist=True)
    torch.save(state, dst / lightning_dcp_meta_filename())
    return dst


@torch.no_grad()
def test_ckpt_export_loads_with_from_pretrained_and_matches_logits(trained, tmp_path, record_property):
    lm, ckpt = trained
    result = run([str(ckpt), str(tmp_path / "hf")])
    hf = Gemma4ForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ids = _ids()
    record_property("hardening", "export")
    record_property("case", "plain .ckpt -> HF safetensors")
    assert result.shards == ["model.safetensors"]
    assert torch.equal(hf(input_ids=ids).logits, lm.model(input_ids=ids).logits)


@torch.no_grad()
def test_dcp_folder_export_is_streamed_and_equals_ckpt_export(trained, tmp_path, monkeypatch, record_property):
    lm, ckpt = trained
    loads = []
    real = export_mod._compat.load_dcp_keys
    monkeypatch.setattr(export_mod._compat, "load_dcp_keys", lambda p, keys: (loads.append(len(keys)), real(p, keys))[1])
    a = export(ckpt, tmp_path / "from_ckpt", max_shard_size="1MB")
    b = export(_dcp_folder(ckpt, tmp_path / "dcp"), tmp_path / "from_dcp", max_shard_size="1MB")
    record_property("hardening", "export")
    record_property("case", "DCP folder -> sharded HF safetensors, one shard group in memory at a time")
    assert len(a.shards) > 2 and a.shards == b.shards
    assert len(loads) == len(b.shards) and sum(loads) == b.num_tensors  # every key once, group by group
    index = json.loads((tmp_path / "from_dcp" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(b.shards)
    for shard in a.shards:
        from safetensors.torch import load_file

        x, y = load_file(tmp_path / "from_ckpt" / shard), load_file(tmp_path / "from_dcp" / shard)
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
    hf = Gemma4ForCausalLM.from_pretrained(tmp_path / "from_dcp").eval()
    ids = _ids()
    assert torch.equal(hf(input_ids=ids).logits, lm.model(input_ids=ids).logits)


@torch.no_grad()
def test_lora_adapter_in_peft_format_and_fp32_merge(trained_lora, tmp_path, record_property):
    lm, ckpt = trained_lora
    ids = _ids()
    want = lm.model(input_ids=ids).logits
    adapter = export(ckpt, tmp_path / "adapter_run")
    base = Gemma4ForCausalLM.from_pretrained(tmp_path / "adapter_run")
    peft = PeftModel.from_pretrained(base, adapter.adapter_dir).eval()
    assert any(p.abs().sum() > 0 for n, p in peft.named_parameters() if "lora_B" in n)  # trained, not a no-op
    torch.testing.assert_close(peft(input_ids=ids).logits, want, rtol=0, atol=1e-5)

    merged = export(ckpt, tmp_path / "merged", merge_lora=True)
    assert merged.adapter_dir is None and len(merged.merged) == 3 * 4  # 3 targets x 4 layers
    hf = Gemma4ForCausalLM.from_pretrained(tmp_path / "merged").eval()
    torch.testing.assert_close(hf(input_ids=ids).logits, want, rtol=0, atol=1e-4)
    ref = peft.merge_and_unload().state_dict()
    got = hf.state_dict()
    for name in merged.merged:
        torch.testing.assert_close(got[name], ref[name], rtol=0, atol=1e-6)
    record_property("hardening", "export")
    record_property("case", "LoRA -> PEFT adapter, and merged in fp32")


def test_dtype_cast_writes_bf16(trained, tmp_path):
    _, ckpt = trained
    export(ckpt, tmp_path / "bf16", dtype="bfloat16")
    hf = Gemma4ForCausalLM.from_pretrained(tmp_path / "bf16", dtype="auto")
    assert {p.dtype for p in hf.parameters()} == {torch.bfloat16}


@pytest.mark.parametrize("kwargs, match", [
    ({"merge_lora": True}, "--merge-lora"),
    ({"dtype": "float64"}, "--dtype"),
    ({"max_shard_size": "lots"}, "--max-shard-size"),
])
def test_export_bad_input_names_the_option(trained, tmp_path, kwargs, match):
    _, ckpt = trained
    with pytest.raises(ValueError, match=match):
        export(ckpt, tmp_path / "x", **kwargs)


def test_export_refuses_non_empty_out_dir(trained, tmp_path):
    _, ckpt = trained
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="out_dir"):
        export(ckpt, tmp_path / "out")
    assert (tmp_path / "out" / "keep.txt").read_text() == "mine"
