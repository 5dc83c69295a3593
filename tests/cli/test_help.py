"""`lightning-ffpa --help` lists every command the tool has (without importing Lightning or torch, as `recipes`
and `cp` do not), and `--<key>.help` takes a class's short name."""

from __future__ import annotations

import os

import pytest

from lightning_ffpa import cli


def _help(capfd, *argv: str) -> str:
    with pytest.raises(SystemExit) as info:
        cli.main(list(argv))
    assert info.value.code in (0, None)
    return capfd.readouterr().out


def _rows(text: str) -> dict[str, str]:
    """{subcommand or option: its help text} from a `--help` screen (text wrapped onto later lines joined)."""
    rows: dict[str, str] = {}
    key = None
    for line in text.splitlines():
        if line.startswith("    ") and not line.startswith("      ") or line.startswith("  -"):
            key, _, rest = line.strip().replace("\b", "").partition("  ")  # jsonargparse: `\b[=flags]`
            rows[key] = rest.strip()
        elif key and line.startswith("      "):
            rows[key] = f"{rows[key]} {line.strip()}".strip()
        else:
            key = None
    return rows


def test_top_level_help_lists_the_commands_beside_lightnings(capfd, monkeypatch):
    monkeypatch.setenv("COLUMNS", "120")  # argparse wraps at the terminal's width
    rows = _help(capfd, "--help").splitlines()
    rows = [line.split(maxsplit=1) for line in rows if line.startswith("    ")]
    assert {"fit", "validate", "test", "predict", *cli.COMMANDS} <= {row[0] for row in rows if row}
    for name, text in cli.COMMANDS.items():
        assert [name, text] in rows  # one line each, in the subcommand list
    usage = _help(capfd, "--help").split("\n\n")[0]  # the usage line named Lightning's four alone
    assert "{fit,validate,test,predict,recipes,cp}" in usage, usage


def test_top_level_help_matches_lightningclis(capfd, monkeypatch):
    """The Lightning-free `--help` says what LightningCLI's own top-level help says: the same options, the same
    subcommands in the same order, each with the opening of LightningCLI's line."""
    from lightning_ffpa import lightning_cli

    monkeypatch.setenv("COLUMNS", "120")
    ours = _rows(_help(capfd, "--help"))
    with pytest.raises(SystemExit):
        lightning_cli.command(["--help"])
    theirs = _rows(capfd.readouterr().out)
    assert [k for k in ours if k.startswith("-")] == [k for k in theirs if k.startswith("-")]
    commands = [k for k in theirs if not k.startswith("-") and k != "(required)"]
    assert [k for k in ours if not k.startswith("-")] == commands == [*cli.LIGHTNING_COMMANDS, *cli.COMMANDS]
    for name in commands:
        assert theirs[name].startswith(ours[name]), (name, theirs[name], ours[name])


@pytest.mark.parametrize("argv", [["--help"], ["recipes"], ["cp", "tiny", "copied.yaml"]])
def test_help_only_commands_import_neither_lightning_nor_torch(tmp_path, argv):
    """The installed script answers these without the training stack (it took 9-18 s to import); counted as
    the modules `python -X importtime` reports, not as time."""
    import subprocess
    import sys

    from _console import console_script, env

    proc = subprocess.run([sys.executable, "-X", "importtime", console_script("lightning-ffpa"), *argv],
                          capture_output=True, text=True, cwd=tmp_path, env=env(), timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time")}
    heavy = sorted(m for m in imported if m.split(".")[0] in ("torch", "lightning", "transformers", "jsonargparse")
                   or m.startswith(("lightning_ffpa.lightning_cli", "lightning_ffpa.rollout")))
    assert not heavy, heavy
    assert "lightning_ffpa.cli" in imported and len(imported) < 300, len(imported)


# classes a shipped config names by class_path; without a config nothing else imports them
@pytest.mark.parametrize("key, name, option", [
    ("model", "GRPOModule", "--model.clip_eps"),
    ("trainer.callbacks", "RolloutCallback", "--trainer.callbacks.reward_funcs"),
])
def test_help_takes_a_short_class_name_without_a_config(capfd, key, name, option):
    assert option in _help(capfd, "fit", f"--{key}.help", name)


def test_output_into_a_closed_pipe_ends_quietly(tmp_path):
    """`lightning-ffpa recipes | head -1`: the reader leaves early; the tool stops with 141 and no traceback."""
    import subprocess

    from _console import console_script, env

    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first write
    proc = subprocess.run([console_script("lightning-ffpa"), "recipes"], stdout=write, stderr=subprocess.PIPE,
                          cwd=tmp_path, env=env(), text=True, timeout=120)
    os.close(write)
    assert (proc.returncode, proc.stderr) == (141, "")


def test_python_dash_m_is_the_command(tmp_path):
    """`python -m lightning_ffpa` (what `torchrun -m` starts) is the console command: its output and exit codes."""
    import subprocess
    import sys

    from _console import env

    def run(*argv):
        return subprocess.run([sys.executable, "-m", "lightning_ffpa", *argv], cwd=tmp_path, env=env(),
                              capture_output=True, text=True, timeout=120)

    listed = run("recipes")
    assert listed.returncode == 0 and "gemma4_ffpa" in listed.stdout
    bad = run("fit", "--config", "nope")
    assert bad.returncode == 2 and bad.stderr.startswith("error: `--config='nope'`") and len(bad.stderr.splitlines()) == 1
