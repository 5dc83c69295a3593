"""Fit the shipped recipes as a user runs them: the console script, one process per recipe, exit code checked.

Each row runs `lightning-ffpa fit --config configs/<recipe>.yaml` with only the overrides a one-GPU machine
needs (reduced depth for recipes that name more GPUs, a step count, a fresh run directory, a CSV logger to
read the numbers back). The row records the command, exit code, wall time, the last training loss and the
throughput and peak memory that `TokenThroughput` logged; the full log (torch DEBUG lines dropped) goes to
`--logs`. Rows are listed in `RECIPES`; `--only` picks some.

    python benchmarks/fit_recipes.py --only gemma4_ffpa_lora --logs $OUT/logs --out $OUT/recipes.json
"""

from __future__ import annotations

import argparse
import csv
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.report.results_io import write_result  # noqa: E402

LORA = "{r: 16, lora_alpha: 32, target_modules: [q_proj, k_proj, v_proj, o_proj]}"
ONE_GPU = ["--trainer.devices", "1", "--model.init_args.config_overrides", "{num_hidden_layers: 6}"]

# name -> (recipe, overrides beyond the run directory and logger)
RECIPES: dict[str, tuple[str, list[str]]] = {
    "gemma4_ffpa": ("gemma4_ffpa", [*ONE_GPU, "--trainer.max_steps", "12"]),
    "gemma4_ffpa_lora": ("gemma4_ffpa", [*ONE_GPU, "--trainer.max_steps", "12", "--model.init_args.lora", LORA]),
    "gemma4_grpo": ("gemma4_grpo", ["--trainer.max_steps", "10"]),
    # one H200 as shipped: all 30 layers, 8k, LoRA on attention, dense MLP and the expert stacks
    "gemma4_26b_a4b": ("gemma4_26b_a4b", ["--trainer.max_steps", "8", "--trainer.log_every_n_steps", "1"]),
    "tiny": ("tiny", ["--trainer.max_steps", "10", "--trainer.val_check_interval", "5"]),
    "tiny_fsdp2": ("tiny_fsdp2", ["--trainer.max_steps", "10"]),
    "tiny_grpo": ("tiny_grpo", ["--trainer.max_steps", "10"]),
}
_NOISE = ("DEBUG", "V1201", "I1201")  # torch/inductor debug chatter


def console_command() -> list[str]:
    """The installed console script: beside this Python (its venv's bin/), else on PATH."""
    beside = Path(sys.executable).parent / "lightning-ffpa"
    script = str(beside) if beside.exists() else shutil.which("lightning-ffpa")
    return [script] if script else [sys.executable, "-m", "lightning_ffpa.cli"]


def described(cmd: list[str]) -> dict[str, str]:
    """A row's `entry_point` (the installed `lightning-ffpa`, or the module it runs where an image has no console
    script) and its `command` after it."""
    entry = console_command()
    return {"entry_point": "lightning-ffpa" if len(entry) == 1 else "python -m lightning_ffpa.cli",
            "command": " ".join(cmd[len(entry):])}


def read_metrics(root: Path) -> dict[str, float]:
    """Last logged value of each metric in the CSV logger's file under `root`."""
    found = sorted(root.rglob("metrics.csv"))
    last: dict[str, float] = {}
    if not found:
        return last
    with open(found[-1]) as f:
        for row in csv.DictReader(f):
            for k, v in row.items():
                if v not in ("", None):
                    try:
                        last[k] = float(v)
                    except ValueError:
                        pass
    return last


def fit(name: str, logs: Path, timeout: float) -> dict:
    recipe, extra = RECIPES[name]
    root = Path(tempfile.mkdtemp(prefix=f"fit_{name}_"))
    cmd = [*console_command(), "fit", "--config", str(REPO / "configs" / f"{recipe}.yaml"), *extra,
           "--trainer.default_root_dir", str(root),
           "--trainer.logger", "lightning.pytorch.loggers.CSVLogger", "--trainer.logger.save_dir", str(root)]
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO,
                              env=dict(os.environ, PYTHONUNBUFFERED="1"))
        rc, out = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as err:
        rc, out = "timeout", (err.stdout or b"").decode(errors="replace") + (err.stderr or b"").decode(errors="replace")
    wall = round(time.monotonic() - t0, 1)
    lines = [ln for ln in out.splitlines() if not ln.startswith(_NOISE)]
    logs.mkdir(parents=True, exist_ok=True)
    (logs / f"fit_{name}.log").write_text(" ".join(cmd) + "\n" + "\n".join(lines) + "\n")
    metrics = read_metrics(root)
    shutil.rmtree(root, ignore_errors=True)
    # ThroughputMonitor logs tokens as `items` (TokenThroughput's length_fn counts tokens)
    keep = {k: v for k, v in metrics.items() if any(s in k for s in ("loss", "per_sec", "mfu", "memory", "step",
                                                                     "attention/", "reward", "rollout/"))}
    return {"row": name, "recipe": f"configs/{recipe}.yaml", **described(cmd), "exit_code": rc, "wall_s": wall,
            "last_line": lines[-1] if lines else "", "metrics": keep}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", nargs="*", default=list(RECIPES), choices=list(RECIPES))
    p.add_argument("--logs", default=str(REPO / "benchmarks" / "results" / "logs"))
    p.add_argument("--timeout", type=float, default=480)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    rows = []
    for name in args.only:  # rewritten after every row: a call cut short keeps the rows it finished
        rows.append(fit(name, Path(args.logs), args.timeout))
        print(f"{name}: exit {rows[-1]['exit_code']} in {rows[-1]['wall_s']} s", flush=True)
        write_result("fit_recipes", rows, summarize(rows, complete=len(rows) == len(args.only)), out=args.out)


def summarize(rows: list[dict], complete: bool) -> dict:
    summary: dict = {"complete": complete}
    summary.update({f"{r['row']}_exit_code": r["exit_code"] for r in rows})
    for r in rows:
        for k, v in r["metrics"].items():
            if "peak_memory" in k or "mfu" in k:
                summary[f"{r['row']}:{k}"] = v
            elif k.endswith("items_per_sec"):
                summary[f"{r['row']}:{k.replace('items_per_sec', 'tokens_per_sec')}"] = v
    return summary


if __name__ == "__main__":
    main()
