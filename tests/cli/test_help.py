"""`lightning-ffpa --help` lists every command the tool has, and `--<key>.help` takes a class's short name."""

from __future__ import annotations

import os

import pytest

from lightning_ffpa import cli


def _help(capfd, *argv: str) -> str:
    with pytest.raises(SystemExit) as info:
        cli.main(list(argv))
    assert info.value.code in (0, None)
    return capfd.readouterr().out


def test_top_level_help_lists_the_commands_beside_lightnings(capfd, monkeypatch):
    monkeypatch.setenv("COLUMNS", "120")  # argparse wraps at the terminal's width
    rows = [line.split(maxsplit=1) for line in _help(capfd, "--help").splitlines() if line.startswith("    ")]
    assert {"fit", "validate", "test", "predict", *cli.COMMANDS} <= {row[0] for row in rows if row}
    for name, text in cli.COMMANDS.items():
        assert [name, text] in rows  # one line each, in the subcommand list


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
