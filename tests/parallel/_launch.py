"""Run a test script under torchrun on CPU (gloo) and read back the JSON that rank 0 wrote."""

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# A rank can abort in gloo's C++ teardown (rare: seen once in CI at the end of a two-rank FSDP2 GRPO fit, after
# `Trainer.fit` stopped; not reproduced in 16 local runs, 10 of them under CPU load).
TEARDOWN_ABORT = "terminate called without an active exception"


def torchrun_json(script: Path, out: Path, nproc: int, port: int, *args: str, timeout: float = 200) -> dict:
    """`torchrun --nproc_per_node nproc script out *args`; fails the test with the stderr tail on error.

    A run in which a rank aborted that way is run once more on another port, and the second run must succeed:
    a defect that aborts every time still fails the test."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])), OMP_NUM_THREADS="1")
    for attempt, master_port in enumerate((port, port + 1000)):
        out.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
               str(master_port), str(script), str(out), *map(str, args)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        if attempt == 0 and proc.returncode != 0 and TEARDOWN_ABORT in proc.stderr:
            warnings.warn(f"{script.name}: a rank aborted in gloo's teardown; running it again", stacklevel=2)
            continue
        assert proc.returncode == 0, proc.stderr[-4000:]
        return json.loads(out.read_text())
    raise AssertionError("unreachable")
