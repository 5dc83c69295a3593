"""The command line's own option checks (`lightning_ffpa.cli_checks`), in-process: what each refuses and what it
lets through. The console rows (exit 2, one line) are in tests/cli/test_bad_input_table.py."""

from __future__ import annotations

import os
import re

import pytest

from lightning_ffpa.cli_checks import (
    check_config_before_subcommand,
    check_flow_values,
    check_folder_writable,
    check_negative_values,
    check_seed,
)
from lightning_ffpa.errors import ConfigError


def test_negative_values_in_the_space_form():
    for fine in (["--trainer.max_steps", "-5"], ["--model.init_args.learning_rate", "-0.5"],
                 ["--model.init_args.learning_rate=-3e-3"], ["--a", "1e-3"], ["-c", "-3e-3"]):
        check_negative_values(fine)  # argparse reads these itself
    for value in ("-3e-3", "-1.", "-2E+5"):
        with pytest.raises(ConfigError, match=re.escape(f"write `--model.init_args.learning_rate={value}`")):
            check_negative_values(["fit", "--model.init_args.learning_rate", value])


def test_flow_mappings_without_spaces_after_colons():
    """`{r:4}` is YAML's one key `r:4`: jsonargparse said only "Expected a path"."""
    for fine in (["--model.init_args.lora", "{r: 4, target_modules: [q_proj]}"], ["--a", "[q_proj, v_proj]"],
                 ["--data.init_args.tokenizer", "{url: http://host:80/x}"], ["--a={b: 1}"], ["fit", "{r:4}"],
                 ["--a", "{unclosed:"]):
        check_flow_values(fine)
    for args in (["fit", "--model.init_args.lora", "{r:4,target_modules:[q_proj]}"],
                 ["--model.init_args.lora={r: 4, lora_alpha:8}"], ["--a", "[{r:4}]"]):
        with pytest.raises(ConfigError, match=r"a YAML flow mapping needs a space after each colon: write '.*: "):
            check_flow_values(args)


def test_seed_range():
    for seed in (0, 2**32 - 1, None):
        check_seed(seed)
    for seed in (-1, 2**32):
        with pytest.raises(ConfigError, match=rf"^`seed_everything={seed}`: must be in 0\.\.4294967295"):
            check_seed(seed)


def test_run_folder_that_is_a_file_or_under_one(tmp_path):
    (tmp_path / "f").write_text("x")
    check_folder_writable(tmp_path / "new" / "run", "trainer.default_root_dir")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"]  # the probe left nothing behind
    with pytest.raises(ConfigError, match=r"is a file, not a folder$"):
        check_folder_writable(tmp_path / "f", "trainer.default_root_dir")
    with pytest.raises(ConfigError, match=rf"is under the file {tmp_path / 'f'}, not a folder$"):
        check_folder_writable(tmp_path / "f" / "run", "trainer.default_root_dir")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only (mode 555) folder")
def test_read_only_run_folder(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o555)
    with pytest.raises(ConfigError, match=rf"would be created in {ro}, which is not writable"):
        check_folder_writable(ro / "run", "trainer.default_root_dir")


@pytest.mark.parametrize("value, path", [
    ("FSDP2Strategy", "lightning_ffpa.parallel.strategy.FSDP2Strategy"),
    ("lightning_ffpa.parallel.FSDP2Strategy", "lightning_ffpa.parallel.FSDP2Strategy"),
    ("FSDPStrategy", "lightning.pytorch.strategies.fsdp.FSDPStrategy"),  # Lightning's classes by name too
    ("ddp", None), ("auto", None), ("fsdp", None),  # Lightning's registered names: left to Lightning
    ("NoSuchStrategy", None), ("no.such.Strategy", None), ("lightning_ffpa.parallel.close_process_group", None),
])
def test_a_strategy_named_by_its_class_is_found_by_its_import_path(value, path):
    from lightning_ffpa.lightning_cli import strategy_class_path

    assert strategy_class_path(value) == path


SUBCOMMANDS = ("fit", "validate", "test", "predict")


def test_a_config_before_the_subcommand_must_be_keyed_by_it(tmp_path):
    """`lightning-ffpa --config tiny fit --print_config` printed the defaults (the recipe ignored, exit 0)."""
    (tmp_path / "flat.yaml").write_text("trainer:\n  max_steps: 2\n")
    (tmp_path / "keyed.yaml").write_text("fit:\n  trainer:\n    max_steps: 2\n")
    with pytest.raises(ConfigError, match=re.escape(f"`--config='{tmp_path}/flat.yaml'`: is given before the "
                                                    "subcommand") + r".*`lightning-ffpa validate --config "):
        check_config_before_subcommand(["--config", str(tmp_path / "flat.yaml"), "validate"], SUBCOMMANDS)
    with pytest.raises(ConfigError, match=r"^`--config='tiny'`: .*`lightning-ffpa fit --config tiny`$"):
        check_config_before_subcommand(["--config=tiny", "fit"], SUBCOMMANDS, lambda _: str(tmp_path / "flat.yaml"))
    check_config_before_subcommand(["--config", str(tmp_path / "keyed.yaml"), "fit"], SUBCOMMANDS)
    check_config_before_subcommand(["fit", "--config", str(tmp_path / "flat.yaml")], SUBCOMMANDS)  # after: fine
