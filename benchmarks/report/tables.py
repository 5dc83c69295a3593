"""The curated tables at the top of `docs/benchmarks.md`: one compact table per result file of the benchmarks below.

Owns choosing and formatting the cells: which rows and fields a reader compares (ours against same-recipe
baselines and peers, per sequence length or batch), each column header linking its result file and naming the
JSON field, and the notes under a table ("—" cells: a failed or skipped row, its error's first line). Every number
printed is a field of the result record, formatted with one of `FORMATS`; a ratio is printed only where the file's
summary recorded it. Does not load files, write pages or draw plots (`benchmarks/report/pages.py`, `benchmarks/report/plots.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from benchmarks.row_process import measured

FORMATS = {"tps": "{:,.0f}", "ratio": "{:.2f}x", "gib": "{:.1f}", "pct": "{:.1%}", "ms": "{:.1f}", "op_ms": "{:.3f}",
           "s": "{:.2f}", "mhz": "{:.0f}", "w": "{:.0f}"}
DASH = "—"
# The scripts' row order (train_rows.ROWS, full_depth_lora.ROWS, rollout.KINDS): each label compares with a
# neighbour, so tables keep it; rows of other names (ablations, older files) follow in file order.
TRAIN_ORDER = ("sdpa_defaults", "sdpa_recipe", "flex_recipe", "liger_recipe", "ours_sdpa_d512")
LORA_ORDER = ("ours_lora", "hf_peft_sdpa_recipe", "ours_lora_offload", "unsloth_lora", "unsloth_lora_gc")
ROLLOUT_ORDER = ("ours_paged_flex", "ours_paged_flex_eager_step", "hf_generate_static", "hf_generate_static_compiled",
                 "hf_continuous_batching")
# Summary ratio keys (ours over the row), by row name; `{k}` is the sequence tag ("8k").
TRAIN_RATIOS = {"sdpa_defaults": "ours_vs_sdpa_defaults_tps_{k}", "sdpa_recipe": "ours_vs_sdpa_recipe_tps_{k}",
                "flex_recipe": "ours_vs_flex_recipe_tps_{k}", "liger_recipe": "ours_vs_liger_tps_{k}",
                "ours_sdpa_d512": "ours_vs_ours_sdpa_d512_tps_{k}"}
LORA_RATIOS = {"hf_peft_sdpa_recipe": "full_depth_lora_ours_vs_sdpa_recipe_tps_{k}",
               "unsloth_lora": "full_depth_lora_ours_vs_unsloth_tps_{k}"}  # beside the Unsloth baseline's row


def is_number(value: Any) -> bool:
    """A recorded measurement: int or float, not a bool, not NaN."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value


def fmt(kind: str, value: Any) -> str:
    """`value` in the format of `kind` (a key of FORMATS); "n/a" when the field was not recorded."""
    return FORMATS[kind].format(value) if is_number(value) else "n/a"


def seq_tag(seq: int) -> str:
    """8192 -> "8k", as the scripts' summary keys spell sequence lengths."""
    return f"{seq // 1024}k" if seq % 1024 == 0 else str(seq)


def code(text: str) -> str:
    """`text` as an inline code span (a longer fence when it holds a backtick)."""
    return f"`` {text} ``" if "`" in text else f"`{text}`"


def failed(row: dict[str, Any]) -> str | None:
    """The first line of a row's error or skip reason, or None for a measured row (one killed only after it
    wrote its whole row counts as measured: `row_process.measured`)."""
    why = row.get("error") or row.get("skipped")
    if not why or measured(row):
        return None
    line = str(why).strip().splitlines()[0] if str(why).strip() else str(why)
    return line if len(line) <= 200 else line[:199] + "…"


