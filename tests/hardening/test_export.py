"""HF export: a trained tiny checkpoint (.ckpt and DCP folder) -> safetensors -> `from_pretrained` gives the
same logits; LoRA as a PEFT adapter and merged in fp32; shards are read one group at a time; a corrupt
checkpoint or a `--config` of other shapes is refused; the command exits 0, or 2 with one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
import zipfile
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
from _export_helpers import dcp_folder as _dcp_folder
from _export_helpers import ids as _ids
from _export_helpers import train as _train
from peft import PeftModel
from transformers import Gemma4ForCausalLM

from lightning_ffpa import export as export_mod
from lightning_ffpa.errors import CheckpointError, ConfigError
from lightning_ffpa.export import export, run
from lightning_ffpa.module import Gemma4LM
from lightning_ffpa.presets import build_text_config

LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "o_proj", "down_proj"]}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return _train(tmp_path_factory.mktemp("plain"))


@pytest.fixture(scope="module")
def trained_lora(tmp_path_factory):
    return _train(tmp_path_factory.mktemp("lora"), lora=LORA)


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
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"] == ["Gemma4ForCausalLM"]


@torch.no_grad()
@pytest.mark.parametrize("lora", [
    {**LORA, "modules_to_save": ["lm_head"]},
    {**LORA, "modules_to_save": ["embed_tokens"]},
    {**LORA, "target_modules": [*LORA["target_modules"], "lm_head"]},
], ids=["save_head", "save_embedding", "lora_head"])
def test_merged_export_of_a_tied_model_whose_head_training_changed(tmp_path, lora):
    """The tiny model ties its head to the embedding; these runs trained one apart from the other, so the
    merged export writes both and unties them in config.json."""
    lm, ckpt = _train(tmp_path, lora=lora)
    export(ckpt, tmp_path / "merged", merge_lora=True)
    hf = Gemma4ForCausalLM.from_pretrained(tmp_path / "merged").eval()
    assert hf.lm_head.weight is not hf.model.embed_tokens.weight
    ids = _ids()
    torch.testing.assert_close(hf(input_ids=ids).logits, lm.model(input_ids=ids).logits, rtol=0, atol=1e-4)
    with pytest.raises(CheckpointError, match="--merge_lora") if "modules_to_save" in lora else nullcontext():
        export(ckpt, tmp_path / "adapter")


@pytest.mark.parametrize("name, match", [
    ("base_model.model.lm_head.modules_to_save.default.weight", "modules_to_save"),
    ("base_model.model.model.embed_tokens.lora_embedding_A.default", "LoRA on Linear layers only"),
])
def test_export_refuses_what_it_cannot_write_in_one_line(name, match):
    with pytest.raises(CheckpointError, match=match):
        export_mod._plan([export_mod.MODULE_PREFIX + name], tied=True, merge=False)


@torch.no_grad()
def test_dcp_folder_export_is_streamed_and_equals_ckpt_export(trained, tmp_path, monkeypatch, record_property):
    lm, ckpt = trained
    loads = []
    real = export_mod.torch_compat.load_dcp_keys
    monkeypatch.setattr(export_mod.torch_compat, "load_dcp_keys", lambda p, keys: (loads.append(len(keys)), real(p, keys))[1])
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


@pytest.fixture(scope="module")
def trained_dora(tmp_path_factory):
    return _train(tmp_path_factory.mktemp("dora"), lora={**LORA, "use_dora": True})


@torch.no_grad()
@pytest.mark.parametrize("kind", ["lora", "dora"])
def test_lora_adapter_in_peft_format_and_fp32_merge(kind, request, tmp_path, record_property):
    lm, ckpt = request.getfixturevalue(f"trained_{kind}")
    ids = _ids()
    want = lm.model(input_ids=ids).logits
    adapter = export(ckpt, tmp_path / "adapter_run")
    base = Gemma4ForCausalLM.from_pretrained(tmp_path / "adapter_run")
    peft = PeftModel.from_pretrained(base, adapter.adapter_dir).eval()
    assert any(p.abs().sum() > 0 for n, p in peft.named_parameters() if "lora_B" in n)  # trained, not a no-op
    assert peft.peft_config["default"].use_dora == (kind == "dora")
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
    record_property("case", f"{'DoRA' if kind == 'dora' else 'LoRA'} -> PEFT adapter, and merged in fp32")


@torch.no_grad()
def test_adapter_exported_to_a_relative_folder_loads_from_anywhere(trained_lora, tmp_path, monkeypatch):
    """The adapter's `base_model_name_or_path` was the output folder as typed: a relative path that peft then
    looked up on the Hub from any other working directory."""
    from peft import AutoPeftModelForCausalLM

    lm, ckpt = trained_lora
    monkeypatch.chdir(tmp_path)
    adapter = export(ckpt, "rel_out").adapter_dir.resolve()
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    peft = AutoPeftModelForCausalLM.from_pretrained(adapter).eval()
    ids = _ids()
    torch.testing.assert_close(peft(input_ids=ids).logits, lm.model(input_ids=ids).logits, rtol=0, atol=1e-5)


def test_the_tokenizer_is_copied_from_a_local_source(trained_lora, tmp_path):
    """The export held weights and config.json only: `AutoTokenizer.from_pretrained(OUT)` failed. The first
    local folder holding a tokenizer (here `--config`) gives its files; a run with none says so."""
    from transformers import AutoTokenizer, GenerationConfig

    from tests.data.conftest import PLAIN_TEMPLATE, save_tokenizer

    lm, ckpt = trained_lora
    assert export(ckpt, tmp_path / "bare").tokenizer_from is None
    source = tmp_path / "hf_folder"
    lm.config.save_pretrained(source)
    save_tokenizer(source, PLAIN_TEMPLATE)
    GenerationConfig(eos_token_id=3).save_pretrained(source)
    result = export(ckpt, tmp_path / "with_tok", config_dir=str(source))
    assert result.tokenizer_from == source
    tok = AutoTokenizer.from_pretrained(tmp_path / "with_tok")
    assert tok("the cat sat").input_ids == AutoTokenizer.from_pretrained(source)("the cat sat").input_ids
    assert GenerationConfig.from_pretrained(tmp_path / "with_tok").eos_token_id == 3


def _with_sources(ckpt: Path, out: Path, **sources) -> Path:
    state = torch.load(ckpt, map_location="cpu", weights_only=False)
    state["fit_sources"] = {**(state.get("fit_sources") or {}), **sources}
    torch.save(state, out)
    return out


def test_a_tokenizer_other_than_the_fits_is_not_written_and_the_generation_config_comes_from_the_model(
        trained_lora, tmp_path):
    """A fresh trial: a fit on the byte tokenizer beside `pretrained` (whose folder holds its own tokenizer) was
    exported with that folder's tokenizer, whose ids the model never saw; and `generation_config.json` came only
    with the tokenizer, so a fit whose tokenizer was its own folder lost the model's eos ids."""
    from transformers import AutoTokenizer, GenerationConfig

    from lightning_ffpa.data.tokenizer import load_tokenizer, tokenizer_digest
    from tests.data.conftest import PLAIN_TEMPLATE, save_tokenizer

    lm, ckpt = trained_lora
    model_dir, tok_dir = tmp_path / "model", tmp_path / "tok"
    lm.config.save_pretrained(model_dir)
    save_tokenizer(model_dir, PLAIN_TEMPLATE)
    GenerationConfig(eos_token_id=[3, 4]).save_pretrained(model_dir)
    byte_fit = _with_sources(ckpt, tmp_path / "byte.ckpt", **{"data.tokenizer": "byte",
                                                              "data.tokenizer_digest": "byte"})
    result = export(byte_fit, tmp_path / "out_byte", config_dir=str(model_dir))
    assert result.tokenizer_from is None and "byte tokenizer" in result.tokenizer_note
    assert not (tmp_path / "out_byte" / "tokenizer.json").exists()
    assert GenerationConfig.from_pretrained(tmp_path / "out_byte").eos_token_id == [3, 4]

    save_tokenizer(tok_dir, None)  # the fit's own tokenizer folder: one more token, no generation config
    grown = AutoTokenizer.from_pretrained(tok_dir)
    grown.add_tokens(["<extra>"])
    grown.save_pretrained(tok_dir)
    own = _with_sources(ckpt, tmp_path / "own.ckpt", **{"data.tokenizer": str(tok_dir),
                                                        "data.tokenizer_digest": tokenizer_digest(
                                                            load_tokenizer(str(tok_dir)))})
    result = export(own, tmp_path / "out_own", config_dir=str(model_dir))
    assert result.tokenizer_from == tok_dir and result.generation_config_from == model_dir
    assert len(AutoTokenizer.from_pretrained(tmp_path / "out_own")) == len(grown)  # tok_dir's, not model_dir's
    assert GenerationConfig.from_pretrained(tmp_path / "out_own").eos_token_id == [3, 4]
    import shutil

    shutil.rmtree(tok_dir)  # the fit's folder gone: model_dir's tokenizer (other ids) is not taken in its place
    other = export(own, tmp_path / "out_other", config_dir=str(model_dir))
    assert other.tokenizer_from is None and "is not the one the fit trained with" in other.tokenizer_note


