"""The full-depth GRPO step as a user runs it: `lightning-ffpa fit --config gemma4_grpo.yaml`, one process per
completion length, read back from the CSV logger.

Each row runs the shipped recipe through the console script with only the completion length (and the engine's
`max_seq_len` it needs) and the step count changed, and a CSV logger to read the numbers back. Per optimizer step it
records what the RolloutCallback and TokenThroughput log: refresh, generation and update seconds, completion
lengths, decode steps, peak memory allocated and reserved. The first step (CUDA graph capture and compile) is
reported but left out of the medians. The decode's fraction of the HBM roofline divides the bytes a decode step
must read (every weight once, the LoRA adapters, and each row's K/V: the last `window` tokens on sliding layers,
all of them on full layers) by the generation seconds per decode step (prefill included, so a lower bound) and the
bandwidth: the datasheet's (primary) and a device-to-device copy measured in this process before the rows. On a MoE
preset, `--count-routed` turns on the engine's routed-expert count (`engine.count_routed_experts`, logged per step as
`rollout/routed_expert_fraction`), and `decode_roofline_routed_datasheet` counts only that share of the expert bytes
(docs/rollout.md); the all-weights fraction stays beside it. The count runs inside the timed rollouts. A GPU
run times at least 3 steps per row (`--steps` >= 4: the first is not timed); the fraction is the median over them,
with its min and max.

The weights are counted as the fit stores them: the preset's model on meta, wrapped with the recipe's LoRA
(`configs/<recipe>.yaml` model.init_args.lora with the command's `--model.init_args.lora {...}` merged over it,
as jsonargparse merges it) and, with `--base-dtype fp8` (which adds `--model.init_args.lora '{r: R, base_dtype:
fp8}'` to the fit), its LoRA bases converted by `fp8_base.quantize_lora_bases`: a float8 base weight at one byte
and its fp32 rowwise scales at four (the engine reads them in place), every other weight, the LoRA A/B included,
at two (the bf16 engine). `--recount FILE --out NEW` recomputes a recorded file's byte count and every roofline
field from its rows' recorded step timings and bandwidth (no GPU), keeping the measured fields, and records
`recounted_from` (the measured file, its commit and why).

Each row also records `rollout/memory.py`'s estimate of its fit (`memory_estimate_gib` and its components, from the
recipe with the row's recorded command applied, `memory_recipe.recipe_estimate`) and its error against the measured
peak allocated, (estimate - measured) / measured; the summary has `grpo_full_depth_memory_estimate_gib_{L}` and
`grpo_full_depth_memory_estimate_rel_err_{L}`. A recount fills them too.

A row longer than one call (4096-token completions at full depth: a first step of capture and compile, then
minutes a step) runs in segments: `--run-dir DIR` keeps each row's run under DIR/grpo_<L>, whose recipe checkpoint
(`last.ckpt`, written as the fit ends) `--resume FILE` continues for `--steps` more through the console script's
`--ckpt_path`, on the same machine. The row keeps every segment's steps, command, exit code and log; the first step
of each segment (a fresh process captures and compiles again) is not timed.

    python benchmarks/grpo_full_depth.py --lengths 4096 --steps 3 --logs $OUT --out $OUT/grpo_full_depth.json
    python benchmarks/grpo_full_depth.py --lengths 4096 --steps 2 --run-dir /tmp/grpo --out $OUT/a.json
    python benchmarks/grpo_full_depth.py --lengths 4096 --steps 2 --run-dir /tmp/grpo --resume $OUT/a.json --out $OUT/b.json
    python benchmarks/grpo_full_depth.py --recount benchmarks/results/grpo_full_depth_fp8base_h100.json \
        --base-dtype fp8 --lengths 1024 --out /tmp/recount.json
"""

from __future__ import annotations

import argparse
import copy
import csv
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.fit_recipes import console_command, described  # noqa: E402
from benchmarks.report.results_io import read_result, write_result  # noqa: E402

