"""benchmarks/fit_recipes.py: a row says which entry point ran the recipe (the console script, or the module it
runs where an image has none) beside the command and exit code."""

import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks import fit_recipes  # noqa: E402


@pytest.mark.parametrize("entry, named", [(["/venv/bin/lightning-ffpa"], "lightning-ffpa"),
                                          ([sys.executable, "-m", "lightning_ffpa.cli"], "python -m lightning_ffpa.cli")])
def test_a_row_names_its_entry_point_and_the_command_after_it(entry, named, monkeypatch, tmp_path):
    ran = []
    monkeypatch.setattr(fit_recipes, "console_command", lambda: entry)
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: ran.append(cmd) or subprocess.CompletedProcess(
        cmd, 0, "fit finished at step 10\n", ""))
    row = fit_recipes.fit("tiny", tmp_path, timeout=5)
    (cmd,) = ran
    assert cmd[:len(entry)] == entry and row["command"].startswith("fit --config ")
    assert row["entry_point"] == named and row["exit_code"] == 0 and row["last_line"] == "fit finished at step 10"
    assert (tmp_path / "fit_tiny.log").read_text().startswith(" ".join(entry))
