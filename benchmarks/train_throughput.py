"""End-to-end training throughput of a Gemma4-31B-shaped slice: ours against same-recipe baselines and peers.

Owns the run: one process per (row, seq), so no memory or compiled code is carried between rows; per-row
timeouts and a total `--budget-s`; the result file, rewritten after every row (a run cut short keeps its
finished rows); the Flex option sweep; the summary. The rows themselves (what each one is, how it is
built and timed) live in `benchmarks/train_rows.py`.

Default rows, each at 8k, 16k and 32k (6 layers: 5 sliding + 1 full):
  sdpa_defaults  HF SDPA, full AC, no compile, HF loss, foreach AdamW (a default Lightning + HF user)
  sdpa_recipe    sdpa_defaults with ours' recipe: selective AC, per-layer compile, chunked loss, fused AdamW
  flex_recipe    sdpa_recipe with Flex for all layers; its D=512 kernel options are the fastest of an op-level
                 sweep over LARGE_HEAD_DIM_CANDIDATES (forward + backward of the full-attention op at the row's
                 seq), run first in the row's own process and recorded in the row (`flex_sweep`)
  liger_recipe   sdpa_recipe with liger-kernel's Gemma4 patches in place of our chunked loss; with
                 `liger_recipe_nocompile` beside it, the faster of the two is the Liger baseline (`liger_baseline`)
  ours           the ffpa backend with the product defaults except the sliding layers, pinned to block-sparse
                 Flex (`sliding: flex`; the default `auto` takes FA4 where it runs: `ours_fa4_sliding`)
  ours_sdpa_d512 ours with SDPA (as sdpa_recipe calls it) in place of FFPA on the D=512 layers; the sliding layers
                 keep the product's block-sparse Flex path. It splits ours' gain over sdpa_recipe by kernel:
                 ours / ours_sdpa_d512 is FFPA's share (`ours_vs_ours_sdpa_d512_tps_*`), ours_sdpa_d512 /
                 sdpa_recipe the sliding path's (`ours_sdpa_d512_vs_sdpa_recipe_tps_*`)
Ablations (ours_nocompile, ffpa_defaults, seed_gqa, ...) run when named in --rows; among them ours_fa4_sliding
(ours with the sliding layers on FA4, the backend's sliding='fa4': a row where FA4 cannot run, or whose calls fell
back to Flex, is an error), compared with ours in `sliding_path_step_gain_*` (its tokens/s over ours'); and
ours_fp8_rowwise / ours_fp8_tensorwise (ours with only FSDP2Strategy's `fp8` option changed: torchao float8 linear
layers in the decoder, lm_head and embeddings bf16; a row without FP8 hardware or torchao, or that converted no
module, is an error), whose faster one gives `fp8_full_ft_vs_bf16_tps_*` (its tokens/s over ours'),
`fp8_full_ft_recipe_*`, both rows' peak memory (`fp8_full_ft_peak_mem_gb_*`, `ours_peak_mem_gb_*`) and
`ours_mfu_bf16eq_spec_*` (its MFU with the bf16 rows' FLOP count, of the datasheet bf16 peak):
  python benchmarks/train_throughput.py --rows ours ours_fp8_rowwise ours_fp8_tensorwise --seqs 16384 ...
MFU is given against the datasheet bf16 peak (`mfu_spec`) and a measured 8192^3 matmul (`mfu_measured_peak`).

Run (one H200):  python benchmarks/train_throughput.py --out $OUT/train_throughput.json --budget-s 520
Rows run seq-major (all of 8k first); a (row, seq) is killed after --row-timeout-s or when --budget-s runs
out, so a call ends within its budget. Split across calls: --rows/--seqs pick a part, and --resume FILE (an earlier call's
result) keeps FILE's finished rows, refusing another commit or shape, and runs only what is missing; the
result lists every call in `calls`. Per-row logs: <out stem>_logs/; a killed row's log ends with its Python
stacks, and LIGHTNING_FFPA_BENCH_STACKS_EVERY_S=N adds them every N seconds (where a slow row spends its time). CPU smoke:
  python benchmarks/train_throughput.py --cpu --preset tiny --layers 2 --seqs 128 --warmup 1 --steps 1 \
      --rows sdpa_defaults ours_nocompile
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.report import results_io  # noqa: E402
from benchmarks.report.results_io import RESULTS_DIR, write_result  # noqa: E402
from benchmarks.row_process import (  # noqa: E402
    MIN_ROW_S,
    add_run_options,
    dump_stacks_on_signal,
    fastest_row,
    kill_row,
    progress_tail,
    row_at,
)
from benchmarks.train_rows import DEFAULT_ROWS, FP8_ROWS, PRODUCT_SAVE_MM, ROWS  # noqa: E402
from lightning_ffpa.errors import ConfigError  # noqa: E402

LIGER_ROWS = ("liger_recipe", "liger_recipe_nocompile")  # the faster one is the Liger baseline
_SHAPE_KEYS = ("preset", "layers", "warmup", "steps", "dp")  # a resumed file must match these and the commit
_SEQ_KEYS = {8192: "8k", 16384: "16k", 32768: "32k"}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(RESULTS_DIR / "train_throughput.json"), help="result JSON path")
    p.add_argument("--seqs", type=int, nargs="+", default=[8192, 16384, 32768])
    p.add_argument("--rows", nargs="+", default=DEFAULT_ROWS, choices=list(ROWS))
    p.add_argument("--layers", type=int, default=6, help="the last one full attention, the others sliding")
    add_run_options(p, budget_s=520.0, row_timeout_s=300.0)
    p.add_argument("--dp", type=int, default=1, help="data-parallel GPUs per row (each row runs under torchrun)")
    p.add_argument("--preset", default="gemma4-31b", help="presets.py shape; 'tiny' with --cpu for a smoke run")
    p.add_argument("--cpu", action="store_true", help="smoke-run on CPU (gloo, no timing claims)")
    p.add_argument("--profile", nargs="*", default=None, choices=list(ROWS), metavar="ROW",
                   help="profile one extra step (top kernels) of the named rows; no name: every row")
    # One (row, seq) in this process: the driver's child.
    p.add_argument("--one", default=None, choices=list(ROWS), help=argparse.SUPPRESS)
    p.add_argument("--seq", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--part-out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if not args.cpu and args.steps < 5:
        raise ConfigError("--steps", args.steps, "a GPU run times at least 5 steps (median, min and max)")
    if args.layers < 2:
        raise ConfigError("--layers", args.layers, "needs at least one sliding and one full-attention layer")
    return args


# ----------------------------------------------------------------------------- child: one (row, seq)
def run_one(args) -> None:
    import torch

    from benchmarks.train_rows import measure_row
    from lightning_ffpa._compat import torch as torch_compat
    from lightning_ffpa.parallel.dims import ParallelDims

    dump_stacks_on_signal()
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if args.cpu:
        device = torch.device("cpu")
        torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    else:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        torch.distributed.init_process_group("nccl", rank=rank, world_size=world, device_id=device)
    mesh = ParallelDims(world).build_mesh(device.type)  # the strategy's mesh
    torch_compat.raise_recompile_limit(64)
    row = measure_row(args.one, args.seq, args, mesh, device, rank)
    if rank == 0:
        Path(args.part_out).write_text(json.dumps(row, default=str))
    torch.distributed.destroy_process_group()


# ----------------------------------------------------------------------------- driver
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def profiled(args, name: str) -> bool:
    """Whether `--profile` asks for a profiled extra step of row `name`."""
    return args.profile is not None and (not args.profile or name in args.profile)


def launch(args, name: str, seq: int, logs: Path, timeout: float) -> dict:
    """Run one (row, seq) in a fresh process (torchrun for --dp > 1); its record, or why it has none."""
    part, log = logs / f"{name}_{seq}.json", logs / f"{name}_{seq}.log"
    for again in range(1, 100):  # a re-run keeps the earlier attempt's log (a killed row's only record)
        if not log.exists():
            break
        log = logs / f"{name}_{seq}.{again}.log"
    part.unlink(missing_ok=True)
    port = _free_port()
    script = [str(Path(__file__).resolve()), "--one", name, "--seq", str(seq), "--part-out", str(part),
              "--layers", str(args.layers), "--warmup", str(args.warmup), "--steps", str(args.steps),
              "--preset", args.preset, "--dp", str(args.dp), *(["--cpu"] if args.cpu else []),
              *(["--profile"] if profiled(args, name) else [])]
    launcher = [sys.executable]
    if args.dp > 1:
        launcher += ["-m", "torch.distributed.run", "--nproc_per_node", str(args.dp), "--master_port", str(port)]
    env = dict(os.environ, MASTER_PORT=str(port))
    t0 = time.perf_counter()
    with open(log, "w") as out:
        # Own session: a timeout kills the whole group (torchrun's workers, inductor's compile workers).
        proc = subprocess.Popen([*launcher, *script], stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_row(proc)
            proc.wait()
            rc = None
    wall = time.perf_counter() - t0
    if part.exists():
        row = json.loads(part.read_text())
    else:
        tail = progress_tail(log.read_text(errors="replace"), 12)
        why = (f"killed after the row timeout of {timeout:.0f} s (the log ends with its Python stacks then)"
               if rc is None else f"process exit {rc}")
        row = dict(row=name, seq=seq, **ROWS[name], error=f"{why}; log tail: " + " | ".join(tail)[-1200:])
    row.update(wall_s=round(wall, 1), log=log.name)
    return row


def plan(args, finished: set[tuple[str, int]]) -> list[tuple[str, int]]:
    """(row, seq) pairs to run, seq-major, leaving out those already finished."""
    return [(name, seq) for seq in args.seqs for name in args.rows if (name, seq) not in finished]


def summarize(rows: list[dict]) -> tuple[dict, dict]:
    """The summary keys, and for each null one the reason."""
    summary, missing = {}, {}

    def ratio(key, ours, baseline):  # each a (row or None, why) pair
        (x, why_x), (y, why_y) = ours, baseline
        summary[key] = x["tokens_per_s_per_gpu"] / y["tokens_per_s_per_gpu"] if x and y else None
        if summary[key] is None:
            missing[key] = "; ".join(filter(None, (why_x, why_y)))

    for seq, tag in _SEQ_KEYS.items():
        for base in ("sdpa_recipe", "flex_recipe", "ours_sdpa_d512"):
            ratio(f"ours_vs_{base}_tps_{tag}", row_at(rows, "ours", seq), row_at(rows, base, seq))
        # the other factor of ours_vs_sdpa_recipe: what the sliding path gains with SDPA on the D=512 layers in both
        ratio(f"ours_sdpa_d512_vs_sdpa_recipe_tps_{tag}", row_at(rows, "ours_sdpa_d512", seq),
              row_at(rows, "sdpa_recipe", seq))
        # opt-in row: what moving the sliding layers from Flex to FA4 gains at the step
        ratio(f"sliding_path_step_gain_{tag}", row_at(rows, "ours_fa4_sliding", seq), row_at(rows, "ours", seq))
        # opt-in rows: FP8 full fine-tuning, the faster recipe against ours in bf16
        fp8, why_fp8 = fastest_row(rows, FP8_ROWS, seq, "tokens_per_s_per_gpu")
        ours, why_ours = row_at(rows, "ours", seq)
        ratio(f"fp8_full_ft_vs_bf16_tps_{tag}", (fp8, why_fp8), (ours, why_ours))
        # MFU in bf16-equivalent FLOPs: the fp8 row's model FLOPs are counted as the bf16 row's (same shapes),
        # over the datasheet bf16 peak
        for key, row, field, why in ((f"fp8_full_ft_recipe_{tag}", fp8, "fp8", why_fp8),
                                     (f"fp8_full_ft_peak_mem_gb_{tag}", fp8, "peak_mem_allocated_gb", why_fp8),
                                     (f"ours_peak_mem_gb_{tag}", ours, "peak_mem_allocated_gb", why_ours),
                                     (f"ours_mfu_bf16eq_spec_{tag}", fp8, "mfu_spec", why_fp8)):
            summary[key] = row.get(field) if row else None
            if summary[key] is None:
                missing[key] = why or f"row {row['row']} at seq {seq} has no {field} (no GPU on this device)"
    ratio("ours_vs_liger_tps_8k", row_at(rows, "ours", 8192), fastest_row(rows, LIGER_ROWS, 8192, "tokens_per_s_per_gpu"))
    ratio("ours_vs_sdpa_defaults_tps_8k", row_at(rows, "ours", 8192), row_at(rows, "sdpa_defaults", 8192))
    ours16, why = row_at(rows, "ours", 16384)
    for key, field in (("ours_mfu_spec_16k", "mfu_spec"), ("ours_mfu_measured_peak_16k", "mfu_measured_peak")):
        summary[key] = ours16.get(field) if ours16 else None
        if summary[key] is None:
            missing[key] = why or f"row ours at seq 16384 has no {field} (no GPU peak on this device)"
    return summary, missing


def _fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def print_table(rows: list[dict]) -> None:
    print(f"\n{'row':22} {'seq':>6} {'tok/s/gpu':>10} {'step ms med [min,max]':>24} {'alloc/resv GB':>14} "
          f"{'MFU spec/meas':>14} {'lm_head':>7} {'gb/rc':>5} {'wall s':>6}  error", flush=True)
    for r in rows:
        if "error" in r:
            print(f"{r['row']:22} {r['seq']:>6} {'-':>10} {'-':>24} {'-':>14} {'-':>14} {'-':>7} {'-':>5} "
                  f"{_fmt(r.get('wall_s'), '.0f'):>6}  {r['error'][:100]}")
            continue
        step = f"{r['step_ms_median']:.1f} [{r['step_ms_min']:.1f},{r['step_ms_max']:.1f}]"
        mem = f"{_fmt(r['peak_mem_allocated_gb'], '.1f')}/{_fmt(r['peak_mem_reserved_gb'], '.1f')}"
        mfu = f"{_fmt(r['mfu_spec'], '.1%')}/{_fmt(r['mfu_measured_peak'], '.1%')}"
        print(f"{r['row']:22} {r['seq']:>6} {r['tokens_per_s_per_gpu']:>10.0f} {step:>24} {mem:>14} {mfu:>14} "
              f"{r['lm_head_flops_share']:>7.1%} {r['graph_breaks']:>2}/{r['recompiles_timed']:<2} "
              f"{_fmt(r.get('wall_s'), '.0f'):>6}")


def load_resume(args) -> tuple[list[dict], list[dict]]:
    """Finished rows and call records of an earlier result (`--resume`), same commit and shape."""
    return results_io.load_resume(args.resume, {k: getattr(args, k) for k in _SHAPE_KEYS})


def drive(args) -> None:
    t_start = time.perf_counter()
    kept, calls = load_resume(args)  # before any row runs or file is written: a bad --resume costs nothing
    out = Path(args.out)
    logs = out.parent / f"{out.stem}_logs"
    logs.mkdir(parents=True, exist_ok=True)
    rows = list(kept)
    this_call = dict(command=" ".join([Path(sys.executable).name, *sys.argv]),
                     date=time.strftime("%Y-%m-%d %H:%M:%S"), rows=[])

    def save(quiet: bool = True) -> None:
        summary, missing = summarize(rows)
        liger = fastest_row(rows, LIGER_ROWS, 8192, "tokens_per_s_per_gpu")[0]
        with contextlib.redirect_stdout(io.StringIO()) if quiet else contextlib.nullcontext():
            write_result("train_throughput", rows, summary, out=out, summary_missing=missing,
                         calls=[*calls, this_call], ours_sac_save_mm=PRODUCT_SAVE_MM,
                         liger_baseline=dict(seq=8192, row=liger and liger["row"], of=list(LIGER_ROWS)),
                         budget_s=args.budget_s, row_timeout_s=args.row_timeout_s,
                         **{k: getattr(args, k) for k in _SHAPE_KEYS})

    for name, seq in plan(args, {(r["row"], r["seq"]) for r in kept}):
        left = args.budget_s - (time.perf_counter() - t_start)
        if left < MIN_ROW_S:
            row = dict(row=name, seq=seq, **ROWS[name], error=f"skipped: past --budget-s {args.budget_s:.0f}")
        else:
            row = launch(args, name, seq, logs, min(args.row_timeout_s, left))
        rows.append(row)
        this_call["rows"].append(f"{name}@{seq}")
        save()  # after every row: a call cut short keeps what finished
        status = row.get("error", f"{row.get('tokens_per_s_per_gpu', 0):.0f} tok/s")[:160]
        print(f"[{time.perf_counter() - t_start:6.0f}s] {name} seq={seq} pid={row.get('pid')}: {status}", flush=True)
    print_table(rows)
    save(quiet=False)  # prints the summary


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.one:
        run_one(args)
    else:
        drive(args)


if __name__ == "__main__":
    from lightning_ffpa.errors import console_entry

    sys.exit(console_entry(main, hold=False))  # a bad option: exit 2 with one line, before any row runs
