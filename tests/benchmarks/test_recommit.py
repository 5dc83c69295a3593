import json
import subprocess

import pytest

from benchmarks.report import recommit
from benchmarks.report.checkout import ROOT
from lightning_ffpa.errors import ConfigError


def _record(tmp_path, tree_sha):
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"benchmark": "b", "rows": [], "summary": {}, "commit": "abc1234\nabc1234",
                                "tree": {"sha256": tree_sha}}))
    return path


def test_a_file_gets_the_commit_whose_tree_it_recorded_and_nothing_else(tmp_path):
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    full, digest = recommit.digest_at("HEAD")
    assert full == head and len(digest) == 64
    path = _record(tmp_path, digest)
    assert recommit.recommit(path, "HEAD") == head
    record = json.loads(path.read_text())
    assert record["commit"] == head and record["commit_recovered"]["was"] == "abc1234\nabc1234"
    other = _record(tmp_path, "0" * 64)  # a tree that is not HEAD's: refused, the file untouched
    with pytest.raises(ConfigError, match="^`SHA='HEAD'`: its tree digest"):
        recommit.recommit(other, "HEAD")
    assert json.loads(other.read_text())["commit"] == "abc1234\nabc1234"
    with pytest.raises(ConfigError, match="not a commit"):
        recommit.recommit(other, "f" * 40)
