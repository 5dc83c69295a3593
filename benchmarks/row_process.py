"""Runs benchmark rows one process each: no memory, compiled graph or allocator state carries between rows.

Owns the driver loop: launch one child per row spec, bound it by a per-row timeout and the run's total budget
(the whole process group is killed on timeout, inductor's compile workers included), read the row the child
wrote, record how the process ended, and hand every finished row to a callback (the scripts rewrite their
result file there). Does not own what a row measures: each script's own row entry point does that, and it
writes one JSON object to the path given as `--row-out` (under torchrun, rank 0 of the launch writes it).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

MIN_ROW_S = 20.0  # less time than this left in the budget: the row is skipped, not started and killed
STACK_SIGNAL = signal.SIGUSR1  # asks a row's processes for their Python stacks before the kill
STACK_GRACE_S = 3.0
KILLED_AFTER_ROW = "killed at its timeout after writing its whole row (a slow exit, not a failed measurement)"
STACK_SAMPLES_ENV = "LIGHTNING_FFPA_BENCH_STACKS_EVERY_S"  # opt-in: rows also print their stack every N seconds
_DUMP_LINES = ("Thread 0x", "Current thread 0x", '  File "', "  <no Python frame>", "Stack sample ")


def dump_stacks_on_signal() -> None:
    """Child side: on STACK_SIGNAL, print every thread's Python stack to the row's log (where a killed row stood);
    with STACK_SAMPLES_ENV set, also the main thread's stack every that many seconds (where a slow row that
    finishes spent its time)."""
    import faulthandler

    faulthandler.register(STACK_SIGNAL, all_threads=True)
    every = float(os.environ.get(STACK_SAMPLES_ENV) or 0)
    if every > 0:
        threading.Thread(target=_sample_main_stack, args=(every,), daemon=True, name="stack-sampler").start()


def _sample_main_stack(every: float) -> None:
    # traceback under the GIL, not faulthandler.dump_traceback_later: that one reads every thread's frames
    # without the GIL and crashed a row (SIGSEGV) while inductor's threads were compiling.
    main = threading.main_thread().ident
    while True:
        time.sleep(every)
        frame = sys._current_frames().get(main)
        if frame is not None:
            lines = traceback.format_stack(frame)
            print(f"Stack sample ({time.strftime('%H:%M:%S')}, main thread):\n{''.join(lines)}", end="",
                  file=sys.stderr, flush=True)


def progress_tail(text: str, lines: int) -> list[str]:
    """The last `lines` lines a row printed, its stack dumps (sampled or at the kill) left out."""
    return [ln for ln in text.splitlines()
            if ln.strip() and not ln.startswith(_DUMP_LINES) and not ln.startswith("    ")][-lines:]


def kill_row(proc: subprocess.Popen) -> None:
    """Kill a row's whole process group (compile workers, torchrun's ranks), after asking it for its stacks."""
    try:
        os.killpg(proc.pid, STACK_SIGNAL)
        time.sleep(STACK_GRACE_S)  # every rank writes its dump; a launcher that dies of the signal must not cut it
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:  # the group is gone already
        pass


def add_run_options(parser: Any, *, budget_s: float, row_timeout_s: float) -> None:
    """The options every row-per-process script shares: warm-up and timed steps, the call's time budget, the
    per-row timeout and `--resume` (so one table fills over several calls)."""
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (compile happens here)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per row (median, min and max)")
    parser.add_argument("--budget-s", type=float, default=budget_s, help="the whole call ends within this many seconds")
    parser.add_argument("--row-timeout-s", type=float, default=row_timeout_s, help="one row's process is killed after this")
    parser.add_argument("--resume", default=None, help="result JSON of an earlier call: keep its finished rows")


def _tail(path: Path, chars: int = 1500) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


def run_row(script: Path, spec: dict[str, Any], log: Path, timeout_s: float,
            launcher: Sequence[str] = ()) -> dict[str, Any]:
    """Run `script --row SPEC --row-out FILE` in a fresh process; the row it wrote, with process facts added.

    `launcher`: interpreter arguments before the script, e.g. ``("-m", "torch.distributed.run", "--standalone",
    "--nproc_per_node", "2")`` for a row that is a multi-rank launch (the timeout kills every rank).
    """
    out = log.with_suffix(".row.json")
    out.unlink(missing_ok=True)
    cmd = [sys.executable, *launcher, str(script), "--row", json.dumps(spec), "--row-out", str(out)]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    t0 = time.perf_counter()
    with log.open("w") as fh:
        # a session of its own: a timeout kills the row's whole process group, compile workers included
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            kill_row(proc)
            rc, timed_out = proc.wait(), True
    row: dict[str, Any] = dict(spec)
    wrote = out.exists()
    if wrote:
        row.update(json.loads(out.read_text()))
        out.unlink()
    process = {"rc": rc, "wall_s": round(time.perf_counter() - t0, 2), "timeout_s": round(timeout_s, 1),
               "log": log.name}
    row["process"] = {**row.get("process", {}), **process}
    if timed_out and wrote and "error" not in row:
        # It measured and wrote its whole row, then outlived the timeout on its way out (teardown, a library's
        # threads): the row stands, and its record says how the process ended.
        row["process"]["exit"] = KILLED_AFTER_ROW
    elif timed_out:
        stacks = any(ln.startswith(_DUMP_LINES[:2]) for ln in _tail(log, 1_000_000).splitlines())
        where = "its log ends with the Python stacks it had then" if stacks else "no Python stack reached its log"
        row["error"] = f"timeout: the row's process was killed after {timeout_s:.0f} s ({where})"
    elif not wrote:
        row["error"] = f"the row's process exited with rc={rc} without writing its row"
    if timed_out:  # what it printed last; its stacks at the kill follow in the log
        row["log_tail"] = "\n".join(progress_tail(_tail(log, 200_000), 20))
    elif "error" in row:
        row["log_tail"] = _tail(log)
    return row


def measured(row: dict[str, Any]) -> bool:
    """Whether a recorded row holds a whole measurement: no error, or killed only after its child wrote the
    row. Files from before `KILLED_AFTER_ROW` existed show that case as the driver's `timeout:` error on a row
    that carries its child's pid (written by `row_main`) and no traceback of the child's own."""
    if row.get("skipped"):
        return False
    error = row.get("error")
    if not error:
        return True
    return (error.startswith("timeout: the row's process was killed") and "pid" in row.get("process", {})
            and "traceback_tail" not in row)


def row_at(rows: list[dict[str, Any]], name: str, seq: int) -> tuple[dict[str, Any] | None, str | None]:
    """The last recorded `name` row at `seq` if it holds a measurement, else None and why not."""
    hit = [r for r in rows if r.get("row") == name and r.get("seq") == seq]
    if not hit:
        return None, f"row {name} at seq {seq} is not in this result"
    if measured(hit[-1]):
        return hit[-1], None
    return None, f"row {name} at seq {seq} has no measurement: {str(hit[-1].get('error') or hit[-1].get('skipped'))[:300]}"


def fastest_row(rows: list[dict[str, Any]], names: Sequence[str], seq: int,
                metric: str) -> tuple[dict[str, Any] | None, str | None]:
    """The measured row with the highest `metric` among one baseline's option rows at `seq` (its sweep), or None
    and why none of them measured."""
    found = [row_at(rows, name, seq) for name in names]
    done = [row for row, _ in found if row]
    if done:
        return max(done, key=lambda r: r[metric]), None
    return None, "; ".join(why for _, why in found if why)


def run_rows(script: Path, specs: list[dict[str, Any]], logs: Path, row_timeout_s: float, budget_s: float,
             on_row: Callable[[list[dict[str, Any]]], None], launcher: Sequence[str] = ()) -> list[dict[str, Any]]:
    """Run every spec in its own process (see `run_row` for `launcher`), in order, within `budget_s`;
    `on_row(rows)` after each row."""
    logs.mkdir(parents=True, exist_ok=True)
    start, rows = time.perf_counter(), []
    for i, spec in enumerate(specs):
        left = budget_s - (time.perf_counter() - start)
        label = f"{spec.get('name')} batch={spec.get('batch')}"
        if left < MIN_ROW_S:
            row = {**spec, "skipped": f"total budget of {budget_s:.0f} s spent before this row started"}
        else:
            print(f"[row {i + 1}/{len(specs)}] {label}: own process, limit {min(row_timeout_s, left):.0f} s",
                  flush=True)
            row = run_row(script, spec, logs / f"{i:02d}_{_slug(spec)}.log", min(row_timeout_s, left), launcher)
            status = row.get("error", "ok")[:200]
            print(f"[row {i + 1}/{len(specs)}] {label}: {status} ({row['process']['wall_s']} s)", flush=True)
        rows.append(row)
        on_row(rows)
    return rows


def run_rows_into(script: Path, name: str, specs: list[dict[str, Any]], out: Path,
                  summarize: Callable[[list[dict[str, Any]]], dict[str, Any]], row_timeout_s: float,
                  budget_s: float) -> list[dict[str, Any]]:
    """`run_rows`, writing result `name` to `out` after each row (logs beside it); its summary says `partial`
    until every row has run."""
    from benchmarks.report.results_io import write_result  # the report package reads this module

    def write(done: list[dict[str, Any]]) -> None:
        summary = summarize(done)
        if len(done) < len(specs):
            summary["partial"] = True
        write_result(name, done, summary, out=out, driver_pid=os.getpid())

    return run_rows(script, specs, out.with_suffix(".logs"), row_timeout_s, budget_s, write)


def run_resumed_rows(script: Path, name: str, specs: list[dict[str, Any]], out: Path, resumed: tuple[list, list],
                     summarize: Callable[[list[dict[str, Any]]], tuple[dict, dict]], row_timeout_s: float,
                     budget_s: float, **fields: Any) -> list[dict[str, Any]]:
    """`run_rows` for a script that resumes: result `name` at `out` is rewritten after each row with the kept rows
    of its `--resume` file first, this call appended to the file's `calls`, the summary and what it could not
    compute (`summary_missing`) over all rows, and `fields`; logs go to `<out stem>_logs`."""
    from benchmarks.report.results_io import write_result  # the report package reads this module

    kept, calls = resumed
    this_call = dict(command=" ".join([Path(sys.executable).name, *sys.argv]),
                     date=time.strftime("%Y-%m-%d %H:%M:%S"), rows=[s["name"] for s in specs])

    def save(rows: list[dict[str, Any]]) -> None:
        summary, missing = summarize([*kept, *rows])
        write_result(name, [*kept, *rows], summary, out=out, summary_missing=missing, calls=[*calls, this_call],
                     budget_s=budget_s, row_timeout_s=row_timeout_s, **fields)

    save([])
    return run_rows(script, specs, out.parent / f"{out.stem}_logs", row_timeout_s, budget_s, save)


def _slug(spec: dict[str, Any]) -> str:
    parts = [str(spec.get(k)) for k in ("name", "batch") if spec.get(k) is not None]
    return "_".join(parts).replace("/", "-")


def row_main(argv: list[str] | None, measure: Callable[[dict[str, Any]], dict[str, Any]]) -> bool:
    """Child side: when `--row` is in argv, run `measure(spec)` and write its row to `--row-out`; True if so.

    An exception inside `measure` is recorded as the row's error (with the traceback's last lines), so the
    driver tells a failing row from a killed process.
    """
    import argparse
    import traceback

    from lightning_ffpa.errors import exit_quickly

    argv = sys.argv[1:] if argv is None else argv
    if "--row" not in argv:
        return False
    ap = argparse.ArgumentParser()
    ap.add_argument("--row", required=True)
    ap.add_argument("--row-out", required=True)
    args = ap.parse_args(argv)
    spec = json.loads(args.row)
    dump_stacks_on_signal()
    exit_quickly()  # a row's process exits right after writing its row
    row: dict[str, Any] = {"process": {"pid": os.getpid(), "parent_pid": os.getppid()}}
    try:
        row.update(measure(spec))
    except Exception as err:  # noqa: BLE001 - the row records the failure; the driver goes on
        row["error"] = f"{type(err).__name__}: {err}"[:600]
        row["traceback_tail"] = traceback.format_exc()[-1500:]
        traceback.print_exc()
    if int(os.environ.get("RANK", "0")) == 0:  # one launch writes one row; every rank measured it together
        Path(args.row_out).write_text(json.dumps(row, default=str) + "\n")
    return True


def driver_main(argv: list[str] | None, script: str, measure: Callable[[dict[str, Any]], dict[str, Any]],
                parse_args: Callable[[list[str] | None], Any], summarize: Callable, drive: Callable[[Any], None]) -> None:
    """A resumable driver's `main`: a child runs its one row; `--summarize FILE` recomputes a file's summary;
    otherwise `drive(args)` runs the rows."""
    if row_main(argv, measure):  # a child: one (row, seq)
        return
    args = parse_args(argv)
    if args.summarize:
        from benchmarks.report.results_io import resummarize

        resummarize(args.summarize, summarize, by=f"{script} --summarize")
        return
    drive(args)


def check_profiled_rows(args: Any) -> None:
    """`--profile` names only rows that `--rows` runs: one line naming the option otherwise."""
    from lightning_ffpa.errors import ConfigError

    if not set(args.profile) <= set(args.rows):
        raise ConfigError("--profile", args.profile, f"profiles only rows that run; --rows is {args.rows}")