_NOISE = ("DEBUG", "V1201", "I1201")
CB = "--trainer.callbacks.init_args."  # lands on the recipe's last callback, the RolloutCallback
LORA = "--model.init_args.lora"
LORA_OVERRIDE = re.compile(re.escape(LORA) + r" (\{[^}]*\})")  # a dict override, as a command records it
FP8_IN_COMMAND = re.compile(r"base_dtype\W+fp8")
RECIPE_IN_COMMAND = re.compile(r"--config \S*?(\w+)\.yaml")
RECOUNT_REASON = ("decode_bytes counts the weights as the fit stores them: a float8 LoRA base at one byte plus its "
                  "fp32 rowwise scales, not every weight at two bytes")


def read_steps(root: Path) -> list[dict[str, float]]:
    """One dict per logged training step (the CSV logger's rows merged by `step`), from the newest logger version
    under `root`: a resumed fit's own steps."""
    found = sorted(root.rglob("metrics.csv"), key=lambda f: f.stat().st_mtime)
    steps: dict[int, dict[str, float]] = {}
    if not found:
        return []
    with open(found[-1]) as f:
        for row in csv.DictReader(f):
            if not row.get("step"):
                continue
            step = steps.setdefault(int(float(row["step"])), {})
            for k, v in row.items():
                try:
                    step[k] = float(v)
                except (TypeError, ValueError):
                    pass
    return [steps[k] for k in sorted(steps)]


def page_multiple(n: int, page: int) -> int:
    return -(-n // page) * page


def fit_overrides(args: argparse.Namespace) -> list[str]:
    """The console overrides after the script's own: `--base-dtype fp8`'s LoRA override, then `--extra`."""
    fp8 = [LORA, f"{{r: {args.lora_r}, base_dtype: fp8}}"] if args.base_dtype == "fp8" else []
    return [*fp8, *args.extra]


def fit_lora(recipe: str, command: str) -> dict[str, Any] | None:
    """The LoRA options a fit of `recipe` resolves: the YAML's model.init_args.lora with each `--model.init_args.lora
    {...}` of `command` merged over it key by key, as jsonargparse merges a dict override (target_modules kept)."""
    import yaml

    cfg = yaml.safe_load((REPO / "configs" / f"{recipe}.yaml").read_text())
    lora = ((cfg.get("model") or {}).get("init_args") or {}).get("lora")
    for found in LORA_OVERRIDE.finditer(command):
        lora = {**(lora or {}), **yaml.safe_load(found.group(1))}
    return lora


def check_lora_r(lora: dict[str, Any] | None, lora_r: int, recipe: str) -> None:
    """`--lora-r` must be the rank the fit trains (the count's adapters are the fit's)."""
    from lightning_ffpa.errors import ConfigError

    if lora is not None and lora.get("r") != lora_r:
        raise ConfigError("--lora-r", lora_r, f"the fit's LoRA has r={lora.get('r')} (configs/{recipe}.yaml and the "
                                              f"{LORA} overrides); pass --lora-r {lora.get('r')}")


def fit_row(length: int, args: argparse.Namespace, prev: dict[str, Any] | None = None) -> dict[str, Any]:
    """Fit the recipe with completions of `length` tokens; the row's command, exit code, log and steps. With `prev`
    (a row of `--resume`), continue its run from its checkpoint for `--steps` more: one more segment of that row."""
    if args.run_dir:
        root = Path(args.run_dir) / f"grpo_{length}"
        root.mkdir(parents=True, exist_ok=True)
    else:
        root = Path(tempfile.mkdtemp(prefix=f"grpo_{length}_"))
    done = prev["max_steps"] if prev else 0
    max_seq = page_multiple(args.prompt_len + length, args.page_size)
    cmd = [*console_command(), "fit", "--config", str(REPO / "configs" / f"{args.recipe}.yaml"),
           "--trainer.max_steps", str(done + args.steps), "--trainer.default_root_dir", str(root),
           "--trainer.logger", "lightning.pytorch.loggers.CSVLogger", "--trainer.logger.save_dir", str(root),
           "--trainer.logger.flush_logs_every_n_steps", "1",  # a row cut short keeps the steps it finished
           f"{CB}sampling.max_new_tokens", str(length), f"{CB}engine.max_seq_len", str(max_seq),
           *([f"{CB}engine.count_routed_experts", "true"] if args.count_routed else []), *fit_overrides(args),
           *(["--ckpt_path", prev["checkpoint"]] if prev else [])]
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, cwd=REPO,
                              env=dict(os.environ, PYTHONUNBUFFERED="1"))
        rc, out = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as err:
        rc = "timeout"
        out = (err.stdout or b"").decode(errors="replace") + (err.stderr or b"").decode(errors="replace")
    wall = round(time.monotonic() - t0, 1)
    lines = [ln for ln in out.splitlines() if not ln.startswith(_NOISE)]
    part = len(prev["segments"]) + 1 if prev else 1
    log = Path(args.logs) / (f"grpo_full_depth_{length}.log" if part == 1 else f"grpo_full_depth_{length}_{part}.log")
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text(" ".join(cmd) + "\n" + "\n".join(lines) + "\n")
    steps = read_steps(root)
    segment = {**described(cmd), "exit_code": rc, "wall_s": wall, "last_line": lines[-1] if lines else "",
               "log": log.name, "steps": len(steps), "out_of_memory": "out of memory" in out.lower()}
    segments = [*(prev["segments"] if prev else []), segment]
    return {"name": f"ours_grpo_{length}", "completion_len": length, "prompt_len": args.prompt_len,
            "base_dtype": args.base_dtype, **{k: segment[k] for k in ("entry_point", "command", "exit_code")},
            "wall_s": round(sum(g["wall_s"] for g in segments), 1), "last_line": segment["last_line"],
            "log": segments[0]["log"], "max_steps": done + args.steps, "checkpoint": last_checkpoint(root, rc),
            "segments": segments, "steps": [*(prev["steps"] if prev else []), *steps]}


