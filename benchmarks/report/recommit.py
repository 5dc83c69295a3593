"""Name the commit a recorded result ran, where its `commit` field is not one (a device copy's stale `.git` or a
shell mistake wrote something else), by proof: the record's `tree` digest must equal the digest of that commit's
checkout (`checkout.tree_digest` over a temporary worktree). Only `commit` changes; the old value and who
changed it are kept in `commit_recovered`. Anything else is refused, one line naming the option.

    python -m benchmarks.report.recommit benchmarks/results/FILE.json SHA
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
from pathlib import Path

from benchmarks.report.checkout import ROOT, tree_digest
from benchmarks.report.results_io import provenance, read_result


def digest_at(sha: str, root: Path = ROOT) -> tuple[str, str]:
    """(full sha, tree digest) of commit `sha`, from a temporary detached worktree."""
    from lightning_ffpa.errors import ConfigError

    try:
        full = subprocess.run(["git", "-C", str(root), "rev-parse", "--verify", f"{sha}^{{commit}}"],
                              capture_output=True, text=True, check=True).stdout.strip()
    except subprocess.CalledProcessError:
        raise ConfigError("SHA", sha, "is not a commit of this repository") from None
    with tempfile.TemporaryDirectory() as tmp:
        where = Path(tmp) / "tree"
        subprocess.run(["git", "-C", str(root), "worktree", "add", "-q", "--detach", str(where), full], check=True)
        try:
            return full, tree_digest(where)["sha256"]
        finally:
            subprocess.run(["git", "-C", str(root), "worktree", "remove", "--force", str(where)], check=True)


def recommit(path: str | Path, sha: str, root: Path = ROOT) -> str:
    """Set `path`'s commit to `sha` (full) if its recorded tree is that commit's; returns the full sha."""
    from lightning_ffpa.errors import ConfigError

    record = read_result(path, "FILE")
    recorded = (record.get("tree") or {}).get("sha256")
    if not recorded:
        raise ConfigError("FILE", str(path), "records no tree digest: nothing proves which commit ran")
    full, digest = digest_at(sha, root)
    if digest != recorded:
        raise ConfigError("SHA", sha, f"its tree digest {digest[:12]} is not the file's {recorded[:12]}")
    record["commit_recovered"] = {**provenance("python -m benchmarks.report.recommit"), "was": record.get("commit"),
                                  "tree_sha256": recorded}
    record["commit"] = full
    Path(path).write_text(json.dumps(record, indent=2, default=str) + "\n")
    return full


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("file")
    p.add_argument("sha")
    args = p.parse_args(argv)
    print(recommit(args.file, args.sha))


if __name__ == "__main__":
    import sys

    from lightning_ffpa.errors import console_entry

    sys.exit(console_entry(main, hold=False))
