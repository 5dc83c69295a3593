"""benchmarks/report/checkout.py: a result file's `tree` digest changes with any file of the package or the benchmarks as
it is on disk, not with results, tests or bytecode; git and a walk (a device copy without .git) give one digest for
one tree; `differs_from_commit` says whether the files are the commit's; report/pages.py treats a differing tree as
not that commit's."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # `benchmarks` is a folder of scripts
from benchmarks.report import checkout, pages, results_io  # noqa: E402

FILES = {"lightning_ffpa/__init__.py": "x = 1\n", "lightning_ffpa/sub/mod.py": "y = 2\n",
         "benchmarks/bench.py": "print(3)\n", "benchmarks/results/bench.json": "{}\n", "examples/a.yaml": "a: 1\n",
         "pyproject.toml": "[project]\n", "tests/test_a.py": "", "docs/a.md": "", ".gitignore": "__pycache__/\n"}


def _tree(root: Path) -> Path:
    for rel, text in FILES.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def _git(root: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@t", *args], check=True,
                   capture_output=True)


def test_a_walked_tree_digest_follows_the_code_and_not_results_tests_or_bytecode(tmp_path):
    root = _tree(tmp_path)
    first = checkout.tree_digest(root)
    assert first["listed_by"] == "walk" and first["differs_from_commit"] is None and first["files"] == 5
    (root / "benchmarks/results/bench.json").write_text('{"rows": []}\n')  # a run's own output
    (root / "tests/test_a.py").write_text("assert True\n")
    (root / "lightning_ffpa/__pycache__").mkdir()
    (root / "lightning_ffpa/__pycache__/mod.cpython-312.pyc").write_bytes(b"\0")
    assert checkout.tree_digest(root)["sha256"] == first["sha256"]
    (root / "lightning_ffpa/sub/mod.py").write_text("y = 3\n")  # one byte of the package
    assert checkout.tree_digest(root)["sha256"] != first["sha256"]
    (root / "lightning_ffpa/sub/mod.py").write_text("y = 2\n")
    (root / "benchmarks/bench.py").rename(root / "benchmarks/bench2.py")  # same content, another path
    assert checkout.tree_digest(root)["sha256"] != first["sha256"]


def test_git_and_a_walk_give_one_digest_and_git_says_whether_the_files_are_the_commits(tmp_path, monkeypatch):
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    monkeypatch.delenv("LIGHTNING_FFPA_COMMIT", raising=False)
    root = _tree(tmp_path / "repo")
    _git(root, "init", "-q")
    _git(root, "add", "-A")
    _git(root, "commit", "-qm", "c")
    walked = checkout.tree_digest(_tree(tmp_path / "copy"))  # the device copy: the same files, no .git
    committed = checkout.tree_digest(root)
    assert committed["listed_by"] == "git" and committed["differs_from_commit"] is False
    assert committed["sha256"] == walked["sha256"] and committed["files"] == walked["files"]
    (root / "benchmarks/results/bench.json").write_text("[]\n")  # results are not code: still the commit's
    assert checkout.tree_digest(root) == committed
    (root / "lightning_ffpa/__init__.py").write_text("x = 2\n")  # a local edit the commit cannot name
    edited = checkout.tree_digest(root)
    assert edited["differs_from_commit"] is True and edited["sha256"] != committed["sha256"]
    (root / "lightning_ffpa/__init__.py").write_text("x = 1\n")
    (root / "lightning_ffpa/new.py").write_text("")  # an untracked file travels to the device: it counts
    added = checkout.tree_digest(root)
    assert added["differs_from_commit"] is True and added["files"] == committed["files"] + 1
    monkeypatch.setenv("LIGHTNING_FFPA_COMMIT", "f" * 40)  # a stale .git: it says nothing of the named commit
    assert checkout.tree_digest(root)["differs_from_commit"] is None


def test_write_result_records_the_checkouts_digest_and_the_report_shows_it(tmp_path):
    path = results_io.write_result("probe", [{"row": "a"}], {"k": 1}, out=tmp_path / "probe.json")
    record = json.loads(path.read_text())
    assert record["tree"] == checkout.tree_digest()  # the checkout these tests run in, beside `commit`
    assert list(record)[list(record).index("commit") + 1] == "tree"
    assert record["tree"]["files"] > 100 and len(record["tree"]["sha256"]) == 64
    note = pages.tree_note(record["tree"])
    assert note.startswith(f"; tree: `{record['tree']['sha256'][:12]}` (") and pages.tree_note(None) == ""
    assert pages.clean_commit({"commit": "abc1234", "tree": {"differs_from_commit": False}})
    assert not pages.clean_commit({"commit": "abc1234", "tree": {"differs_from_commit": True}})


def test_a_result_without_ffpa_says_why_its_version_is_null(tmp_path):
    """CPU-made result files had `versions.ffpa_attn: null` and no reason beside it."""
    record = json.loads(results_io.write_result("probe", [], {}, out=tmp_path / "probe.json").read_text())
    if record["versions"]["ffpa_attn"] is None:
        assert record["ffpa_unavailable"]
    else:
        assert "ffpa_unavailable" not in record
