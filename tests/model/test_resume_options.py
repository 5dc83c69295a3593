"""Model options vs an explicit checkpoint: LightningCLI would replace `model.*` with the checkpoint's hparams
silently; a difference is a ConfigError naming the option and both values unless --resume_model_from_checkpoint."""

from pathlib import Path

import lightning as L
import pytest
import yaml

from lightning_ffpa.cli import FFPACLI, main
from lightning_ffpa.data import MockDataModule
from lightning_ffpa.errors import ConfigError
from lightning_ffpa.module import Gemma4LM
from lightning_ffpa.validation import CheckpointError

LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "o_proj"]}


def _config(tmp_path: Path) -> Path:
    cfg = {
        "trainer": {"accelerator": "cpu", "devices": 1, "max_steps": 1, "logger": False, "default_root_dir": str(tmp_path),
                    "enable_progress_bar": False, "enable_model_summary": False, "limit_val_batches": 0,
                    "callbacks": [{"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                                   "init_args": {"dirpath": str(tmp_path / "ckpt"), "save_last": True}}]},
        "model": {"class_path": "lightning_ffpa.module.Gemma4LM",
                  "init_args": {"preset": "tiny", "dtype": "float32", "loss_impl": "chunked", "lora": LORA,
                                "config_overrides": {"num_hidden_layers": 2}, "warmup_steps": 0}},
        "data": {"class_path": "lightning_ffpa.data.MockDataModule",
                 "init_args": {"vocab_size": 512, "seq_length": 32, "num_samples": 4, "batch_size": 2}},
    }
    path = tmp_path / "fit.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    """One optimizer step of LoRA + chunked loss through the real CLI; returns (config, last.ckpt)."""
    tmp_path = tmp_path_factory.mktemp("resume")
    config = _config(tmp_path)
    main(["fit", "--config", str(config)])
    return config, tmp_path / "ckpt" / "last.ckpt"


class _Parsed(Exception):
    pass


class _ParseOnly(FFPACLI):
    """Stops right before the classes are built: after LightningCLI applied the checkpoint's hparams."""

    def before_instantiate_classes(self) -> None:
        raise _Parsed(self.config)


def _parse(config: Path, ckpt: Path, *extra: str):
    with pytest.raises(_Parsed) as parsed:
        _ParseOnly(model_class=None, datamodule_class=None, subclass_mode_model=True, subclass_mode_data=True,
                   auto_configure_optimizers=False,
                   args=["fit", "--config", str(config), "--ckpt_path", str(ckpt), *extra])
    return parsed.value.args[0].fit.model.init_args


def test_same_options_resume(fitted):
    config, ckpt = fitted
    init_args = _parse(config, ckpt)
    assert init_args.config_overrides == {"num_hidden_layers": 2}


@pytest.mark.parametrize("override, option, given, saved", [
    (["--model.init_args.config_overrides", "{num_hidden_layers: 3}"], "model.config_overrides",
     "{'num_hidden_layers': 3}", "{'num_hidden_layers': 2}"),
    (["--model.init_args.lora.r", "8"], "model.lora", "'r': 8", "'r': 4"),
    (["--model.init_args.learning_rate", "0.5"], "model.learning_rate", "0.5", "0.0003"),
])
def test_a_differing_option_is_an_error_naming_both_values(fitted, override, option, given, saved):
    config, ckpt = fitted
    with pytest.raises(ConfigError) as err:
        _parse(config, ckpt, *override)
    message = str(err.value)
    assert message.startswith(f"`{option}=") and given in message and saved in message
    assert "--resume_model_from_checkpoint true" in message


def test_the_switch_takes_the_checkpoints_options(fitted):
    config, ckpt = fitted
    init_args = _parse(config, ckpt, "--model.init_args.config_overrides", "{num_hidden_layers: 3}",
                       "--resume_model_from_checkpoint", "true")
    assert init_args.config_overrides == {"num_hidden_layers": 2}


def _resume_refused(module: Gemma4LM, ckpt: Path, error: type[Exception], match: str) -> None:
    """`trainer.fit(module, ckpt_path=ckpt)` through the Python API raises `error` before any step runs."""
    trainer = L.Trainer(accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)
    data = MockDataModule(vocab_size=512, seq_length=32, num_samples=4, batch_size=2)
    with pytest.raises(error, match=match):
        trainer.fit(module, data, ckpt_path=str(ckpt))
    assert trainer.global_step == 0


def test_python_api_refuses_another_architecture_before_loading(fitted):
    _, ckpt = fitted
    module = Gemma4LM(preset="tiny", dtype="float32", lora={**LORA, "r": 2}, config_overrides={"num_hidden_layers": 2})
    _resume_refused(module, ckpt, CheckpointError, r"model\.lora\.r=4`.*model\.lora\.r=2`: the weights would not fit")


@pytest.mark.parametrize("option, value", [("learning_rate", 0.5), ("weight_decay", 0.5), ("betas", (0.8, 0.9))])
def test_python_api_refuses_an_optimizer_option_the_resume_would_ignore(fitted, option, value):
    """Lightning loads the optimizer's param groups from the checkpoint after the module is built: a new learning
    rate, weight decay or betas would train with the saved ones, silently."""
    _, ckpt = fitted
    module = Gemma4LM(preset="tiny", dtype="float32", lora=LORA, config_overrides={"num_hidden_layers": 2},
                      loss_impl="chunked", warmup_steps=0, **{option: value})
    _resume_refused(module, ckpt, ConfigError, rf"^`model\.{option}=.*the resumed optimizer keeps the checkpoint's value")


def test_grpo_refuses_a_new_learning_rate_on_resume():
    """The GRPO policy's optimizer is resumed the same way: its saved learning rate would win."""
    from lightning_ffpa.hf_module import check_hparams_match
    from lightning_ffpa.rl.module import GRPOModule

    module = GRPOModule(preset="tiny", learning_rate=0.1)
    saved = dict(module.hparams, learning_rate=0.02)
    with pytest.raises(ConfigError, match=r"^`model\.learning_rate=0\.1`: differs from `ckpt_path`, which has 0\.02"):
        check_hparams_match(saved, module)
    check_hparams_match(dict(module.hparams), module)  # the same value: no error


def test_one_folder_or_the_same_targets_however_spelled_are_the_same_option(tmp_path, monkeypatch):
    """A resume was refused for `model.pretrained` spelled relative from another folder (or absolute), and for
    LoRA targets listed in another order: the same weights, "would not fit"."""
    from lightning_ffpa.hf_module import differing_options

    (tmp_path / "runs" / "base").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "runs")
    saved = {"pretrained": str(tmp_path / "runs" / "base"), "lora": {**LORA, "target_modules": ["q_proj", "o_proj"]}}
    monkeypatch.chdir(tmp_path)
    assert differing_options(saved, {"pretrained": "runs/base", "lora": {**LORA, "target_modules": ["o_proj", "q_proj"]}}) == []
    assert [k for k, _, _ in differing_options(saved, {"pretrained": "elsewhere", "lora": {**LORA, "r": 8}})] == [
        "pretrained", "lora"]


def test_a_changed_lora_option_on_resume_is_named_not_called_a_shape_mismatch():
    """`lora_alpha` changed on resume was refused as "the weights would not fit": they fit; the error names the
    LoRA sub-option and why a resume keeps it."""
    from lightning_ffpa.hf_module import check_hparams_match

    module = Gemma4LM(preset="tiny", lora={**LORA, "lora_alpha": 16})
    saved = dict(module.hparams, lora={**module.hparams["lora"], "lora_alpha": 32})
    with pytest.raises(CheckpointError, match=r"`model\.lora\.lora_alpha=32` but this run has `model\.lora\.lora_alpha"
                                              r"=16`: its adapters were trained with that value"):
        check_hparams_match(saved, module)


@pytest.fixture(scope="module")
def fitted_folder(tmp_path_factory):
    """As `fitted`, under FSDP2Strategy: the checkpoint is a distributed checkpoint folder."""
    tmp_path = tmp_path_factory.mktemp("resume_dcp")
    config = _config(tmp_path)
    cfg = yaml.safe_load(config.read_text())
    cfg["trainer"]["strategy"] = {"class_path": "lightning_ffpa.parallel.FSDP2Strategy",
                                  "init_args": {"param_dtype": "fp32", "reduce_dtype": "fp32"}}
    config.write_text(yaml.safe_dump(cfg))
    import os

    import torch.distributed as dist

    # A module fixture runs outside conftest's per-test guard: the launch variables Lightning sets here
    # (LOCAL_RANK, MASTER_PORT, ...) would make a later two-rank fit of this worker wait for a rank never spawned
    from tests.conftest import _LAUNCH_VARS

    before = {k: os.environ.get(k) for k in _LAUNCH_VARS}
    try:
        main(["fit", "--config", str(config)])
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    assert (tmp_path / "ckpt" / "last.ckpt").is_dir()
    return config, tmp_path / "ckpt" / "last.ckpt"


def test_an_explicit_checkpoint_folder_is_checked_and_taken_as_a_file_is(fitted_folder):
    """An explicit `--ckpt_path` folder skipped the option check (a differing option was replaced silently) and
    `--resume_model_from_checkpoint true` kept this run's options: LightningCLI reads hparams from files only."""
    config, ckpt = fitted_folder
    with pytest.raises(ConfigError, match=r"^`model\.warmup_steps=3`: differs from `ckpt_path=.*`, which has 0"):
        _parse(config, ckpt, "--model.init_args.warmup_steps", "3")
    taken = _parse(config, ckpt, "--model.init_args.warmup_steps", "3", "--resume_model_from_checkpoint", "true")
    assert taken.warmup_steps == 0 and taken.lora["r"] == LORA["r"]


def test_how_the_expert_adapters_run_may_change_on_resume():
    """`lora.expert_adapters` (unmerged or folded) changes how the same adapter weights compute: a resume switching
    it was refused as "the weights would not fit"; a real LoRA change is still named."""
    from lightning_ffpa.hf_module import differing_options

    experts = {"r": 2, "target_parameters": ["experts.gate_up_proj"]}
    assert differing_options({"lora": experts}, {"lora": {**experts, "expert_adapters": "folded"}}) == []
    assert differing_options({"lora": experts}, {"lora": {**experts, "r": 4}})


def test_a_defaulted_lora_option_is_named_with_its_default():
    """A run trained with the default `lora_alpha` (8, left out of the saved dict) resumed with 16: the error said
    "was trained with `model.lora.lora_alpha=None`"."""
    from lightning_ffpa.hf_module import check_hparams_match

    module = Gemma4LM(preset="tiny", lora={"r": 4, "lora_alpha": 16, "target_modules": ["q_proj"]})
    saved = dict(module.hparams, lora={"r": 4, "target_modules": ["q_proj"]})
    with pytest.raises(CheckpointError, match=r"`model\.lora\.lora_alpha=8` but this run has `model\.lora\.lora_alpha"
                                              r"=16`"):
        check_hparams_match(saved, module)


@pytest.mark.parametrize("option, value, saved", [("warmup_steps", 50, 2), ("min_lr_ratio", 0.5, 0.1)])
def test_a_changed_schedule_option_is_refused_on_resume(option, value, saved):
    """`warmup_steps` 2 -> 50 on resume: the schedule was rebuilt with the new warmup (the learning rate jumped) and
    the warning blamed `trainer.max_steps`; refused by name, as a new learning rate is."""
    from lightning_ffpa.hf_module import check_hparams_match

    module = Gemma4LM(preset="tiny", **{option: value})
    with pytest.raises(ConfigError, match=rf"^`model\.{option}={value}`: differs from `ckpt_path`, which has {saved}: "
                                          r"the resumed learning-rate schedule"):
        check_hparams_match(dict(module.hparams, **{option: saved}), module)


def test_a_changed_dtype_is_refused_on_resume_and_a_spelling_is_not_a_change():
    """`--ckpt_path last --model.init_args.dtype bf16` over a float32 run converted the weights and AdamW's state
    to bf16 silently (exit 0); the explicit file was refused. `bfloat16` and `bf16` are one dtype."""
    from lightning_ffpa.hf_module import check_hparams_match

    module = Gemma4LM(preset="tiny", dtype="bf16")
    with pytest.raises(CheckpointError, match=r"`model\.dtype='float32'` but this run has `model\.dtype='bf16'`"):
        check_hparams_match(dict(module.hparams, dtype="float32"), module)
    check_hparams_match(dict(module.hparams, dtype="bfloat16"), module)


def test_another_module_class_is_refused_first():
    """A GRPO checkpoint resumed by `--ckpt_path last` into the SFT module: the first difference found was the
    learning rate (set it, and GRPO's weights trained as SFT, exit 0). The class is compared first, for every form
    of `ckpt_path`."""
    from lightning_ffpa.hf_module import check_hparams_match

    module = Gemma4LM(preset="tiny", learning_rate=0.5)
    saved = dict(module.hparams, learning_rate=0.02, _class_path="lightning_ffpa.rl.module.GRPOModule")
    for resume in (True, False):
        with pytest.raises(ConfigError, match=r"^`model\.class_path='lightning_ffpa\.module\.Gemma4LM'`: differs from "
                                              r"`ckpt_path`, which was trained with 'lightning_ffpa\.rl\.module\."
                                              r"GRPOModule'"):
            check_hparams_match(saved, module, resume=resume)


def test_an_evaluation_compares_no_optimizer_option_and_says_why_the_model_must_match():
    """`validate`/`test`/`predict` build no optimizer: a new learning rate was refused as "would be ignored". A LoRA
    that differs is still refused, in words for an evaluation (not "a resume continues the saved run")."""
    from lightning_ffpa.hf_module import check_hparams_match

    module = Gemma4LM(preset="tiny", lora=LORA, learning_rate=0.5, warmup_steps=7, dtype="bf16")
    check_hparams_match(dict(module.hparams, learning_rate=0.02, warmup_steps=2, dtype="float32"), module, resume=False)
    with pytest.raises(CheckpointError) as err:
        check_hparams_match(dict(module.hparams, lora=None), module, resume=False)
    assert "resume" not in str(err.value) and "to be evaluated" in str(err.value), str(err.value)


def _run_main(args: list[str], capsys) -> tuple[int, list[str]]:
    rc = main(args)
    return rc, capsys.readouterr().err.strip().splitlines()


def test_grpo_checkpoint_found_by_last_is_refused_by_its_class(fitted, tmp_path, capsys):
    """`fit --ckpt_path last` over a folder whose last checkpoint is a GRPO policy's: exit 2, one line naming
    `model.class_path`, before the learning rate (here the same) or anything else is compared."""
    import torch

    config, ckpt = fitted
    state = torch.load(ckpt, map_location="cpu", weights_only=True)
    state["hyper_parameters"]["_class_path"] = "lightning_ffpa.rl.module.GRPOModule"
    state["module_class"] = "lightning_ffpa.rl.module.GRPOModule"
    (tmp_path / "ckpt").mkdir()
    torch.save(state, tmp_path / "ckpt" / "last.ckpt")
    cfg = yaml.safe_load(config.read_text())
    cfg["trainer"]["default_root_dir"] = str(tmp_path)
    cfg["trainer"]["callbacks"][0]["init_args"]["dirpath"] = str(tmp_path / "ckpt")
    (tmp_path / "fit.yaml").write_text(yaml.safe_dump(cfg))
    rc, err = _run_main(["fit", "--config", str(tmp_path / "fit.yaml"), "--ckpt_path", "last",
                         "--trainer.max_steps", "3"], capsys)
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith("error: `model.class_path='lightning_ffpa.module.Gemma4LM'`: differs from `ckpt_path"), err
    assert "export them (`lightning-ffpa-export`" in err[0] and "`model.init_args.pretrained`" in err[0]  # the route


def _validate_args(config: Path, *extra: str) -> list[str]:
    return ["validate", "--config", str(config), "--ckpt_path", "last", "--trainer.limit_val_batches", "1",
            "--data.init_args.num_val_samples", "2", *extra]


def test_validate_last_with_another_lora_is_one_error_line(fitted, capsys):
    """`validate --ckpt_path last` with another LoRA: exit 1 and a traceback (the CheckpointError of the module's
    load hook, after the start-up lines); now exit 2 and one `error:` line in an evaluation's words."""
    config, _ = fitted
    rc, err = _run_main(_validate_args(config, "--model.init_args.lora.r", "8"), capsys)
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith("error: `ckpt_path` was trained with `model.lora.r=4` but this run has `model.lora.r=8`")
    assert "to be evaluated" in err[0] and "resume" not in err[0], err


def test_validate_last_ignores_optimizer_options(fitted, capsys):
    """validate builds no optimizer: a learning rate or warmup that differs from the checkpoint's is not compared
    (it was refused as "the resumed optimizer keeps the checkpoint's value")."""
    config, _ = fitted
    rc, err = _run_main(_validate_args(config, "--model.init_args.learning_rate", "1e-3",
                                       "--model.init_args.warmup_steps", "5"), capsys)
    assert rc == 0, err


def test_validate_of_a_checkpoint_file_ignores_optimizer_options(fitted):
    """The explicit-file form compares every `model.*` option (LightningCLI would replace them): for `validate`,
    which builds no optimizer, a learning rate or warmup that differs is not an error (the model is the same)."""
    config, ckpt = fitted
    with pytest.raises(_Parsed):
        _ParseOnly(model_class=None, datamodule_class=None, subclass_mode_model=True, subclass_mode_data=True,
                   auto_configure_optimizers=False,
                   args=["validate", "--config", str(config), "--ckpt_path", str(ckpt),
                         "--model.init_args.learning_rate", "1e-3", "--model.init_args.warmup_steps", "5"])
    with pytest.raises(ConfigError, match=r"^`model\.config_overrides="):  # the model itself is still compared
        _ParseOnly(model_class=None, datamodule_class=None, subclass_mode_model=True, subclass_mode_data=True,
                   auto_configure_optimizers=False,
                   args=["validate", "--config", str(config), "--ckpt_path", str(ckpt),
                         "--model.init_args.config_overrides", "{num_hidden_layers: 3}"])
