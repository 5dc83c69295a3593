"""Packaged recipes: one copy of each YAML (configs/ is what the package links), bare names resolve to it,
`lightning-ffpa recipes` lists them and `lightning-ffpa cp` copies one out without overwriting."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from lightning_ffpa import cli, recipes
from lightning_ffpa.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = sorted(p.stem for p in (ROOT / "configs").glob("*.yaml"))


def test_package_links_the_top_level_configs_one_copy():
    link = ROOT / "lightning_ffpa" / "configs"
    assert link.is_symlink() and link.resolve() == (ROOT / "configs").resolve()
    assert recipes.names() == SHIPPED and len(SHIPPED) >= 5


@pytest.mark.parametrize("name", ["tiny", "tiny.yaml", "gemma4_ffpa"])
def test_bare_name_resolves_to_the_packaged_file(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    stem = name.removesuffix(".yaml")
    assert recipes.find(name).read_bytes() == (ROOT / "configs" / f"{stem}.yaml").read_bytes()
    args = recipes.resolve_config_args(["fit", "--config", name, "-c", name, f"--config={name}"])
    assert args[2] == args[4] == args[5].removeprefix("--config=") == str(recipes.find(name))


def test_a_path_wins_over_a_recipe_and_inline_configs_pass_through(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny").write_text("trainer: {max_steps: 1}\n")
    inline = "{trainer: {max_steps: 1}}"
    assert recipes.resolve_config_args(["--config", "tiny", "--config", inline]) == ["--config", "tiny",
                                                                                     "--config", inline]


@pytest.mark.parametrize("value, reason", [("nope", "neither a file nor a packaged recipe"),
                                           (".", "is a folder"), ("bad.yaml", "is not valid YAML (line ")])
def test_bad_config_values_name_the_option(value, reason, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bad.yaml").write_text("a: 1\nb: [\n")
    with pytest.raises(ConfigError, match=r"`--config=.*" + re.escape(reason)):
        recipes.resolve_config_args(["fit", "--config", value])


def test_recipes_command_lists_every_recipe_with_its_summary(capsys):
    assert cli.main(["recipes"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in out] == SHIPPED
    assert all(len(line.split()) > 3 for line in out)  # each has its header comment


def test_cp_copies_into_a_folder_or_file_and_never_overwrites(tmp_path, capsys):
    assert cli.main(["cp", "tiny", str(tmp_path)]) == 0
    copied = tmp_path / "tiny.yaml"
    assert copied.read_bytes() == (ROOT / "configs" / "tiny.yaml").read_bytes()
    assert capsys.readouterr().out.strip() == str(copied)
    copied.write_text("# mine\n")
    assert cli.main(["cp", "tiny", str(copied)]) == 2
    assert copied.read_text() == "# mine\n"  # nothing already saved is lost
    assert capsys.readouterr().err.strip().startswith("error: `dest=")
    assert cli.main(["cp", "tiny.yaml", str(copied), "--force"]) == 0
    assert copied.read_bytes() == (ROOT / "configs" / "tiny.yaml").read_bytes()
    assert cli.main(["cp", "--list"]) == 0 and "tiny_grpo" in capsys.readouterr().out


def test_fit_by_recipe_name_parses(capsys):
    with pytest.raises(SystemExit) as info:
        cli.build(["fit", "--config", "tiny", "--print_config"])
    assert info.value.code == 0 and "lightning_ffpa.module.Gemma4LM" in capsys.readouterr().out
