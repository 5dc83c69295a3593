"""The bad-input table: each case fails with one clear error naming the option, before any model is built
or any step runs, and leaves the checkpoints already on disk byte-for-byte unchanged.

Every case runs the real CLI in-process (`lightning_ffpa.cli.main(args)`) against a folder holding a real
checkpoint of the tiny config. "Before expensive work" is counted: the HF model must never be built on a
real device (`Gemma4LM.build_model`) and no training step may run.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import yaml
from _helpers import run_cli, tiny_config, tree_hash, write_config

from lightning_ffpa.errors import ConfigError, InputError
from lightning_ffpa.module import Gemma4LM

FSDP2 = "lightning_ffpa.parallel.FSDP2Strategy"


@pytest.fixture(scope="module")
def existing(tmp_path_factory) -> Path:
    """A run folder with real checkpoints of the tiny config (steps 1, 2 and last)."""
    root = tmp_path_factory.mktemp("existing")
    cfg = write_config(root / "fit.yaml", tiny_config(root / "ckpt", max_steps=2, every_n_train_steps=1))
    run_cli(["fit", "--config", str(cfg)])
    assert (root / "ckpt" / "last.ckpt").is_file()
    return root


def _broken(existing: Path, tmp: Path, kind: str) -> Path:
    """A damaged copy of the last checkpoint (the originals stay as they are)."""
    src = existing / "ckpt" / "last.ckpt"
    dst = tmp / f"{kind}.ckpt"
    data = src.read_bytes()
    if kind == "truncated":
        dst.write_bytes(data[: len(data) // 2])
    elif kind == "bitflip":
        buf = bytearray(data)
        buf[len(buf) // 2] ^= 0xFF  # inside a tensor record: only the CRC can tell
        dst.write_bytes(bytes(buf))
    elif kind == "garbage":
        dst.write_bytes(b"not a checkpoint\n" * 100)
    elif kind == "weights_only":
        state = torch.load(src, map_location="cpu", weights_only=True)
        torch.save({k: state[k] for k in ("state_dict", "hyper_parameters", "epoch")}, dst)
    elif kind == "empty_dir":
        dst = tmp / "empty_dir"
        dst.mkdir()
    elif kind in ("dcp_truncated", "dcp_missing_shard"):
        dst = _dcp_copy(src, tmp / kind)
        shard = next(dst.glob("*.distcp"))
        if kind == "dcp_truncated":
            shard.write_bytes(shard.read_bytes()[:100])
        else:
            shard.unlink()
    return dst


def _dcp_copy(src: Path, dst: Path) -> Path:
    """The same state in Lightning's DCP folder layout (tensors via DCP, the rest in meta.pt)."""
    import torch.distributed.checkpoint as dcp

    from lightning_ffpa._compat.lightning import lightning_dcp_meta_filename

    state = torch.load(src, map_location="cpu", weights_only=True)
    dcp.save({"state_dict": state.pop("state_dict")}, checkpoint_id=str(dst), no_dist=True)
    torch.save(state, dst / lightning_dcp_meta_filename())
    return dst


def _lora(targets) -> dict:
    return {"model": {"lora": {"r": 2, "lora_alpha": 4, "target_modules": targets}}}


def _strategy(**init_args) -> dict:
    return {"strategy": {"class_path": FSDP2, "init_args": init_args}}


# The error must contain this text: P(...) in the parser's error (raised as a one-line ConfigError/InputError,
# not a usage dump), R(...) in an exception raised by our code or Lightning (the parser accepted the input).
def P(text: str) -> tuple[str, str]:
    return ("parse", text)


def R(text: str) -> tuple[str, str]:
    return ("raise", text)


