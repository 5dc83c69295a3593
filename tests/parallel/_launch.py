"""Run a test script under torchrun on CPU (gloo) and read back the JSON that rank 0 wrote."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def torchrun_json(script: Path, out: Path, nproc: int, port: int, *args: str, timeout: float = 200) -> dict:
    """`torchrun --nproc_per_node nproc script out *args`; fails the test with the stderr tail on error."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
           str(port), str(script), str(out), *map(str, args)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())