def test_a_preset_fits_config_takes_the_special_ids_of_the_tokenizer_it_is_exported_with(trained_lora, tmp_path):
    """A fresh trial: a preset-built fit on its own tokenizer (eos 3) was exported with Gemma4's eos_token_id 1,
    which is `<unk>` there, so `generate` never stopped at the tokenizer's eos."""
    from transformers import AutoConfig

    from lightning_ffpa.data.tokenizer import load_tokenizer, tokenizer_digest
    from tests.data.conftest import PLAIN_TEMPLATE, save_tokenizer

    _, ckpt = trained_lora
    tok_dir = Path(save_tokenizer(tmp_path / "tok", PLAIN_TEMPLATE))
    fit = _with_sources(ckpt, tmp_path / "fit.ckpt", **{
        "data.tokenizer": str(tok_dir), "data.tokenizer_digest": tokenizer_digest(load_tokenizer(str(tok_dir)))})
    result = export(fit, tmp_path / "out")
    config = AutoConfig.from_pretrained(tmp_path / "out")
    assert (config.eos_token_id, config.bos_token_id, config.pad_token_id) == (3, 2, 0)  # <eos>, <bos>, <pad>
    assert result.special_ids == "eos_token_id 1 -> 3"
    model_dir = tmp_path / "model"  # a config folder of the user's own is kept as it is
    AutoConfig.from_pretrained(tmp_path / "out").save_pretrained(model_dir)
    (model_dir / "config.json").write_text((model_dir / "config.json").read_text().replace(
        '"eos_token_id": 3', '"eos_token_id": 1'))
    kept = export(fit, tmp_path / "out_config", config_dir=str(model_dir))
    assert kept.special_ids is None and AutoConfig.from_pretrained(tmp_path / "out_config").eos_token_id == 1