# (case id, config changes (`subcommand`: other than fit), extra CLI args, checkpoint to damage or None, expected error)
CASES = [
    ("unknown trainer key", {}, ["--trainer.max_stepz=3"], None, P("max_stepz")),
    ("abbreviated trainer option", {}, ["--trainer.max_step", "3"], None, P("unrecognized arguments: --trainer.max_step")),
    ("--optimizer (the model builds its own)", {}, ["--optimizer", "AdamW"], None,
     P("`--optimizer`: is not an option: the model builds its optimizer")),
    ("--lr_scheduler (the model builds its own)", {}, ["--lr_scheduler", "StepLR"], None, P("`warmup_steps`")),
    ("an optimizer section in YAML (the model builds its own)",
     {"top_level": {"optimizer": {"class_path": "torch.optim.SGD", "init_args": {"lr": 0.1}}}}, [], None,
     P("`optimizer`: is not an option: the model builds its optimizer")),
    ("unknown model key in YAML", {"model": {"learning_rat": 0.1}}, [], None, P("learning_rat")),
    ("missing config file", {}, ["--config", "/nonexistent/fit.yaml"], None, P("/nonexistent/fit.yaml")),
    ("unsupported model.dtype", {"model": {"dtype": "float64"}}, [], None, P("dtype")),
    ("unsupported trainer.precision", {}, ["--trainer.precision=fp8"], None, P("precision")),
    ("unknown attn_implementation", {"model": {"attn_implementation": "flash_magic"}}, [], None,
     R("model.attn_implementation")),
    ("unknown preset", {"model": {"preset": "gemma4-999b"}}, [], None, R("preset")),
    ("missing pretrained dir", {"model": {"pretrained": "/nonexistent/gemma4"}}, [], None, R("model.pretrained")),
    ("missing data.train_file", {"data_class": "lightning_ffpa.data.TextDataModule",
                                 "data": {"train_file": "/nonexistent/train.txt"}}, [], None, R("data.init_args.train_file")),
    ("missing data.val_file", {"data_class": "lightning_ffpa.data.TextDataModule",
                               "data": {"val_file": "/nonexistent/val.jsonl"}}, [], None, R("data.init_args.val_file")),
    ("missing tokenizer dir", {"data_class": "lightning_ffpa.data.TextDataModule",
                               "data": {"tokenizer": "/nonexistent/tok"}}, [], None, R("data.init_args.tokenizer")),
    ("data.batch_size=0", {"data": {"batch_size": 0}}, [], None, R("data.init_args.batch_size")),
    ("seq length over max_position_embeddings", {"data": {"seq_length": 4096}}, [], None, R("data.init_args.seq_length")),
    ("data vocab larger than the model's", {"data": {"vocab_size": 1024}}, [], None, R("data.init_args.vocab_size")),
    ("missing ckpt_path", {}, ["--ckpt_path", "/nonexistent/last.ckpt"], None, R("ckpt_path")),
    ("truncated checkpoint", {}, [], "truncated", R("ckpt_path")),
    ("bit-flipped checkpoint", {}, [], "bitflip", R("ckpt_path")),
    ("garbage checkpoint file", {}, [], "garbage", R("ckpt_path")),
    ("weights-only checkpoint resumed", {}, [], "weights_only", R("ckpt_path")),
    ("directory that is not a DCP checkpoint", {}, [], "empty_dir", R("ckpt_path")),
    ("DCP checkpoint with a truncated shard", {}, [], "dcp_truncated", R("ckpt_path")),
    ("DCP checkpoint with a missing shard", {}, [], "dcp_missing_shard", R("ckpt_path")),
    ("checkpoint of another architecture", {"model": {"preset": "tiny-moe"}}, ["--ckpt_path", "last"], None,
     R("model.preset")),
    ("ckpt_path=hpc without an HPC checkpoint", {}, ["--ckpt_path", "hpc"], None, R("ckpt_path")),
    # `last` runs the comparisons an explicit file does: a new dtype converted the weights and AdamW's state, a new
    # warmup rebuilt the schedule mid-run (both exit 0)
    ("another dtype on a `last` resume", {"model": {"dtype": "bf16"}}, ["--ckpt_path", "last"], None,
     R("`model.dtype='float32'` but this run has `model.dtype='bf16'`")),
    ("another warmup on a `last` resume", {"model": {"warmup_steps": 50}}, ["--ckpt_path", "last"], None,
     R("`model.warmup_steps=50`: differs from `ckpt_path`, which has 2")),
    ("LoRA targets that match nothing", _lora(["nope_proj"]), [], None, R("model.lora.target_modules")),
    ("one LoRA target of two matches nothing", _lora(["q_proj", "vv_proj"]), [], None, R("vv_proj")),
    ("LoRA regex that matches nothing", _lora(r".*\.attn_zz"), [], None, R("model.lora.target_modules")),
    pytest.param("dp x cp does not multiply to the world size", {**_strategy(data_parallel_size=2),
                 "trainer": {"devices": 1}}, [], None, R("data_parallel_size=2")),
    pytest.param("cp does not divide the world size", {**_strategy(context_parallel_size=3),
                 "trainer": {"devices": 2}}, [], None, R("context_parallel_size=3")),
    pytest.param("cp>1 with the direct ffpa backend", {"model": {"attn_implementation": "ffpa"},
                 **_strategy(context_parallel_size=2), "trainer": {"devices": 2}}, [], None,
                 R("model.attn_implementation")),
    ("sliding fa4 where flash-attn-4 cannot run",
     {"callbacks": [{"class_path": "lightning_ffpa.callbacks.FFPAAttention", "init_args": {"sliding": "fa4"}}]}, [],
     None, R("FFPAAttention.sliding='fa4'")),
    pytest.param("expert parallelism with a dense model", {**_strategy(expert_parallel_size=2),
                 "trainer": {"devices": 2}}, [], None, R("`expert_parallel_size=2`: needs a MoE model")),
    pytest.param("expert_parallel_size does not divide num_experts", {"model": {"preset": "tiny-moe"},
                 **_strategy(expert_parallel_size=3), "trainer": {"devices": 3}}, [], None,
                 R("`expert_parallel_size=3`: does not divide the model's num_experts=4")),
    pytest.param("expert_parallel_size does not divide the world size", {"model": {"preset": "tiny-moe"},
                 **_strategy(expert_parallel_size=4), "trainer": {"devices": 2}}, [], None,
                 R("`expert_parallel_size=4`: does not divide the data-parallel size 2")),
    pytest.param("expert parallelism with cp>1", {"model": {"preset": "tiny-moe"},
                 **_strategy(expert_parallel_size=2, context_parallel_size=2), "trainer": {"devices": 4}}, [], None,
                 R("`expert_parallel_size=2`: cannot be combined with `context_parallel_size=2`")),
    pytest.param("expert parallelism with LoRA on the expert stacks", {"model": {
                 "preset": "tiny-moe", "lora": {"r": 2, "lora_alpha": 4, "target_parameters": ["experts.gate_up_proj"]}},
                 **_strategy(expert_parallel_size=2), "trainer": {"devices": 2}}, [], None,
                 R("`expert_parallel_size=2`: is not supported with LoRA on the expert stacks")),
    pytest.param("seq length not divisible by 2*cp", {**_strategy(context_parallel_size=2),
                 "trainer": {"devices": 2}, "data": {"seq_length": 30}}, [], None,
                 R("data.init_args.seq_length=30")),  # MockDataModule's own option name
    ("reward function import path that does not resolve",
     {"callbacks": [{"class_path": "lightning_ffpa.callbacks.rollout.RolloutCallback",
                     "init_args": {"reward_funcs": ["no_such_module.reward"]}}]}, [], None, P("reward_funcs")),
    ("sliding KV page pool smaller than one window",  # tiny: a 16-token window spans 3 pages of 8, plus page 0
     {"callbacks": [{"class_path": "lightning_ffpa.callbacks.rollout.RolloutCallback",
                     "init_args": {"reward_funcs": ["lightning_ffpa.rl.rewards.length_reward"],
                                   "sampling": {"max_new_tokens": 8},
                                   "engine": {"page_size": 8, "max_seq_len": 64, "num_sliding_pages": 3}}}]},
     [], None, R("RolloutCallback.engine.num_sliding_pages=3")),
    # validate in a fresh process: `best` raised Lightning's ValueError (exit 1), `hpc` named `.fit(ckpt_path="hpc")`
    ("validate --ckpt_path best", {"subcommand": "validate", "data": {"num_val_samples": 2}}, ["--ckpt_path", "best"],
     None, R("`ckpt_path='best'`: `validate` has no best checkpoint")),
    ("validate --ckpt_path hpc without an HPC checkpoint", {"subcommand": "validate", "data": {"num_val_samples": 2}},
     ["--ckpt_path", "hpc"], None, R("`ckpt_path='hpc'`: no such checkpoint in")),
    # the module's load hook refused it mid-validate: exit 1, a traceback, after the start-up lines
    ("validate --ckpt_path last with another architecture", {"subcommand": "validate", "data": {"num_val_samples": 2},
     "model": {"config_overrides": {"num_hidden_layers": 1}}}, ["--ckpt_path", "last"], None,
     R("to be evaluated")),
]