def fits(row: dict[str, Any]) -> bool | None:
    """True where the fit ran to its end, or was cut by the row's timeout after a step past the first (the peak is
    the steady state's); False where it ran out of memory; None where it stopped otherwise (not a memory verdict:
    a timeout was once recorded as "does not fit" at 68.9 of 80 GB)."""
    segments = row.get("segments") or []
    if any(g.get("out_of_memory") for g in segments):
        return False
    if row["exit_code"] == 0:
        return True
    return True if row["exit_code"] == "timeout" and len(row.get("steps") or []) >= 2 else None


def last_checkpoint(root: Path, rc: Any) -> str | None:
    """The recipe's `last.ckpt` a finished fit under `root` wrote (a fit cut short saves none to continue from)."""
    found = sorted(root.rglob("last.ckpt"), key=lambda f: f.stat().st_mtime)
    return str(found[-1]) if rc == 0 and found else None


def timed_steps(row: dict[str, Any]) -> list[dict[str, float]]:
    """The row's steps less the first of each segment (a fresh process captures the decode graphs and compiles)."""
    counts = [g["steps"] for g in row.get("segments") or [{"steps": len(row["steps"])}]]
    timed, at = [], 0
    for n in counts:
        timed += row["steps"][at + 1:at + n]
        at += n
    return timed


def _stat(values: list[float]) -> dict[str, float] | None:
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "n": len(values)} if values else None


def decode_bytes(prompt_len: int, length: int, seqs: int, preset: str, layers: int | None,
                 lora: dict[str, Any] | None, routed_fraction: float | None = None) -> float:
    """Bytes one decode step must read, averaged over the completion's positions: every weight once as the fit
    stores it (the embedding as the head's matrix; `lora`, the fit's LoRA options, adds the adapters and, with
    `base_dtype: fp8`, stores the targets' bases in float8), and each row's K/V within its layers' reach. With
    `routed_fraction` (a MoE model), only that share of the expert weights."""
    from lightning_ffpa.lora import unwrap_peft
    from lightning_ffpa.rollout.kv_cache import token_bytes
    from lightning_ffpa.rollout.memory import lora_meta_model, stored_weight_bytes
    from lightning_ffpa.rollout.routing import moe_layers
    from lightning_ffpa.rollout.walker import DecoderWalker

    model = lora_meta_model(preset, layers, lora)  # the fit's LoRA, and (fp8) the bases as HFModule stores them
    weights = float(stored_weight_bytes(model))
    base = unwrap_peft(model)
    if routed_fraction is not None:
        experts = sum(p.numel() for _, _, e in moe_layers(base) for p in e.parameters() if p.dim() == 3) * 2
        weights -= (1 - routed_fraction) * experts
    kv = 0.0
    for spec in DecoderWalker(base).specs:
        per_tok = token_bytes([spec], 2)
        for p in range(prompt_len, prompt_len + length):
            kv += per_tok * (p + 1 if spec.window is None else min(p + 1, spec.window))
    return weights + seqs * kv / length