def test_a_new_run_from_an_unmerged_export_is_told_its_adapter_is_not_loaded(trained_lora, tmp_path):
    """A fresh trial: `model.pretrained` at a LoRA run's export trained the base without a word (the adapter in
    OUT/adapter is not loaded); the merged export is the way to start from the trained weights."""
    _, ckpt = trained_lora
    export(ckpt, tmp_path / "unmerged")
    with pytest.warns(UserWarning, match=r"holds an exported LoRA adapter in adapter/, which is not loaded.*--merge_lora"):
        Gemma4LM(pretrained=str(tmp_path / "unmerged"))
    export(ckpt, tmp_path / "merged", merge_lora=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        Gemma4LM(pretrained=str(tmp_path / "merged"))


def test_dtype_cast_writes_bf16(trained, tmp_path):
    _, ckpt = trained
    export(ckpt, tmp_path / "bf16", dtype="bfloat16")
    hf = Gemma4ForCausalLM.from_pretrained(tmp_path / "bf16", dtype="auto")
    assert {p.dtype for p in hf.parameters()} == {torch.bfloat16}


@pytest.mark.parametrize("kwargs, match", [
    ({"merge_lora": True}, "--merge_lora"),
    ({"dtype": "float64"}, "--dtype"),
    ({"max_shard_size": "lots"}, "--max_shard_size"),
])
def test_export_bad_input_names_the_option(trained, tmp_path, kwargs, match):
    _, ckpt = trained
    with pytest.raises(ConfigError, match=match):
        export(ckpt, tmp_path / "x", **kwargs)
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("merge", [False, True])
def test_lora_tensors_of_a_users_own_module_are_refused_before_writing(trained_lora, tmp_path, merge,
                                                                        record_property):
    """A module of the user's own with peft adapters and a `lora` hyper-parameter of its own meaning (here
    `lora=True`): one line naming what is missing (an AttributeError, and half an adapter folder, before)."""
    lm, ckpt = trained_lora
    state = torch.load(ckpt, map_location="cpu", weights_only=False)
    state["hyper_parameters"] = {"lora": True, "lr": 1e-3}
    own = tmp_path / "own.ckpt"
    torch.save(state, own)
    lm.config.save_pretrained(tmp_path / "cfg")
    with pytest.raises(ConfigError, match="--merge_lora" if merge else "LoRA tensors but no `model.lora` options"):
        export(own, tmp_path / "out", config_dir=str(tmp_path / "cfg"), merge_lora=merge)
    assert not (tmp_path / "out").exists()
    record_property("hardening", "export")
    record_property("case", f"LoRA tensors of a module of the user's own (no `model.lora` options){', --merge_lora' if merge else ''}: refused before writing")


def _flip_one_bit_in_a_weight(src: Path, dst: Path) -> None:
    raw = bytearray(src.read_bytes())
    with zipfile.ZipFile(src) as zf:
        record = max(zf.infolist(), key=lambda i: i.file_size)  # the largest tensor's storage
        data = zf.read(record)
    at = bytes(raw).find(data)
    assert at > 0 and bytes(raw).count(data[:64]) == 1
    raw[at + len(data) // 2] ^= 0x01
    dst.write_bytes(bytes(raw))


def test_export_refuses_a_checkpoint_with_one_flipped_bit(trained, tmp_path, record_property):
    _, ckpt = trained
    bad = tmp_path / "flipped.ckpt"
    _flip_one_bit_in_a_weight(ckpt, bad)
    with pytest.raises(CheckpointError, match="fails its CRC check"):
        export(bad, tmp_path / "out")
    record_property("hardening", "export")
    record_property("case", "one flipped bit in a weight: export refuses (CRC)")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("config", [
    build_text_config("tiny", intermediate_size=96),  # same architecture, other shapes
    build_text_config("tiny", num_hidden_layers=2),  # fewer layers: tensors the config does not have
])
def test_export_refuses_a_config_that_does_not_match_the_tensors(trained, tmp_path, config, record_property):
    _, ckpt = trained
    config.save_pretrained(tmp_path / "cfg")
    with pytest.raises(ConfigError, match=r"^`--config=.*`: does not match the checkpoint's tensors: \d+ differ, e\.g\."):
        export(ckpt, tmp_path / "out", config_dir=str(tmp_path / "cfg"))
    record_property("hardening", "export")
    record_property("case", f"--config of other shapes ({config.num_hidden_layers} layers): refused")
    assert not (tmp_path / "out").exists()


def test_export_refuses_a_config_of_another_architecture(trained, tmp_path):
    from transformers import LlamaConfig

    _, ckpt = trained
    LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                vocab_size=512).save_pretrained(tmp_path / "llama")
    # the message named an AttributeError of the build ('LlamaConfig' object has no attribute 'attention_k_eq_v')
    with pytest.raises(ConfigError, match=r"^`--config=.*llama'`: is a llama config \(LlamaConfig\); the checkpoint "
                                          r"is a Gemma4ForCausalLM$"):
        export(ckpt, tmp_path / "out", config_dir=str(tmp_path / "llama"))


def test_export_refuses_a_multimodal_config_for_a_text_only_checkpoint(trained, tmp_path):
    from transformers import Gemma4Config

    _, ckpt = trained
    Gemma4Config(text_config=build_text_config("tiny").to_dict(), vision_config=None,
                 audio_config=None).save_pretrained(tmp_path / "mm")
    with pytest.raises(ConfigError, match=r"^`--config=.*mm'`: is a multimodal config \(Gemma4Config\), the "
                                          r"checkpoint a Gemma4ForCausalLM \(its `model.model_class`=causal_lm\)"):
        export(ckpt, tmp_path / "out", config_dir=str(tmp_path / "mm"))


def test_export_accepts_the_matching_config(trained, tmp_path):
    lm, ckpt = trained
    lm.config.save_pretrained(tmp_path / "cfg")
    assert export(ckpt, tmp_path / "out", config_dir=str(tmp_path / "cfg")).num_tensors > 0


def _cli(*args: str) -> subprocess.CompletedProcess:
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])))
    return subprocess.run([sys.executable, "-m", "lightning_ffpa.export", *args], env=env, capture_output=True,
                          text=True, timeout=200)