def _config(existing: Path, tmp: Path, changes: dict) -> Path:
    cfg = tiny_config(existing / "ckpt", max_steps=4, every_n_train_steps=1, callbacks=changes.get("callbacks"))
    if "data_class" in changes:
        cfg["data"] = {"class_path": changes["data_class"], "init_args": {"max_seq_length": 32, "batch_size": 2}}
    cfg["model"]["init_args"].update(changes.get("model", {}))
    cfg["data"]["init_args"].update(changes.get("data", {}))
    cfg["trainer"].update(changes.get("trainer", {}))
    if "strategy" in changes:
        cfg["trainer"]["strategy"] = changes["strategy"]
    cfg.update(changes.get("top_level", {}))  # a section of its own (`optimizer:`)
    return write_config(tmp / "case.yaml", cfg)


@pytest.mark.parametrize("case, changes, extra, damage, expected", CASES, ids=[
    c.values[0] if hasattr(c, "values") else c[0] for c in CASES])
def test_bad_input_fails_early_by_name_and_keeps_checkpoints(
        case, changes, extra, damage, expected, existing, tmp_path, monkeypatch, capsys, record_property):
    built, steps = [], []
    build = Gemma4LM.build_model
    monkeypatch.setattr(Gemma4LM, "build_model", lambda self, device=None, **kw: (
        built.append(str(device)), build(self, device, **kw))[1])
    step = Gemma4LM.training_step
    monkeypatch.setattr(Gemma4LM, "training_step", lambda self, *a: (steps.append(1), step(self, *a))[1])

    args = [changes.get("subcommand", "fit"), "--config", str(_config(existing, tmp_path, changes)), *extra]
    if damage is not None:
        args += ["--ckpt_path", str(_broken(existing, tmp_path, damage))]
    before = tree_hash(existing / "ckpt")
    with pytest.raises((Exception, SystemExit)) as info:  # noqa: B017 - the message is what is checked
        run_cli(args)
    after = tree_hash(existing / "ckpt")
    err = capsys.readouterr().err
    kind, text = expected
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))

    record_property("hardening", "bad_input")
    record_property("case", case)
    record_property("data_lost", len(changed))
    if kind == "parse":
        assert isinstance(info.value, (ConfigError, InputError)) and text in str(info.value), \
            f"parser did not name {text!r}: {info.value!r}"
    else:
        assert not isinstance(info.value, SystemExit), f"rejected by the parser instead:\n{err[-2000:]}"
        assert text in str(info.value), f"error does not name {text!r}: {info.value!r}"
    assert [d for d in built if d != "meta"] == [], "the model was built before the error"
    assert steps == [], "a training step ran before the error"
    assert not changed, f"existing checkpoints changed: {changed}"


def test_table_has_at_least_20_cases_that_run_today():
    runnable = [c for c in CASES if not hasattr(c, "marks") or not c.marks]
    assert len(CASES) >= 20 and len(runnable) >= 20, (len(CASES), len(runnable))


def test_good_config_passes_preflight_and_resumes(existing, tmp_path):
    """Control: the same harness with nothing wrong resumes from `last` and trains (the checks can pass)."""
    cfg = yaml.safe_load(_config(existing, tmp_path, {}).read_text())
    cfg["trainer"]["callbacks"][0]["init_args"]["dirpath"] = str(tmp_path / "ckpt")
    shutil.copy(existing / "ckpt" / "last.ckpt", tmp_path / "start.ckpt")
    cli = run_cli(["fit", "--config", str(write_config(tmp_path / "ok.yaml", cfg)),
                   "--ckpt_path", str(tmp_path / "start.ckpt")])
    assert cli.trainer.global_step == 4
