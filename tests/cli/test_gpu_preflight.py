"""GPU: the shipped GRPO recipe at full 31B depth on one GPU is refused by the console script in seconds.

The room check runs in the CLI's pre-flight, before any model exists: the policy's lower bound (its
parameters at model.dtype) and an 8192-page KV pool (86 GiB in the full layers alone) cannot share one H200, so
the command exits 2 naming `engine.num_pages` instead of loading 57 GiB of policy first.
"""

from __future__ import annotations

import os
import shutil
import time

import pytest
from _console import ROOT, env, run, snapshot

pytestmark = pytest.mark.gpu


@pytest.mark.timeout(300)
def test_full_depth_grpo_with_a_large_page_pool_exits_2_before_building_a_model(tmp_path):
    shutil.copy(ROOT / "configs" / "gemma4_grpo.yaml", tmp_path / "grpo.yaml")
    before = snapshot(tmp_path)
    gpu = {**env(), "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0")}
    start = time.monotonic()
    out = run(["lightning-ffpa", "fit", "--config", "grpo.yaml",
               "--trainer.callbacks.init_args.engine.num_pages", "8192"], cwd=tmp_path, env=gpu)
    seconds = time.monotonic() - start
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2, out.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith("error:") and "engine.num_pages" in lines[0], lines
    # seconds, not the minutes of building a 31B policy (imports and CUDA start-up dominate)
    assert seconds < 90, seconds
    assert snapshot(tmp_path) == before
