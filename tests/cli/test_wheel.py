"""The wheel a user installs: built from this tree (offline), installed into a fresh virtualenv that reuses
the installed torch/lightning, it lists and runs the packaged recipes by name from outside the repository.

The fresh venv sees the test venv's site-packages through a `.pth` line (a venv made from a venv's Python
with `--system-site-packages` would see the base interpreter's, which has no torch); the `.pth` adds that
folder without running its own `.pth` files, so the editable install of this checkout stays out and the
wheel's copy is the one imported. PYTHONPATH is not set for those commands.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
from _console import ROOT, env

SOURCES = ["pyproject.toml", "README.md", "lightning_ffpa", "configs"]


def _sh(*cmd, cwd=None, **kwargs) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, capture_output=True, text=True, timeout=540, **kwargs)
    assert proc.returncode == 0, f"{cmd}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return proc


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """`pip wheel` of a copy of this tree's package sources (the build writes build/ and egg-info there)."""
    src = tmp_path_factory.mktemp("src")
    for name in SOURCES:
        if (ROOT / name).is_dir():  # links kept as links: lightning_ffpa/configs -> ../configs
            shutil.copytree(ROOT / name, src / name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(ROOT / name, src / name)
    dist = tmp_path_factory.mktemp("dist")
    _sh(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", dist, src,
        env=env(pythonpath=False))
    (found,) = dist.glob("lightning_ffpa-*.whl")
    return found


def test_wheel_ships_every_recipe_once_and_an_spdx_license(wheel):
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        metadata = zf.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    shipped = sorted(p.name for p in (ROOT / "configs").glob("*.yaml"))
    assert sorted(n.rsplit("/", 1)[-1] for n in names if n.startswith("lightning_ffpa/configs/")) == shipped
    assert not any(n.startswith("configs/") for n in names)  # one copy: inside the package
    assert "License-Expression: Apache-2.0" in metadata


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_installed_wheel_fits_the_tiny_recipe_by_name_outside_the_repo(wheel, tmp_path):
    venv = tmp_path / "venv"
    _sh(sys.executable, "-m", "venv", "--without-pip", venv)
    py = venv / "bin" / "python"
    site = _sh(py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").stdout.strip()
    Path(site, "_reuse_test_venv.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _sh(sys.executable, "-m", "pip", "--python", py, "install", "--no-deps", "--no-index", wheel)

    work = tmp_path / "work"  # outside the repository, no PYTHONPATH: only the wheel can serve the imports
    work.mkdir()
    clean = env(pythonpath=False)
    where = _sh(py, "-c", "import lightning_ffpa, sys; print(lightning_ffpa.__file__)", cwd=work, env=clean)
    assert where.stdout.strip().startswith(site), where.stdout
    listed = _sh(venv / "bin" / "lightning-ffpa", "recipes", cwd=work, env=clean).stdout
    assert [ln.split()[0] for ln in listed.splitlines()] == sorted(p.stem for p in (ROOT / "configs").glob("*.yaml"))
    fit = _sh(venv / "bin" / "lightning-ffpa", "fit", "--config", "tiny", "--trainer.max_steps", "2",
              "--trainer.limit_val_batches", "0", "--data.init_args.batch_size", "2",
              "--data.init_args.max_seq_length", "32", cwd=work, env=clean)
    assert fit.stdout.strip().splitlines()[-1].startswith("fit finished at step 2"), fit.stdout[-2000:]
    assert (work / "runs" / "tiny" / "checkpoints" / "last.ckpt").is_file()
