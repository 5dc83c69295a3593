"""One writer and one reader for benchmarks/results/*.json, so every recorded run carries the same keys."""

from __future__ import annotations

import datetime as _dt
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).resolve().parents[1] / "results"


def _version(mod: str) -> str | None:
    try:
        return __import__(mod).__version__
    except Exception:  # noqa: BLE001 - a missing package is recorded as None
        return None


def _commit() -> str:
    # An explicit commit wins: a copied work tree can carry a stale .git of another revision.
    if os.environ.get("LIGHTNING_FFPA_COMMIT"):
        return os.environ["LIGHTNING_FFPA_COMMIT"]
    try:
        root = Path(__file__).resolve().parents[2]
        sha = subprocess.check_output(["git", "-C", str(root), "rev-parse", "HEAD"], text=True).strip()
        dirty = subprocess.check_output(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"], text=True)
        return sha + ("-dirty" if dirty.strip() else "")
    except Exception:  # noqa: BLE001 - the device copy may have no .git
        return os.environ.get("LIGHTNING_FFPA_COMMIT", "unknown")


def _script_doc() -> str | None:
    import ast

    script = Path(sys.argv[0])
    if script.suffix != ".py" or not script.exists():
        return None
    return ast.get_docstring(ast.parse(script.read_text()))


def device_name() -> str:
    import torch

    if not torch.cuda.is_available():
        return "cpu"
    return f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}"


def write_result(benchmark: str, rows: list[dict[str, Any]], summary: dict[str, Any],
                 out: str | Path | None = None, **extra: Any) -> Path:
    """Write one result JSON (benchmark, command, commit, tree, date, device, versions, rows, summary)."""
    from benchmarks.report.checkout import tree_digest

    record = {
        "benchmark": benchmark,
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "commit": _commit(),
        "tree": tree_digest(),  # the files as run: a device copy's local edits, which `commit` cannot name
        "date": _dt.date.today().isoformat(),
        "finished_at": _dt.datetime.now().strftime("%Y-%m-%d %H:%M:%S"),  # orders two files of one day
        "device": device_name(),
        "versions": {m: _version(m) for m in ("torch", "transformers", "ffpa_attn", "lightning", "triton")},
        **({} if _version("ffpa_attn") else {"ffpa_unavailable": _ffpa_unavailable()}),  # why the version is null
        "script_doc": _script_doc(),  # what the rows meant when they ran, for docs rendered after the script changes
        "rows": rows,
        "summary": summary,
        **extra,
    }
    path = Path(out) if out else RESULTS_DIR / f"{benchmark}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2, default=str) + "\n")
    print(json.dumps(summary, indent=2, default=str))
    return path


def _ffpa_unavailable() -> str:
    from lightning_ffpa.attention import kernels

    return kernels.ffpa_unavailable_reason() or "ffpa-attn is not installed"


def provenance(by: str) -> dict[str, str]:
    """Who rewrote a recorded file after its run (a merge, a recomputed summary): command, commit and date."""
    return {"by": by, "commit": _commit(), "date": _dt.date.today().isoformat()}


def read_result(path: str | Path, option: str) -> dict[str, Any]:
    """A result file named by `option`; ConfigError naming the option (one line, before any work) unless it is
    a readable result record."""
    from lightning_ffpa.errors import ConfigError

    path = Path(path)
    if not path.is_file():
        raise ConfigError(option, str(path), "no such file")
    try:
        record = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConfigError(option, str(path), f"not JSON ({err})") from None
    missing = [k for k in ("benchmark", "rows", "summary") if not isinstance(record, dict) or k not in record]
    if missing:
        raise ConfigError(option, str(path), f"not a result file: it lacks {missing}")
    return record


def resummarize(path: str | Path, summarize: Any, by: str) -> dict[str, Any]:
    """Recompute a result file's summary in place from its rows (untouched), recording that it was recomputed,
    by which command and commit, and the summary the run itself wrote. `summarize` returns the summary, or
    the summary and the reasons of its null keys (`summary_missing`)."""
    path = Path(path)
    record = read_result(path, "--summarize")
    before = record["summary"]
    summary = summarize(record["rows"])
    if isinstance(summary, tuple):
        summary, record["summary_missing"] = summary
    record["summary"] = summary
    at_run = (record.get("summary_recomputed") or {}).get("summary_at_run", before)  # kept over re-summaries
    record["summary_recomputed"] = {**provenance(by), "summary_at_run": at_run}
    path.write_text(json.dumps(record, indent=2, default=str) + "\n")
    print(json.dumps(record["summary"], indent=2, default=str))
    return record["summary"]


def leaves(value: Any):
    """Every leaf of a result record (numbers, strings, None), depth first."""
    if isinstance(value, dict):
        for v in value.values():
            yield from leaves(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from leaves(v)
    else:
        yield value


def load_results(results_dir: Path = RESULTS_DIR) -> list[tuple[Path, dict[str, Any]]]:
    """Every result JSON under `results_dir` (not its subfolders), sorted by file name."""
    out = []
    for path in sorted(results_dir.glob("*.json")):
        record = json.loads(path.read_text())
        missing = [k for k in ("benchmark", "rows", "summary") if k not in record]
        if missing:
            raise ValueError(f"{path}: result file lacks {missing} (write it with benchmarks/report/results_io.py)")
        out.append((path, record))
    return out


def load_resume(path: str | None, shape: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Finished rows and call records of an earlier result that `--resume` continues; refused (one line, before
    any row runs) unless it was measured at this commit with the same `shape` (the top-level fields)."""
    from benchmarks.row_process import measured
    from lightning_ffpa.errors import ConfigError

    if not path:
        return [], []
    old = read_result(path, "--resume")
    mine = dict(commit=_commit(), **shape)
    diff = {k: (old.get(k), v) for k, v in mine.items() if old.get(k) != v}
    if diff:
        raise ConfigError("--resume", path, f"was measured with other settings (theirs, ours): {diff}")
    calls = old.get("calls") or [{k: old.get(k) for k in ("command", "date", "device")}]
    return [r for r in old["rows"] if measured(r)], calls  # a row killed only after writing itself is kept