def estimate_overrides(args: argparse.Namespace) -> list[str]:
    """What this script's options say the fit ran (preset, depth, prompt length, prompts, group), as console words
    that go before a row's own recorded command (whose words win)."""
    words = ["--model.init_args.preset", args.preset, "--data.init_args.prompt_len", str(args.prompt_len),
             "--data.init_args.batch_size", str(args.prompts), f"{CB}num_generations", str(args.group)]
    if args.layers is not None:
        words += ["--model.init_args.config_overrides", f"{{num_hidden_layers: {args.layers}}}"]
    return words


def memory_estimate(row: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """`rollout/memory.py`'s estimate of the row's fit (the recipe with the row's command applied), its components
    in GiB and its error against the measured peak allocated: (estimate - measured) / measured. A fit the estimate
    does not cover (no LoRA) records why in `memory_estimate_error`."""
    from lightning_ffpa.errors import ConfigError
    from lightning_ffpa.rollout.memory import GIB
    from lightning_ffpa.rollout.memory_recipe import recipe_estimate, split_command

    words = [*estimate_overrides(args), *split_command(row.get("command", ""))]
    try:
        est = recipe_estimate(REPO / "configs" / f"{args.recipe}.yaml", words)
    except ConfigError as err:
        return {"memory_estimate_error": str(err)}
    total, peak = est.total / GIB, row.get("peak_mem_gib")
    return {"memory_estimate_gib": total,
            "memory_estimate_components_gib": {k: v / GIB for k, v in est.components().items()},
            "memory_estimate_caveats": list(est.caveats),
            "memory_estimate_rel_err": (total - peak) / peak if peak else None}


def summarize(rows: list[dict[str, Any]], bandwidth: dict[str, Any] | None, args: argparse.Namespace) -> dict:
    out: dict[str, Any] = {"complete": {r["completion_len"] for r in rows} >= set(args.lengths)}
    for r in rows:
        L = r["completion_len"]
        timed = timed_steps(r)  # the first step of each call captures and compiles the decode graphs
        step_s = [s["rollout/refresh_s"] + s["rollout/generate_s"] + s["rollout/update_s"] for s in timed
                  if {"rollout/refresh_s", "rollout/generate_s", "rollout/update_s"} <= s.keys()]
        r["step_s"] = _stat(step_s)
        for key in ("rollout/refresh_s", "rollout/generate_s", "rollout/update_s"):
            r[key.split("/")[1]] = _stat([s[key] for s in timed if key in s])
        peak = [s.get("device/peak_memory_gb") for s in r["steps"] if "device/peak_memory_gb" in s]
        reserved = [s.get("device/peak_reserved_gb") for s in r["steps"] if "device/peak_reserved_gb" in s]
        r["peak_mem_gib"] = max(peak) if peak else None
        r["peak_reserved_gib"] = max(reserved) if reserved else None
        r.update(memory_estimate(r, args))
        out[f"grpo_full_depth_memory_estimate_gib_{L}"] = r.get("memory_estimate_gib")
        out[f"grpo_full_depth_memory_estimate_rel_err_{L}"] = r.get("memory_estimate_rel_err")
        seqs = args.prompts * args.group
        tokens = [s["rollout/completion_length"] * seqs for s in timed if "rollout/completion_length" in s]
        if step_s and tokens:
            r["completion_tokens_per_s"] = statistics.median(t / s for t, s in zip(tokens, step_s))
        out[f"grpo_full_depth_fits_{L}"] = fits(r)
        out[f"grpo_full_depth_step_s_{L}"] = r["step_s"]["median"] if r["step_s"] else None
        out[f"grpo_full_depth_timed_steps_{L}"] = len(step_s)
        out[f"grpo_full_depth_peak_mem_gib_{L}"] = r["peak_mem_gib"]
        out[f"grpo_full_depth_peak_reserved_gib_{L}"] = r["peak_reserved_gib"]
        decode = [s["rollout/generate_s"] / s["rollout/decode_steps"] for s in timed
                  if s.get("rollout/decode_steps")]
        if decode and bandwidth:
            need = decode_bytes(args.prompt_len, L, seqs, args.preset, args.layers, args.lora)
            per_step = statistics.median(decode)
            r["decode_bytes_per_step"], r["decode_s_per_step_upper"] = need, per_step
            r["decode_timed_samples"] = len(decode)
            if bandwidth.get("datasheet_bytes_per_s"):
                r["decode_roofline_datasheet"] = need / per_step / bandwidth["datasheet_bytes_per_s"]
                r["decode_roofline_datasheet_min"] = need / max(decode) / bandwidth["datasheet_bytes_per_s"]
                r["decode_roofline_datasheet_max"] = need / min(decode) / bandwidth["datasheet_bytes_per_s"]
            r["decode_roofline_copy_bw"] = need / per_step / bandwidth["copy_bytes_per_s"]
            out[f"grpo_full_depth_decode_roofline_datasheet_bs{seqs}_{L}"] = r.get("decode_roofline_datasheet")
            routed = [s["rollout/routed_expert_fraction"] for s in timed if "rollout/routed_expert_fraction" in s]
            if routed and bandwidth.get("datasheet_bytes_per_s"):  # `--count-routed` on a MoE preset
                r["routed_expert_fraction"] = statistics.median(routed)
                need = decode_bytes(args.prompt_len, L, seqs, args.preset, args.layers, args.lora,
                                    r["routed_expert_fraction"])
                r["decode_bytes_per_step_routed"] = need
                r["decode_roofline_routed_datasheet"] = need / per_step / bandwidth["datasheet_bytes_per_s"]
                out[f"grpo_full_depth_decode_routed_roofline_datasheet_bs{seqs}_{L}"] = \
                    r["decode_roofline_routed_datasheet"]
    measured = [r for r in rows if r.get("decode_roofline_datasheet") is not None]
    if measured:  # the batch's headline: its longest completions, where steady decode dominates the rollout
        out[f"grpo_full_depth_decode_roofline_datasheet_bs{args.prompts * args.group}"] = max(
            measured, key=lambda r: r["completion_len"])["decode_roofline_datasheet"]
    return out


MIN_TIMED_STEPS = 3  # timed samples per row on a GPU (median, min and max)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 4096])
    p.add_argument("--steps", type=int, default=6, help="optimizer steps per row (the first is not timed)")
    p.add_argument("--recipe", default="gemma4_grpo")
    p.add_argument("--preset", default="gemma4-31b")
    p.add_argument("--layers", type=int, default=None, help="the recipe's depth (None: the preset's)")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--prompts", type=int, default=2, help="the recipe's data.batch_size")
    p.add_argument("--group", type=int, default=8, help="the recipe's num_generations")
    p.add_argument("--lora-r", type=int, default=16, help="the fit's LoRA rank (checked against the recipe's)")
    p.add_argument("--base-dtype", choices=("model", "fp8"), default="model",
                   help="fp8: the fit stores the LoRA bases in float8 (lora.base_dtype), and the count follows")
    p.add_argument("--recount", default=None, metavar="FILE",
                   help="recount a recorded result file's decode bytes and roofline fractions (no fit); needs --out")
    p.add_argument("--reason", default=RECOUNT_REASON, help="--recount: why, recorded in recounted_from")
    p.add_argument("--page-size", type=int, default=128)
    p.add_argument("--count-routed", action="store_true",
                   help="MoE preset: count the routed experts (engine.count_routed_experts) for the routed roofline")
    p.add_argument("--timeout", type=float, default=540)
    p.add_argument("--run-dir", default=None, metavar="DIR",
                   help="keep each row's run under DIR/grpo_<L> (its checkpoint) for a later call's --resume")
    p.add_argument("--resume", default=None, metavar="FILE",
                   help="continue FILE's rows of --lengths from their checkpoints for --steps more (needs --run-dir)")
    p.add_argument("--logs", default=str(REPO / "benchmarks" / "results" / "logs"))
    p.add_argument("--out", default=None)
    p.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more console overrides, last")
    args = p.parse_args(argv)
    import torch

    from lightning_ffpa.errors import ConfigError

    said = [a for a in args.extra if "base_dtype" in a]
    if said:  # one place says it: the fit's override and the count both follow --base-dtype
        raise ConfigError("--extra", " ".join(said), "sets base_dtype; use --base-dtype (the byte count follows it)")
    if args.recount:
        if not args.out:
            raise ConfigError("--out", None, "--recount writes a new file; name it (the measured file stays)")
        return args
    args.lora = fit_lora(args.recipe, " ".join(fit_overrides(args)))
    check_lora_r(args.lora, args.lora_r, args.recipe)
    if torch.cuda.is_available() and args.steps < MIN_TIMED_STEPS + 1 and not args.run_dir:
        raise ConfigError("--steps", args.steps, f"a GPU run times at least {MIN_TIMED_STEPS} steps per row after "
                                                 "the first (capture and compile), so it needs at least "
                                                 f"{MIN_TIMED_STEPS + 1} (or --run-dir, and --resume in later calls)")
    args.continued = resumed_rows(args)
    return args


def resumed_rows(args: argparse.Namespace) -> dict[int, dict[str, Any]]:
    """`--resume`'s rows by completion length, each checked continuable; without `--resume`, a `--run-dir` that
    already holds a row's run is refused (its checkpoint would be mixed in). Both before any fit runs."""
    from lightning_ffpa.errors import ConfigError

    if args.resume is None:
        for length in args.lengths if args.run_dir else ():
            kept = Path(args.run_dir) / f"grpo_{length}"
            if kept.is_dir() and any(kept.iterdir()):
                raise ConfigError("--run-dir", args.run_dir, f"already holds a run of {length}-token completions; "
                                                             "--resume its result file, or name another directory")
        return {}
    if not args.run_dir:
        raise ConfigError("--resume", args.resume, "continues runs kept under --run-dir; name it")
    record = read_result(args.resume, "--resume")
    if record["benchmark"] != "grpo_full_depth":
        raise ConfigError("--resume", args.resume, f"holds {record['benchmark']!r} rows, not grpo_full_depth's")
    rows = {r["completion_len"]: r for r in record["rows"]}
    for length in args.lengths:
        row = rows.get(length)
        if row is None or not row.get("checkpoint") or not Path(row["checkpoint"]).is_file():
            why = "has no row of them" if row is None else f"names no checkpoint left to continue ({row.get('checkpoint')})"
            raise ConfigError("--resume", args.resume, f"{why} for {length}-token completions; run them without "
                                                       "--resume first (with --run-dir), on this machine")
    return rows


ROOFLINE_ROW_KEYS = ("decode_bytes_per_step", "decode_s_per_step_upper", "decode_timed_samples",
                     "decode_roofline_datasheet", "decode_roofline_datasheet_min", "decode_roofline_datasheet_max",
                     "decode_roofline_copy_bw", "routed_expert_fraction", "decode_bytes_per_step_routed",
                     "decode_roofline_routed_datasheet")
MEMORY_ROW_KEYS = ("memory_estimate_gib", "memory_estimate_components_gib", "memory_estimate_caveats",
                   "memory_estimate_rel_err", "memory_estimate_error")
RECOUNTED_ROW_KEYS = (*ROOFLINE_ROW_KEYS, *MEMORY_ROW_KEYS)
"""What `summarize` derives from the byte count and the rows' decode timings, and the memory estimate beside the
measured peak; a recount rewrites only these."""
RECOUNTED_SUMMARY = ("_decode_", "_memory_estimate_")


def recount(args: argparse.Namespace) -> Path:
    """Rewrite `args.recount`'s roofline fields with today's byte count into `args.out`, from the rows' recorded
    steps and the recorded bandwidth; every measured field stays as recorded."""
    from lightning_ffpa.errors import ConfigError

    record = read_result(args.recount, "--recount")
    if record["benchmark"] != "grpo_full_depth":
        raise ConfigError("--recount", args.recount, f"holds {record['benchmark']!r} rows, not grpo_full_depth's")
    bandwidth = record["summary"].get("bandwidth")
    if not bandwidth:
        raise ConfigError("--recount", args.recount, "records no bandwidth (a CPU run): no roofline to recount")
    lora = []
    for row in record["rows"]:
        command = row.get("command", "")
        fp8 = bool(FP8_IN_COMMAND.search(command))
        if fp8 != (args.base_dtype == "fp8"):
            raise ConfigError("--base-dtype", args.base_dtype, f"row {row.get('name')} ran "
                              f"{'with' if fp8 else 'without'} base_dtype: fp8 (its recorded command)")
        recipe = RECIPE_IN_COMMAND.search(command)
        if recipe is None or recipe.group(1) != args.recipe:
            raise ConfigError("--recipe", args.recipe, f"row {row.get('name')} ran "
                              f"{recipe.group(1) if recipe else 'no recipe'} (its recorded command)")
        if row.get("prompt_len") != args.prompt_len:
            raise ConfigError("--prompt-len", args.prompt_len, f"row {row.get('name')} ran {row.get('prompt_len')}")
        lora.append(fit_lora(args.recipe, command))
        check_lora_r(lora[-1], args.lora_r, args.recipe)
    if any(x != lora[0] for x in lora):
        raise ConfigError("--recount", args.recount, "its rows ran different LoRA options: recount them apart")
    args.lora = lora[0] if lora else None
    rows = record["rows"]
    fresh = copy.deepcopy(rows)
    counted = summarize(fresh, bandwidth, args)
    for row, new in zip(rows, fresh):
        for key in RECOUNTED_ROW_KEYS:
            row.pop(key, None)
            if key in new:
                row[key] = new[key]
        row["base_dtype"] = args.base_dtype
    def recounted(key: str) -> bool:
        return any(part in key for part in RECOUNTED_SUMMARY)

    summary = {k: counted.get(k, v) for k, v in record["summary"].items() if not recounted(k) or k in counted}
    summary.update({k: v for k, v in counted.items() if recounted(k)})  # in place where the keys stay
    measured = {k: v for k, v in record.items() if k not in ("benchmark", "command", "commit", "tree", "rows",
                                                             "summary", "recounted_from")}
    source = {"file": Path(args.recount).name, "commit": record.get("commit"), "command": record.get("command"),
              "reason": args.reason}
    if record.get("recounted_from"):  # a recount of a recount: the measurement stays reachable
        source["recounted_from"] = record["recounted_from"]
    return write_result("grpo_full_depth", rows, summary, out=args.out, **measured, recounted_from=source)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.recount:
        recount(args)
        return
    bandwidth = None
    import torch

    if torch.cuda.is_available():
        from benchmarks.rollout_rows import bandwidths

        bandwidth = bandwidths("cuda", 4.0)
        torch.cuda.empty_cache()
    kept = [r for L, r in args.continued.items() if L not in args.lengths]  # --resume's other rows stay as were
    rows: list[dict[str, Any]] = list(kept)
    for length in args.lengths:  # rewritten after every row: a call cut short keeps the rows it finished
        rows.append(fit_row(length, args, args.continued.get(length)))
        print(f"completions {length}: exit {rows[-1]['exit_code']} in {rows[-1]['wall_s']} s", flush=True)
        summary = summarize(rows, bandwidth, args)
        summary["bandwidth"] = bandwidth
        write_result("grpo_full_depth", rows, summary, out=args.out)


if __name__ == "__main__":
    from lightning_ffpa.errors import console_entry

    sys.exit(console_entry(main, hold=False))  # a bad option: exit 2 with one line, before any row runs