def test_export_command_exit_codes(trained, tmp_path, monkeypatch, capsys, record_property):
    """0 on success (old `--merge-lora`-style spellings still parse); 2 and one line naming the option."""
    from lightning_ffpa.export import main

    _, ckpt = trained
    monkeypatch.setattr(sys, "argv", ["lightning-ffpa-export", str(ckpt), str(tmp_path / "ok"),
                                      "--max-shard-size", "1MB", "--dtype=bfloat16"])
    assert main() == 0
    assert capsys.readouterr().out.startswith("wrote ")
    assert (tmp_path / "ok" / "model.safetensors.index.json").is_file()
    for args, option in [((str(ckpt), str(tmp_path / "a"), "--merge-lora"), "--merge_lora"),
                         ((str(tmp_path / "missing.ckpt"), str(tmp_path / "c")), "ckpt"),
                         ((str(ckpt),), "out")]:  # named: it was the whole command line as an option
        monkeypatch.setattr(sys, "argv", ["lightning-ffpa-export", *args])
        assert main() == 2, args
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"error: `{option}"), lines
    bad = _cli(str(ckpt), str(tmp_path / "b"), "--dtype", "float64")  # the real process: exit status 2
    lines = bad.stderr.strip().splitlines()
    assert bad.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: `--dtype="), bad.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ok"]  # nothing written by the failed runs
    record_property("hardening", "export")
    record_property("case", "export command: exit 0 / exit 2 with one line naming the option")


@pytest.mark.parametrize("umask", [0o022, 0o027], ids=["umask022", "umask027"])
def test_exported_files_get_the_umasks_mode(trained_lora, tmp_path, umask):
    """Every written file (weights and adapter too, not only the JSON) is readable as the umask allows: 0644
    under 022, 0640 under 027; safetensors alone would leave the weights 0600."""
    _, ckpt = trained_lora
    old = os.umask(umask)
    try:
        export(ckpt, tmp_path / "hf", max_shard_size="1MB")
    finally:
        os.umask(old)
    modes = {str(p.relative_to(tmp_path)): oct(p.stat().st_mode & 0o777) for p in tmp_path.rglob("*") if p.is_file()}
    assert any(name.endswith("adapter_model.safetensors") for name in modes) and len(modes) > 4
    assert set(modes.values()) == {oct(0o666 & ~umask)}, modes
