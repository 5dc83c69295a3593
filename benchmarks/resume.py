"""Resume on the GPU: stop a fit mid-run (kill -9 and SIGTERM), resume from `last`, compare loss curves.

Runs the shipped `configs/gemma4_ffpa.yaml` through the installed `lightning-ffpa` console script at a
reduced-depth Gemma4-31B shape (one sliding and one full-attention layer at the real widths and head dims),
with full fine-tuning or LoRA. Rows, each its own process:
- `uninterrupted` twice: the run-to-run spread of the loss on this GPU (bf16 kernels are not bitwise
  deterministic);
- `kill9`: hangs before the optimizer step `--stop-at`, is killed with SIGKILL, then resumed from `last`;
- `sigterm`: the same stop with SIGTERM.
A resumed curve passes when each resumed step's loss is within the run-to-run spread of the same run: the
largest difference between curves no resume touched (the uninterrupted pair, and each stopped row's own
steps up to its checkpoint), or equal. The loss recorder is the hardening tests' `StepRecorder` (tests/hardening/_helpers.py).

    python benchmarks/resume.py --variant full --jobs 2 --out benchmarks/results/resume_full.json
The full fine-tune writes ~14 GiB per checkpoint (fp32 weights and AdamW states): one save (step 4) per run
keeps two runs side by side within a 64 GiB disk.
"""

from __future__ import annotations

import argparse
import copy
import math
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "hardening"))
sys.path.insert(0, str(REPO))

import _helpers as h  # noqa: E402

from benchmarks.report.results_io import resummarize, write_result  # noqa: E402

LORA = {"r": 16, "lora_alpha": 32, "target_modules": "all-linear"}


def fit_config(root: Path, log: Path, args, *, hang_at: int | None, checkpoints: bool, name: str) -> Path:
    """The shipped recipe with the benchmark's overrides (one GPU, reduced depth, short run), as `name`.yaml."""
    cfg = yaml.safe_load((REPO / "configs" / "gemma4_ffpa.yaml").read_text())
    t = cfg["trainer"]
    t.update(devices=1, max_steps=args.steps, default_root_dir=str(root), logger=False, log_every_n_steps=1,
             enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    t["strategy"]["init_args"]["compile"] = args.compile
    if args.smoke:  # the script's own CPU check: the tiny preset in fp32, same rows and comparisons
        t.update(accelerator="cpu")
        t["strategy"]["init_args"].update(param_dtype="fp32")
    kept = [c for c in t["callbacks"] if not c["class_path"].endswith(("ModelCheckpoint", "LearningRateMonitor"))]
    if checkpoints:
        kept.append({"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                     "init_args": {"dirpath": str(root / "ckpt"), "every_n_train_steps": args.every,
                                   "save_last": "link", "save_top_k": 1}})  # as the shipped recipe
    else:
        t["enable_checkpointing"] = False
    kept.append(h.recorder(log, hang_at=hang_at))
    t["callbacks"] = kept
    m = cfg["model"]["init_args"]
    m.update(warmup_steps=2, config_overrides={
        "num_hidden_layers": 2, "layer_types": ["sliding_attention", "full_attention"], "vocab_size": args.vocab})
    if args.variant == "lora":
        m["lora"] = dict(LORA)
        m["dtype"] = "float32" if args.smoke else "bfloat16"
    if args.smoke:
        m.update(preset="tiny", max_seq_length=args.seq)
    d = cfg["data"]["init_args"]
    d.update(seq_length=args.seq, num_samples=args.samples, vocab_size=args.vocab)
    return h.write_config(root / f"{name}.yaml", cfg)


def console(config: Path, *extra: str, log: Path) -> subprocess.Popen:
    script = shutil.which("lightning-ffpa") or str(Path(sys.executable).with_name("lightning-ffpa"))
    cmd = [script, "fit", "--config", str(config), *extra] if Path(script).exists() else \
        [sys.executable, "-m", "lightning_ffpa.cli", "fit", "--config", str(config), *extra]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=h.subprocess_env(), stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
    proc.log_path = log
    return proc


def keep(args, name: str) -> Path:
    """Where one process's output goes: `--logs` (kept after the run, so a failed row can be read)."""
    folder = Path(args.logs)
    folder.mkdir(parents=True, exist_ok=True)
    return folder / f"resume_{args.variant}_{name}.log"


def curve(log: Path) -> dict[int, float]:
    return {step: float.fromhex(loss) for step, (loss, _) in h.read_steps(log).items()}


def uninterrupted(work: Path, args, name: str) -> dict:
    root = work / name
    root.mkdir()
    log = root / "steps.log"
    t0 = time.monotonic()
    proc = console(fit_config(root, log, args, hang_at=None, checkpoints=False, name="fit"), log=keep(args, name))
    h.wait_ok(proc, timeout=args.timeout)
    return {"row": name, "curve": curve(log), "wall_s": round(time.monotonic() - t0, 1)}


