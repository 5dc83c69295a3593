"""Running the installed console scripts (`lightning-ffpa`, `lightning-ffpa-export`) as a user does.

The scripts are the ones installed beside the test's Python (the venv's `bin/`), run in a subprocess with
this checkout first on PYTHONPATH, so the code under test is this tree's, through the real entry point.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def console_script(name: str) -> str:
    """Path of an installed console script: beside `sys.executable`, else on PATH."""
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.exists() else shutil.which(name)
    assert found, f"console script {name!r} is not installed (pip install -e .)"
    return found


def env(pythonpath: bool = True) -> dict[str, str]:
    """The environment for a console script: this checkout first on PYTHONPATH, no debug, one thread."""
    out = {k: v for k, v in os.environ.items() if k not in ("LIGHTNING_FFPA_DEBUG", "PYTHONPATH")}
    if pythonpath:
        out["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    out.update(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", PYTHONWARNINGS=out.get("PYTHONWARNINGS", ""))
    return out


def run(command: str | list[str], cwd: Path, timeout: float = 300, **kwargs) -> subprocess.CompletedProcess:
    """Run `command` (its first word is the script name) in `cwd`; stdout and stderr captured as text."""
    words = shlex.split(command) if isinstance(command, str) else list(command)
    return subprocess.run([console_script(words[0]), *words[1:]], cwd=cwd, env=kwargs.pop("env", env()),
                          capture_output=True, text=True, timeout=timeout, **kwargs)


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """Every file and folder under `root` with its size and mtime: what a command wrote shows up here."""
    return {str(p.relative_to(root)): (p.lstat().st_size, p.lstat().st_mtime_ns) for p in root.rglob("*")}
