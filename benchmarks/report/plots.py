"""PNG plots of `benchmarks/results/*.json` into `docs/img/<result file stem>.png` (matplotlib, from the dev extra).

Owns drawing only; which files exist and the tables around the plots are `benchmarks/report/pages.py`'s job.
Rows carrying `error` or `skipped` are left out of a plot (the report's tables still list them).

    python -m benchmarks.report.plots
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

IMG_DIR = Path(__file__).resolve().parents[2] / "docs" / "img"


def _ok(rows: list[dict[str, Any]], key: str) -> list[dict[str, Any]]:
    """Rows that measured `key` (no error, not skipped)."""
    return [r for r in rows if "error" not in r and "skipped" not in r and isinstance(r.get(key), (int, float))]


def _attention(rec: dict, fig) -> None:
    rows = [r for r in _ok(rec["rows"], "ms") if not str(r.get("impl", "")).startswith("flex_candidate")]
    modes = sorted({r["mode"] for r in rows})
    for i, mode in enumerate(modes):
        ax = fig.add_subplot(1, len(modes), i + 1)
        by_impl = defaultdict(list)
        for r in rows:
            if r["mode"] == mode:
                by_impl[r["impl"]].append((r["seq"], r["ms"]))
        for impl, pts in sorted(by_impl.items()):
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=impl)
        ax.set(xscale="log", yscale="log", xlabel="sequence length", ylabel="ms", title=f"{mode} (lower is better)")
        seqs = sorted({r["seq"] for r in rows})
        ax.set_xticks(seqs, labels=[str(s) for s in seqs], minor=False)
        ax.set_xticks([], minor=True)  # log-scale minor labels would overprint the sequence lengths
        ax.legend(fontsize=7)
    shape = rec.get("shape", {})
    fig.suptitle(f"Attention at head_dim {shape.get('D', '?')}, {rec.get('device', '')}")


def _bars(ax, rows: list[dict], label_key: str, group_key: str, value_key: str, ylabel: str,
          labels: list[str] | None = None) -> None:
    groups = sorted({r[group_key] for r in rows})
    labels = labels or list(dict.fromkeys(r[label_key] for r in rows))
    labels = [name for name in labels if any(r[label_key] == name for r in rows)]
    width = 0.8 / max(len(groups), 1)
    for gi, g in enumerate(groups):
        vals = {r[label_key]: r[value_key] for r in rows if r[group_key] == g}
        xs = [i + gi * width for i, name in enumerate(labels) if name in vals]
        ax.bar(xs, [vals[name] for name in labels if name in vals], width, label=f"{group_key}={g}")
    ax.set_xticks([i + width * (len(groups) - 1) / 2 for i in range(len(labels))], labels=labels, rotation=30,
                  ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=7)


def _memory_key(rows: list[dict]) -> str:
    """Peak allocated memory: `peak_mem_allocated_gb` in rows run one per process, `peak_mem_gb` in older files."""
    return "peak_mem_allocated_gb" if _ok(rows, "peak_mem_allocated_gb") else "peak_mem_gb"


def _seq_rows(rec: dict, fig, tps: str, order: tuple[str, ...], last: tuple[str, ...], title: str) -> None:
    """Tokens/s per row (the curated table's order) per seq, and peak allocated memory beside it."""
    from benchmarks.report.tables import ordered

    names = ordered([r["row"] for r in rec["rows"] if "row" in r], order, last)
    mem = _memory_key(rec["rows"])
    panels = [(tps, "tokens/s per GPU", "throughput (higher is better)"), (mem, "peak allocated (GiB)", "peak memory")]
    panels = [p for p in panels if _ok(rec["rows"], p[0])]
    for i, (key, ylabel, sub) in enumerate(panels):
        ax = fig.add_subplot(1, len(panels), i + 1)
        _bars(ax, _ok(rec["rows"], key), "row", "seq", key, ylabel, names)
        ax.set_title(sub)
    fig.suptitle(f"{title}, {rec.get('device', '')}")


def _train_throughput(rec: dict, fig) -> None:
    from benchmarks.report.tables import TRAIN_ORDER

    _seq_rows(rec, fig, "tokens_per_s_per_gpu", TRAIN_ORDER, ("ours",), "Training step")


def _full_depth_lora(rec: dict, fig) -> None:
    from benchmarks.report.tables import LORA_ORDER

    _seq_rows(rec, fig, "tokens_per_s", LORA_ORDER, (), "Full-depth LoRA step")


def _rollout(rec: dict, fig) -> None:
    ax = fig.add_subplot(1, 1, 1)
    by_name = defaultdict(list)
    for r in _ok(rec["rows"], "tokens_per_s"):
        if "batch" in r:
            by_name[r["name"]].append((r["batch"], r["tokens_per_s"]))
    for name, pts in sorted(by_name.items()):
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
    ax.set(xscale="log", xlabel="batch size", ylabel="generated tokens/s", title="Rollout decode throughput")
    batches = sorted({b for pts in by_name.values() for b, _ in pts})
    ax.set_xticks(batches, labels=[str(b) for b in batches], minor=False)
    ax.set_xticks([], minor=True)
    ax.legend(fontsize=7)
    note = rec.get("summary", {}).get("depth_note")
    fig.suptitle(f"{rec.get('device', '')}" + (f", {note}" if isinstance(note, str) else ""))


def _context_parallel(rec: dict, fig) -> None:
    ax = fig.add_subplot(1, 1, 1)
    rows = _ok(rec["rows"], "tokens_per_s")
    ax.bar(range(len(rows)), [r["tokens_per_s"] for r in rows])
    ax.set_xticks(range(len(rows)), labels=[r["row"] for r in rows], rotation=30, ha="right", fontsize=8)
    ax.set(ylabel="tokens/s", title="Context parallel (higher is better)")
    note = rec.get("summary", {}).get("model_slice")
    fig.suptitle(f"{rec.get('device', '')}" + (f", {note}" if isinstance(note, str) else ""))


# benchmark name -> (drawer, the row key that must be measured somewhere for a plot to exist)
PLOTTERS: dict[str, tuple[Callable[[dict, Any], None], str]] = {
    "attention": (_attention, "ms"),
    "train_throughput": (_train_throughput, "tokens_per_s_per_gpu"),
    "full_depth_lora": (_full_depth_lora, "tokens_per_s"),
    "rollout": (_rollout, "tokens_per_s"),
    "context_parallel": (_context_parallel, "tokens_per_s"),
}


def can_plot(rec: dict[str, Any]) -> bool:
    """Whether `rec` gets a plot: a known benchmark with at least one measured row."""
    entry = PLOTTERS.get(rec.get("benchmark"))
    return entry is not None and bool(_ok(rec.get("rows", []), entry[1]))


def draw(rec: dict[str, Any], out_dir: Path = IMG_DIR, name: str | None = None) -> Path:
    """Draw one result record to `out_dir/<name>.png` (`name` defaults to the benchmark)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not can_plot(rec):
        raise ValueError(f"no plot for benchmark {rec.get('benchmark')!r}: unknown or no measured rows")
    fig = plt.figure(figsize=(11, 4.2))
    try:
        PLOTTERS[rec["benchmark"]][0](rec, fig)
        fig.tight_layout()
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / f"{name or rec['benchmark']}.png"
        fig.savefig(path, dpi=110, metadata={"Software": None})
    finally:
        plt.close(fig)
    return path


def draw_all(results: list[tuple[Path, dict[str, Any]]], out_dir: Path = IMG_DIR) -> list[Path]:
    """Draw every plottable record, named after its result file; returns the written paths."""
    return [draw(rec, out_dir, path.stem) for path, rec in results if can_plot(rec)]


if __name__ == "__main__":
    from benchmarks.report.results_io import load_results

    for p in draw_all(load_results()):
        print(f"wrote {p}")