def interrupted(work: Path, args, how: str) -> dict:
    root = work / how
    root.mkdir()
    log = root / "steps.log"
    config = fit_config(root, log, args, hang_at=args.stop_at, checkpoints=True, name="fit")
    proc = console(config, log=keep(args, how))
    try:
        h.wait_for_line(log, "hang", proc, timeout=args.timeout)
    except TimeoutError:
        h.kill9(proc)  # a run left alive keeps its checkpoints on the disk the next rows need
        raise
    if how == "kill9":
        rc = h.kill9(proc)
    else:
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=120)
    before = curve(log)
    last = sorted(p.name for p in (root / "ckpt").iterdir()) if (root / "ckpt").exists() else []
    # The same run without the planted hang (it would stop the resumed run at the same step again).
    config = fit_config(root, log, args, hang_at=None, checkpoints=True, name="resume")
    resume = console(config, "--ckpt_path", "last", log=keep(args, f"{how}_resume"))
    h.wait_ok(resume, timeout=args.timeout)
    after = curve(log)  # the recorder appends; resumed steps overwrite the stopped run's entries
    shutil.rmtree(root / "ckpt", ignore_errors=True)  # checkpoints are GBs: free the disk for the next row
    return {"row": how, "stop_rc": rc, "steps_before_stop": sorted(before), "checkpoints_seen": last,
            "curve": after}


def compare(ref: dict, other: dict, steps=None) -> float:
    steps = sorted(ref) if steps is None else steps
    missing = [s for s in steps if s not in other]
    assert not missing, f"missing steps: {missing}"
    return max((abs(ref[s] - other[s]) for s in steps), default=0.0)


def resumed_from(row: dict) -> int:
    """The step of the checkpoint `last` pointed at when the row was stopped (the resumed run starts after it)."""
    steps = [int(m.group(1)) for name in row["checkpoints_seen"] if (m := re.search(r"step=(\d+)", name))]
    return max(steps)


def summarize(rows: list[dict]) -> dict:
    """Resumed steps against the uninterrupted curve, judged by the run-to-run spread of this same run.

    The spread is the largest loss difference of steps computed without any resume: the repeated uninterrupted
    run, and each stopped row's steps up to its checkpoint (the same computation in another process). Two
    processes can pick different kernels (bf16 is not bitwise reproducible across processes), so a pair of
    uninterrupted runs alone can under-state it."""
    curves = {r["row"]: {int(k): v for k, v in r["curve"].items()} for r in rows}
    ref = curves["uninterrupted"]
    pair = compare(ref, curves["uninterrupted_repeat"])
    stopped = {r["row"]: resumed_from(r) for r in rows if "checkpoints_seen" in r}
    before = {name: compare(ref, curves[name], [s for s in sorted(ref) if s <= step])
              for name, step in stopped.items()}
    spread = max([pair, *before.values()])
    summary: dict = {"run_to_run_spread": spread, "uninterrupted_pair_max_abs_loss_diff": pair}
    for name, step in stopped.items():
        diff = compare(ref, curves[name], [s for s in sorted(ref) if s > step])
        summary[f"{name}_resumed_from_step"] = step
        summary[f"{name}_before_stop_max_abs_loss_diff"] = before[name]
        summary[f"{name}_max_abs_loss_diff"] = diff
        summary[f"{name}_within_spread"] = diff <= spread
        summary[f"{name}_bitwise"] = compare(ref, curves[name]) == 0.0
        # kernels can differ between processes: name any uninterrupted run the whole curve equals bit for bit
        summary[f"{name}_bitwise_equal_to"] = [u for u in ("uninterrupted", "uninterrupted_repeat")
                                               if compare(curves[u], curves[name]) == 0.0]
    summary["finite"] = all(math.isfinite(v) for c in curves.values() for v in c.values())
    return summary


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variant", choices=("full", "lora"), default="full")
    p.add_argument("--steps", type=int, default=7)
    p.add_argument("--every", type=int, default=4, help="checkpoint every N steps (full fine-tune: ~14 GiB each)")
    p.add_argument("--stop-at", type=int, default=5, help="hang before optimizer step N, then stop")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--samples", type=int, default=16, help="rows per epoch (batch 1)")
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--compile", action="store_true")
    p.add_argument("--timeout", type=float, default=400)
    p.add_argument("--logs", default=tempfile.gettempdir(), help="folder for each process's output")
    p.add_argument("--jobs", type=int, default=1,
                   help="rows run at once (each is its own process); each writes its own checkpoints, so free "
                        "disk must hold `jobs` runs' checkpoints (full fine-tune: fp32 weights and AdamW states)")
    p.add_argument("--smoke", action="store_true", help="CPU check of the script: tiny preset, fp32")
    p.add_argument("--out", default=None)
    p.add_argument("--summarize", default=None, metavar="PATH", help="only recompute the summary of a result file")
    args = p.parse_args(argv)
    if args.summarize:
        resummarize(args.summarize, summarize, by="resume.py --summarize")
        return
    with tempfile.TemporaryDirectory(prefix="resume_") as tmp:
        work = Path(tmp)
        # Rows are independent processes; --jobs runs them side by side (the spread is then measured under
        # the same sharing of the GPU as the resumed runs).
        jobs = [(uninterrupted, "uninterrupted"), (uninterrupted, "uninterrupted_repeat"),
                (interrupted, "kill9"), (interrupted, "sigterm")]
        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            rows = list(pool.map(lambda job: job[0](work, args, job[1]), jobs))
    summary = summarize(rows)
    config = {k: v for k, v in vars(args).items() if k != "out"}
    write_result(f"resume_{args.variant}", [copy.deepcopy(r) for r in rows], summary, out=args.out,
                 config=config, recipe="configs/gemma4_ffpa.yaml, 2 layers (1 sliding, 1 full) at 31B widths")


if __name__ == "__main__":
    from lightning_ffpa.errors import console_entry

    sys.exit(console_entry(main, hold=False))  # a bad option: exit 2 with one line, before any row runs