class Notes:
    """Lettered notes under one table: a "—" cell (failed or skipped row) or a qualified value points at one."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def add(self, text: str) -> str:
        i, letters = len(self.lines), ""
        while True:
            letters = chr(ord("a") + i % 26) + letters
            i = i // 26 - 1
            if i < 0:
                break
        self.lines.append(f"- ({letters}) {text}")
        return f"({letters})"

    def dash(self, what: str, row: dict[str, Any]) -> str:
        return f"{DASH} " + self.add(f"{what}: {code(failed(row))}")


class Table:
    """A markdown table whose header cells link the result file and name the JSON field of their column."""

    def __init__(self, link: str) -> None:
        self.link, self.head, self.body = link, [], []

    def col(self, title: str, field: str | None = None) -> None:
        self.head.append(title if field is None else f"{title} [{code(field)}]({self.link})")

    def add(self, cells: list[str]) -> None:
        self.body.append([c.replace("|", "\\|") for c in cells])

    def keep(self, used: list[bool]) -> None:
        """Drop the columns whose `used` is False (no row recorded that field)."""
        self.head = [h for h, u in zip(self.head, used) if u]
        self.body = [[c for c, u in zip(row, used) if u] for row in self.body]

    def render(self) -> list[str]:
        return ["| " + " | ".join(self.head) + " |", "|" + "---|" * len(self.head),
                *("| " + " | ".join(r) + " |" for r in self.body)]


def ordered(names: list[str], order: tuple[str, ...], last: tuple[str, ...] = ()) -> list[str]:
    """`names` (first-seen order) with those matching `order` (exactly, or by an `_opt` prefix) first in its order,
    then the others in file order, then those in `last` (the reference row, which every other row leads up to)."""
    def rank(name: str) -> tuple[int, int]:
        if name in last:
            return (len(order) + 1 + last.index(name), 0)
        hit = [i for i, o in enumerate(order) if name == o or (o.endswith("_opt") and name.startswith(o))]
        return (hit[0] if hit else len(order), names.index(name))

    return sorted(dict.fromkeys(names), key=rank)


def _last(rows: list[dict[str, Any]], **match: Any) -> dict[str, Any] | None:
    hits = [r for r in rows if all(r.get(k) == v for k, v in match.items())]
    return hits[-1] if hits else None


def _used(table: Table) -> list[bool]:
    return [any(r[i] not in ("", "n/a") for r in table.body) for i in range(len(table.head))]


def _dotted(row: dict[str, Any], field: str) -> Any:
    """`row["a"]["b"]` for "a.b"; None where any part is missing."""
    for part in field.split("."):
        row = row.get(part) if isinstance(row, dict) else None
    return row


def seq_tables(rec: dict[str, Any], link: str, tps: str, order: tuple[str, ...], ratios: dict[str, str],
               ref: str, detail: list[tuple[str, str, str]], label: str, last: tuple[str, ...] = ()) -> list[str]:
    """Throughput by row x seq (with ours' summary ratios), then step time, memory and MFU of measured rows."""
    rows = [r for r in rec["rows"] if "row" in r and "seq" in r]
    names, seqs = ordered([r["row"] for r in rows], order, last), sorted({r["seq"] for r in rows})
    summary, notes, t = rec["summary"], Notes(), Table(link)
    t.col("row", "row")
    t.col(label, "label")
    for seq in seqs:
        t.col(f"tokens/s, seq {seq}", f"rows[].{tps}")
        mids = [ratios[n].format(k=seq_tag(seq)) for n in names if n in ratios]
        t.col(f"{ref} ÷ row, seq {seq}", "summary." + ", ".join(mids) if mids else None)
    for name in names:
        text = next((r["label"] for r in rows if r["row"] == name and isinstance(r.get("label"), str)), "")
        cells = [name, text]
        for seq in seqs:
            row = _last(rows, row=name, seq=seq)
            if row is None:
                cells.append("")
            elif failed(row):
                cells.append(notes.dash(f"`{name}` at seq {seq}", row))
            else:
                cells.append(fmt("tps", row.get(tps)))
            key = ratios[name].format(k=seq_tag(seq)) if name in ratios else None
            cells.append(fmt("ratio", summary[key]) if key and summary.get(key) is not None else "")
        t.add(cells)
    t.keep([u or i == 0 for i, u in enumerate(_used(t))])
    d = Table(link)
    d.col("row", "row")
    d.col("seq", "seq")
    for title, field, _ in detail:
        d.col(title, "step_ms_median, step_ms_min, step_ms_max" if field == "step_ms_median" else field)
    for name in names:
        for seq in seqs:
            row = _last(rows, row=name, seq=seq)
            if row is None or failed(row):
                continue
            cells = [name, str(seq)]
            for _, field, kind in detail:
                if field == "step_ms_median":
                    cells.append(f"{fmt('ms', row.get(field))} ({fmt('ms', row.get('step_ms_min'))}–"
                                 f"{fmt('ms', row.get('step_ms_max'))})" if field in row else "")
                else:
                    value = _dotted(row, field)
                    cells.append("" if value is None else fmt(kind, value))
            d.add(cells)
    d.keep([u or i < 2 for i, u in enumerate(_used(d))])
    out = [*t.render(), "", *notes.lines]
    if d.body and len(d.head) > 2:
        out += ["" if notes.lines else None, "Step time, memory and MFU of the measured rows:", "", *d.render()]
    return [x for x in out if x is not None]


TRAIN_DETAIL = [("step ms, median (min–max)", "step_ms_median", "ms"), ("step ms, median", "step_ms", "ms"),
                ("peak allocated GiB", "peak_mem_allocated_gb", "gib"),
                ("peak reserved GiB", "peak_mem_reserved_gb", "gib"),
                ("peak allocated GiB, all rows in one process", "peak_mem_gb", "gib"),
                ("MFU of the datasheet bf16 peak", "mfu_spec", "pct"),
                ("MFU of the measured matmul peak", "mfu_measured_peak", "pct"),
                ("MFU of the measured bf16 peak", "mfu", "pct"),
                ("SM clock over the timed steps, median MHz", "gpu_clocks.sm_clock_mhz_median", "mhz"),
                ("power over the timed steps, median W", "gpu_clocks.power_w_median", "w")]


def training(rec: dict[str, Any], link: str) -> list[str]:
    return seq_tables(rec, link, "tokens_per_s_per_gpu", TRAIN_ORDER, TRAIN_RATIOS, "ours", TRAIN_DETAIL,
                      "what differs from the row it names", ("ours",))


def kernel_time(rec: dict[str, Any], link: str) -> list[str]:
    """Per profiled row (`--profile`), its extra step's kernel time by kind. Sums of recorded fields
    (`step_probe.kernel_kinds`), so they go in a file's own section, not among the curated tables."""
    from benchmarks.step_probe import kernel_kinds

    rows = [r for r in rec["rows"] if not failed(r) and {"top_kernels", "cuda_kernel_total_ms", "wall_ms"}
            <= set(r.get("profile") or {})]  # the profile step_probe writes (older files recorded less)
    if not rows:
        return []
    kinds = [kernel_kinds(r["profile"]) for r in rows]
    t = Table(link)
    for title, field in (("row", "row"), ("seq", "seq"), ("profiled step, wall ms", "profile.wall_ms"),
                         ("GPU busy ms", "profile.cuda_busy_ms")):
        t.col(title, field)
    for kind in kinds[0]:
        t.col(f"{kind}, ms", "profile.top_kernels[].total_ms")
    for row, by_kind in zip(rows, kinds):
        t.add([row["row"], str(row["seq"]), fmt("ms", row["profile"]["wall_ms"]),
               fmt("ms", row["profile"]["cuda_busy_ms"]), *(fmt("ms", v) for v in by_kind.values())])
    return [f"Where a profiled step's kernel time goes: the {len(rows[0]['profile']['top_kernels'])} longest "
            "kernels of one extra step (`profile.top_kernels`), summed by kind by `benchmarks/step_probe.py`'s "
            "`kernel_kinds` (kernels on other streams overlap, so the kinds can add up to more than the wall "
            "time):", "", *t.render(), ""]


def decode_kernel_time(rec: dict[str, Any], link: str) -> list[str]:
    """Per rollout row profiled with `--profile`, its decode step's kernel time by kind (ms per step). Sums of
    recorded fields (`rollout_profile.decode_kernel_kinds`), so they go in a file's own section."""
    from benchmarks.rollout_profile import decode_kernel_kinds

    rows = [r for r in rec["rows"] if not failed(r) and {"top_kernels", "gpu_busy_ms_per_step", "steps"}
            <= set(r.get("profile") or {})]
    if not rows:
        return []
    kinds = [decode_kernel_kinds(r["profile"]) for r in rows]
    t = Table(link)
    for title, field in (("row", "name"), ("batch", "batch"), ("layers", "layers"),
                         ("profiled steps", "profile.steps"), ("wall ms per step", "profile.wall_ms_per_step"),
                         ("GPU busy ms per step", "profile.gpu_busy_ms_per_step")):
        t.col(title, field)
    for kind in kinds[0]:
        t.col(f"{kind}, ms per step", "profile.top_kernels[].total_ms")
    for row, by_kind in zip(rows, kinds):
        p = row["profile"]
        t.add([row["name"], str(row["batch"]), str(row.get("layers")), str(p["steps"]),
               fmt("op_ms", p["wall_ms_per_step"]), fmt("op_ms", p["gpu_busy_ms_per_step"]),
               *(fmt("op_ms", v) for v in by_kind.values())])
    return [f"Where a profiled decode step's time goes: the {len(rows[0]['profile']['top_kernels'])} longest "
            "kernels of a few graphed decode steps (`profile.top_kernels`; the context they start at is "
            "`profile.context_at_first_step`, or just past the prompt where a file does not record it), summed by "
            "kind by `benchmarks/rollout_profile.py`'s `decode_kernel_kinds` and divided by the steps; wall time "
            "above GPU-busy time is the GPU idle between kernels and steps:", "", *t.render(), ""]


def full_depth_lora(rec: dict[str, Any], link: str) -> list[str]:
    detail = [TRAIN_DETAIL[0], *TRAIN_DETAIL[2:4], ("MFU of the datasheet bf16 peak, LoRA FLOPs", "mfu_spec", "pct"),
              *TRAIN_DETAIL[-2:]]
    baselines = {k: v for k, v in rec["summary"].items() if k.startswith("full_depth_lora_unsloth_baseline") and v}
    ratios = dict(LORA_RATIOS)  # the Unsloth ratio sits beside the option row it divides by (its faster)
    ratios[next(iter(baselines.values()), "unsloth_lora")] = ratios.pop("unsloth_lora")
    out = seq_tables(rec, link, "tokens_per_s", LORA_ORDER, ratios, "ours_lora", detail, "what it runs")
    return out + [f"- `summary.{k}`: {v}" for k, v in baselines.items()] + ([""] if baselines else [])


def rollout(rec: dict[str, Any], link: str) -> list[str]:
    """Per (batch, row kind): greedy beside sampled, the roofline fraction of both denominators (the datasheet's
    first: the primary number), HF token match."""
    rows = [r for r in rec["rows"] if "name" in r and "batch" in r]
    kinds = ordered([r["name"].removesuffix("_sampled") for r in rows], ROLLOUT_ORDER)
    summary, notes, t = rec["summary"], Notes(), Table(link)
    cols: list[tuple[str, str, str, str, Callable[[dict], Any]]] = [  # title, field, kind, mode, getter
        ("tokens/s, greedy", "rows[].tokens_per_s", "tps", "", lambda r: r.get("tokens_per_s")),
        ("tokens/s, sampled", "rows[<row>_sampled].tokens_per_s", "tps", "_sampled", lambda r: r.get("tokens_per_s")),
        ("roofline, greedy, of datasheet HBM", "rows[].roofline_fraction_datasheet", "pct", "",
         lambda r: r.get("roofline_fraction_datasheet")),
        ("roofline, sampled, of datasheet HBM", "rows[<row>_sampled].roofline_fraction_datasheet", "pct", "_sampled",
         lambda r: r.get("roofline_fraction_datasheet")),
        ("roofline, greedy, of measured copy bandwidth", "rows[].roofline_fraction", "pct", "",
         lambda r: r.get("roofline_fraction")),
        ("roofline, sampled, of measured copy bandwidth", "rows[<row>_sampled].roofline_fraction", "pct", "_sampled",
         lambda r: r.get("roofline_fraction")),
        ("greedy tokens equal to HF's", "rows[].hf_check.token_match_rate", "pct", "",
         lambda r: (r.get("hf_check") or {}).get("token_match_rate")),
        ("peak allocated GiB, greedy", "rows[].peak_mem_gb", "gib", "", lambda r: r.get("peak_mem_gb"))]
    t.col("batch", "batch")
    t.col("row", "name")
    for title, field, *_ in cols:
        t.col(title, field)
    t.col("engine ÷ HF, greedy", "summary.vs_hf_generate_bs<batch>")
    t.col("engine ÷ HF, sampled", "summary.vs_hf_generate_sampled_bs<batch>")
    for bs in sorted({r["batch"] for r in rows}):
        for kind in kinds:
            found = {m: _last(rows, name=kind + m, batch=bs) for m in ("", "_sampled")}
            if not any(found.values()):
                continue
            cells, dashed = [str(bs), kind], set()
            for _, _, fkind, mode, get in cols:
                row = found[mode]
                if row is None:
                    cells.append("")
                elif failed(row):
                    cells.append(DASH if mode in dashed else notes.dash(f"`{kind + mode}` at batch {bs}", row))
                    dashed.add(mode)
                else:
                    cells.append(fmt(fkind, get(row)))
            for tag in ("", "_sampled"):
                value = summary.get(f"vs_hf_generate{tag}_bs{bs}") if kind == "ours_paged_flex" else None
                cells.append(fmt("ratio", value) if value is not None else "")
            t.add(cells)
    t.keep([u or i < 2 for i, u in enumerate(_used(t))])
    out = [*t.render(), "", *notes.lines]
    quoted = [(k, v) for k, v in summary.items() if isinstance(v, str)
              and (k == "roofline_denominator" or k.startswith("hf_baseline"))]
    if quoted:
        out += ["" if notes.lines else None, *(f"- `summary.{k}`: {v}" for k, v in quoted)]
    return [x for x in out if x is not None]


def grpo_vs_trl(rec: dict[str, Any], link: str) -> list[str]:
    """Per row: step seconds, completion tokens/s, the phases; then the summary's TRL-over-ours ratios."""
    notes, t = Notes(), Table(link)
    phases = ("refresh_s", "generation_s", "scoring_s", "update_s")
    t.col("row", "name")
    t.col("step s, median (min–max)", "rows[].step_s_median")
    t.col("completion tokens/s", "rows[].completion_tokens_per_s")
    for p in phases:
        t.col(f"{p[:-2]} s", f"rows[].phases_s_median.{p}")
    t.col("peak allocated GiB", "rows[].peak_mem_gb")
    for row in rec["rows"]:
        name = str(row.get("name"))
        if failed(row):
            t.add([name, notes.dash(f"`{name}`", row), *[""] * (len(phases) + 2)])
            continue
        p = row.get("phases_s_median") or {}
        t.add([name, f"{fmt('s', row.get('step_s_median'))} ({fmt('s', row.get('step_s_min'))}–"
                     f"{fmt('s', row.get('step_s_max'))})", fmt("tps", row.get("completion_tokens_per_s")),
               *(fmt("s", p.get(k)) for k in phases), fmt("gib", row.get("peak_mem_gb"))])
    t.keep([u or i == 0 for i, u in enumerate(_used(t))])
    out = [*t.render(), "", *notes.lines]
    keys = [(k, w) for k, w in (("ours_vs_trl_step_speedup", "optimizer step (TRL s ÷ ours)"),
                                ("ours_vs_trl_completion_tps", "completion tokens/s (ours ÷ TRL)"),
                                ("ours_vs_trl_generation_speedup", "generation, ours with its LoRA refresh"),
                                ("ours_vs_trl_scoring_speedup", "scoring"), ("ours_vs_trl_update_speedup", "update"))
            if rec["summary"].get(k) is not None]
    if keys:
        r = Table(link)
        for key, what in keys:
            r.col(what, f"summary.{key}")
        r.add([fmt("ratio", rec["summary"][k]) for k, _ in keys])
        out += ["" if notes.lines else None, "Ours against TRL, from the same run:", "", *r.render()]
        if rec["summary"].get("trl_baseline"):  # which TRL generation option the ratios divide by
            out += ["", f"- `summary.trl_baseline`: {rec['summary']['trl_baseline']}"]
    return [x for x in out if x is not None]


def nemo_backend(rec: dict[str, Any], link: str) -> list[str]:
    """Op rows (ours vs NeMo's ms per seq, layout, mode) and step rows (tokens/s), with the summary's ratios."""
    rows, summary, notes = rec["rows"], rec["summary"], Notes()
    op = Table(link)
    for title, field in (("seq", "seq"), ("layout", "layout"), ("mode", "mode"), ("ours ms", "rows[impl=ours].ms"),
                         ("NeMo ms", "rows[impl=nemo].ms"),
                         ("NeMo ms ÷ ours", "summary.ours_vs_nemo_backend_<mode>_<layout>_<seq>")):
        op.col(title, field)
    keys = dict.fromkeys((r["seq"], r["layout"], r["mode"]) for r in rows if r.get("part") == "op" and "layout" in r)
    for seq, layout, mode in keys:
        cells = [str(seq), layout, mode]
        for impl in ("ours", "nemo"):
            row = _last(rows, part="op", impl=impl, seq=seq, layout=layout, mode=mode)
            what = f"{impl} {mode} {layout} at seq {seq}"
            if row is None:
                cells.append("")
            elif failed(row):
                cells.append(notes.dash(what, row))
            else:
                back = row.get("fallback")
                cells.append(fmt("op_ms", row.get("ms")) + (" " + notes.add(f"{what} fell back: {code(str(back))}")
                                                         if back else ""))
        key = f"ours_vs_nemo_backend_{mode.replace('+', '')}_{layout}_{seq_tag(seq)}"
        cells.append(fmt("ratio", summary[key]) if summary.get(key) is not None else "")
        op.add(cells)
    step = Table(link)
    for title, field in (("row", "row"), ("seq", "seq"), ("what it runs", "label"), ("tokens/s", "rows[].tokens_per_s"),
                         ("step ms, median (min–max)", "rows[].step_ms"),
                         ("peak allocated GiB", "rows[].peak_allocated_gb"),
                         ("ours ÷ NeMo", "summary.ours_vs_nemo_backend_step_tps_<seq>")):
        step.col(title, field)
    for row in (r for r in rows if r.get("part") == "step"):
        name, seq = str(row.get("row")), row.get("seq")
        key = f"ours_vs_nemo_backend_step_tps_{seq_tag(seq)}" if name == "ours" and isinstance(seq, int) else None
        ratio = fmt("ratio", summary[key]) if key and summary.get(key) is not None else ""
        if failed(row):
            step.add([name, str(seq), str(row.get("label", "")), notes.dash(f"step `{name}` at seq {seq}", row),
                      "", "", ratio])
            continue
        step.add([name, str(seq), str(row.get("label", "")), fmt("tps", row.get("tokens_per_s")),
                  f"{fmt('ms', row.get('step_ms'))} ({fmt('ms', row.get('step_ms_min'))}–"
                  f"{fmt('ms', row.get('step_ms_max'))})", fmt("gib", row.get("peak_allocated_gb")), ratio])
    out = []
    for title, table, fixed in (("Attention op", op, 3), ("Training step", step, 2)):
        if table.body:
            table.keep([u or i < fixed for i, u in enumerate(_used(table))])
            out += [f"{title}:", "", *table.render(), ""]
    return out + notes.lines if notes.lines else out[:-1]


# benchmark name -> (what the table compares, renderer)
CURATED: dict[str, tuple[str, Callable[[dict[str, Any], str], list[str]]]] = {
    "train_throughput": ("Training step", training),
    "full_depth_lora": ("Full-depth LoRA, one GPU", full_depth_lora),
    "rollout": ("GRPO rollouts", rollout),
    "grpo_vs_trl": ("GRPO step against TRL", grpo_vs_trl),
    "nemo_backend": ("Our FFPA backend against NeMo-Automodel's", nemo_backend),
}
