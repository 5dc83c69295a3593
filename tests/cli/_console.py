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


# The preloader: one process imports the console scripts' modules once, then forks a child per command. The
# child runs the installed script file itself (`runpy`, as `__main__`, with the command's argv, cwd and
# captured stdout/stderr) and ends as the script does (its SystemExit code, atexit handlers, flushed
# streams); what differs from a fresh process is only that the imports were done before the fork. The imported
# objects are then frozen out of the cyclic GC (`gc.freeze`, as pre-forking servers do): the interpreter's
# collections at the child's exit would otherwise walk all ~440k of them, copying every page the fork shared
# (~1 s a row, most of a row's time).
_PRELOADER = r"""
import gc, json, os, runpy, sys, time
if sys.path and sys.path[0] == "":  # `python -c` puts the folder it runs from first; a console script does not
    sys.path.pop(0)
import lightning_ffpa.cli, lightning_ffpa.export, lightning_ffpa.lightning_cli
lightning_ffpa.lightning_cli.import_components()
gc.collect()
gc.freeze()
sys.stdout.write(json.dumps({"ready": True}) + "\n")
sys.stdout.flush()
for line in sys.stdin:
    job = json.loads(line)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: the command, then exit as the script does (the exception, if any, propagates)
        os.chdir(job["cwd"])
        for fd, path in ((1, job["stdout"]), (2, job["stderr"])):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
        sys.stdin.close()
        sys.argv = job["argv"]
        sys.path.insert(0, os.path.dirname(job["argv"][0]))  # as Python starts a script: its folder first
        runpy.run_path(job["argv"][0], run_name="__main__")
        sys.exit(0)
    deadline = time.monotonic() + job["timeout"]
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    timed_out = done[0] == 0
    if timed_out:  # past the timeout: kill it, as subprocess.run's timeout does
        os.kill(pid, 9)
        done = os.waitpid(pid, 0)
    sys.stdout.write(json.dumps({"returncode": os.waitstatus_to_exitcode(done[1]), "timed_out": timed_out}) + "\n")
    sys.stdout.flush()
"""


class Preloaded:
    """A preloader process (see `_PRELOADER`): `run(command, cwd)` gives what `run` gives for the same command.
    What the imports print goes to `import.err` (the console script imports the stack with its stderr held,
    so a rejected input drops it there too)."""

    def __init__(self, scratch: Path) -> None:
        """`scratch`: a folder for the captured stdout/stderr files."""
        self.scratch, self._n, self._ready = scratch, 0, False
        # started here, waited for at the first command: several preloaders import at the same time
        self.proc = subprocess.Popen([sys.executable, "-c", _PRELOADER], env=env(), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=open(scratch / "import.err", "w"), text=True)

    def _wait_ready(self) -> None:
        if not self._ready:
            ready = self.proc.stdout.readline()
            assert ready.strip() == '{"ready": true}', (ready, (self.scratch / "import.err").read_text()[-3000:])
            self._ready = True

    def run(self, command: str | list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
        """Run `command` (its first word is the script name) in `cwd` in a child forked from the preloader."""
        import json

        self._wait_ready()
        words = shlex.split(command) if isinstance(command, str) else list(command)
        argv = [console_script(words[0]), *words[1:]]
        self._n += 1
        out, err = self.scratch / f"{self._n}.out", self.scratch / f"{self._n}.err"
        self.proc.stdin.write(json.dumps({"argv": argv, "cwd": str(cwd), "stdout": str(out), "stderr": str(err),
                                          "timeout": timeout}) + "\n")
        self.proc.stdin.flush()
        reply = json.loads(self.proc.stdout.readline())
        if reply["timed_out"]:
            raise subprocess.TimeoutExpired(argv, timeout)
        return subprocess.CompletedProcess(argv, reply["returncode"], out.read_text(), err.read_text())

    def close(self) -> None:
        """End the preloader (it exits when its stdin closes)."""
        self.proc.stdin.close()
        self.proc.wait(timeout=60)
