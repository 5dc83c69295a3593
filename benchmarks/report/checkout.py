"""Which code a benchmark run ran: a SHA-256 over the files of the checkout as they are on disk, beside `commit`.

A device copy is the worktree's tracked and untracked-not-ignored files, with or without `.git`; `commit`
names a revision, and its local edits are invisible there. The digest covers the files that decide what a row
runs (SCOPE: the package, the benchmarks, the examples, pyproject.toml), not tests, docs or
`benchmarks/results/`: a run that writes a result must not change the next run's digest. The files are listed
by git where `.git` is present (tracked plus untracked-not-ignored: what a device copy carries) and by a walk of
SCOPE otherwise (skipping what .gitignore names in it: bytecode, build metadata); both list the same files for
one tree, so a digest taken here matches one taken on its device copy. This module does not decide what a
differing digest means; pages.py shows it.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
SCOPE = ("lightning_ffpa", "benchmarks", "examples", "pyproject.toml")
EXCLUDED = ("benchmarks/results/",)
_SKIP_DIRS = {"__pycache__", ".pytest_cache", ".ruff_cache"}  # what .gitignore names inside SCOPE
_SKIP_SUFFIXES = (".pyc", ".egg-info")


def _in_scope(rel: str) -> bool:
    return not rel.startswith(EXCLUDED)


def _git(root: Path, *args: str) -> str | None:
    if not (root / ".git").exists():
        return None
    try:
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None


def _walk(root: Path) -> list[str]:
    out = []
    for top in SCOPE:
        path = root / top
        if path.is_file():
            out.append(top)
            continue
        for folder, dirs, files in os.walk(path):
            dirs[:] = [d for d in dirs if d not in _SKIP_DIRS and not d.endswith(_SKIP_SUFFIXES)]
            out += [Path(folder, f).relative_to(root).as_posix() for f in files if not f.endswith(_SKIP_SUFFIXES)]
    return out


def listed_files(root: Path = ROOT) -> tuple[list[str], str]:
    """The files the digest covers (sorted, relative to `root`) and what listed them: "git" or "walk"."""
    listed = _git(root, "ls-files", "-z", "--cached", "--others", "--exclude-standard", "--", *SCOPE)
    files, by = (listed.split("\0"), "git") if listed is not None else (_walk(root), "walk")
    return sorted({f for f in files if f and _in_scope(f) and (root / f).is_file()}), by  # a deleted file is left out


def tree_digest(root: Path = ROOT) -> dict[str, Any]:
    """`sha256` over each file's path and content, the file count, what listed them, and `differs_from_commit`:
    whether any of them differs from git's HEAD (None without git, or where LIGHTNING_FFPA_COMMIT names another
    revision than HEAD: a copied stale .git says nothing about the named commit)."""
    files, by = listed_files(root)
    digest = hashlib.sha256()
    for rel in files:
        data = (root / rel).read_bytes()
        digest.update(f"{rel}\0{len(data)}\0".encode())  # path and length: no two trees hash alike by shifting bytes
        digest.update(data)
    differs = None
    if by == "git":
        head = (_git(root, "rev-parse", "HEAD") or "").strip()
        named = os.environ.get("LIGHTNING_FFPA_COMMIT")
        status = _git(root, "status", "--porcelain", "--", *SCOPE, *(f":!{e}" for e in EXCLUDED))
        if head and status is not None and (not named or head.startswith(named) or named.startswith(head)):
            differs = bool(status.strip())
    return {"sha256": digest.hexdigest(), "files": len(files), "listed_by": by, "differs_from_commit": differs}
