"""Rollout benchmark on one GPU: paged flex engine vs HF generate, each row in its own process.

Model: Gemma4-31B shapes (hidden 5376, 32 heads, 16/4 kv heads, head_dim 256/512, k_eq_v, vocab 262k) at full
depth by default (`--layers`: the preset's depth, 60); `--layers 12` (10 sliding + 2 full) is the reduced-depth
ablation. `--preset gemma4-26b-a4b` is the MoE model (30 layers, 128 experts, top-8). Random
weights (normal_(0.02)), random `--prompt-len` prompts (the same ids for every row of a batch size), `--new-tokens`
without EOS. Modes: greedy, and sampling at temperature 1.0, top-p 1.0, top-k off (`--modes`), at `--batches`.

Rows (`--rows`, one process each, launched by this driver; the result file is rewritten after every row):
`ours_paged_flex` (the engine's defaults: compiled decode step, CUDA graphs), `ours_paged_flex_eager_step`
(ablation: `compile_decode=False`), `hf_generate_static` (HF `generate`, static cache, eager),
`hf_generate_static_compiled` (HF's own CUDA default for static caches: compiled decoding forward; slow to
compile at full depth, so it is left out of the default rows and is run in a call of its own), and
`hf_continuous_batching`. An engine row at a `--compile-mode` other than the default, a `--page-size` other
than 128, a `--kv-block-size`, with `--no-fuse-projections`, `--no-fuse-kv-write` or `--no-cuda-graphs` is named by
it (`ours_paged_flex_page64`, `ours_paged_flex_block128`, `ours_paged_flex_unfused`, `ours_paged_flex_kvwrite_op`,
`ours_paged_flex_nographs`), and the summary divides it by the default row of the same batch
(`<name>_vs_default_{compile,page,block,fuse,kvwrite,graphs}_bs*`).
A sampled row's name ends in `_sampled`. `vs_hf_generate_*` divides by the faster HF static-cache row
measured; when no compiled row ran or it failed, `hf_baseline_*` and `depth_note` say "eager only".

Correctness: each engine row runs HF on its first `--check-prompts` prompts for `--check-tokens` tokens:
greedy rows record the token match rate, first-divergence positions and HF's logit gap there; all rows record
the engine's logprobs against an HF forward over the engine's tokens (`hf_check`).

Roofline (see `rollout_rows.py`): `roofline_fraction_datasheet` divides by the datasheet HBM figure (the primary
number: the summary, the README and the target read it first); `roofline_fraction` by the copy bandwidth measured in
the row's own process; both bandwidths are in every row. Each is the median of the row's TIMED_SAMPLES (3) timed
rollouts, with `_min` and `_max`. On a MoE preset the primary number is `moe_decode_routed_roofline_bs*`: the
same datasheet fraction over the bytes of the experts each step's batch routed to (per layer, the union over the
rows), with `moe_decode_all_weights_roofline_bs*` (every weight once) and `moe_decode_routed_expert_fraction_bs*`
(the share of all expert bytes a step read) beside it (see `rollout_rows.py`).

    python benchmarks/rollout.py --out $OUT/rollout.json                       # full depth, ours + HF eager
    python benchmarks/rollout.py --rows hf_generate_static_compiled --modes greedy --batches 64 --out $OUT/c.json
    python benchmarks/rollout.py --merge a.json c.json --out rollout.json       # one file, summary recomputed
    python benchmarks/rollout.py --preset gemma4-26b-a4b --rows ours_paged_flex --batches 64 --out $OUT/moe.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.report import results_io  # noqa: E402
from benchmarks.report.results_io import resummarize, write_result  # noqa: E402
from benchmarks.row_process import run_rows  # noqa: E402
from lightning_ffpa.presets import PRESETS  # noqa: E402

ROWS_SCRIPT = Path(__file__).resolve().parent / "rollout_rows.py"
KINDS = ("ours_paged_flex", "ours_paged_flex_eager_step", "hf_generate_static", "hf_generate_static_compiled",
         "hf_continuous_batching")
FULL_DEPTH = {"gemma4-31b": (60, "Gemma4-31B"), "gemma4-26b-a4b": (30, "Gemma4-26B-A4B")}  # preset: (layers, name)
DEFAULT_PAGE_SIZE = 128  # EngineConfig.page_size; a row at another size is named by it


def label(kind: str, mode: str, compile_mode: str | None = None, page_size: int | None = None,
          fuse_projections: bool | None = None, kv_block_size: int | None = None,
          fuse_kv_write: bool | None = None, cuda_graphs: bool | None = None) -> str:
    """A row's name: its kind, then what differs from that kind's default row (compile mode, page size, KV block
    set, fused projections off, K/V written by the custom op, CUDA graphs off, sampling).

    Only the compiled engine row takes a compile mode or a K/V write; both engine kinds take a page size, a KV
    block and the fusion switch; HF rows ignore them all."""
    plain = kind != "ours_paged_flex" or compile_mode in (None, "default")
    tuned = "" if plain else "_" + compile_mode.replace("-", "_")
    engine = kind.startswith("ours_paged_flex")
    page = "" if not engine or page_size in (None, DEFAULT_PAGE_SIZE) else f"_page{page_size}"
    block = "" if not engine or kv_block_size is None else f"_block{kv_block_size}"
    unfused = "_unfused" if engine and fuse_projections is False else ""
    kv_op = "_kvwrite_op" if kind == "ours_paged_flex" and fuse_kv_write is False else ""
    graphs = "_nographs" if engine and cuda_graphs is False else ""
    return kind + tuned + page + block + unfused + kv_op + graphs + ("_sampled" if mode == "sample" else "")


def _variant(row: dict) -> list[str]:
    """What an engine row changes from its kind's default row: "compile", "page", "block", "fuse", "kvwrite" and/or
    "graphs" (empty: it is that row)."""
    kind, mode, plain = row["kind"], row["mode"], label(row["kind"], row["mode"])
    return [what for what, name in (("compile", label(kind, mode, compile_mode=row.get("compile_mode"))),
                                    ("page", label(kind, mode, page_size=row.get("page_size"))),
                                    ("block", label(kind, mode, kv_block_size=row.get("kv_block_size"))),
                                    ("fuse", label(kind, mode, fuse_projections=row.get("fuse_projections"))),
                                    ("kvwrite", label(kind, mode, fuse_kv_write=row.get("fuse_kv_write"))),
                                    ("graphs", label(kind, mode, cuda_graphs=row.get("cuda_graphs"))))
            if name != plain]


def build_specs(args: argparse.Namespace) -> list[dict[str, Any]]:
    """One spec per (batch, row kind, mode), engine rows first within a batch; `--only` filters by label[@batch]."""
    kinds = [k for k in args.rows.split(",") if k]
    modes = [m for m in args.modes.split(",") if m]
    batches = [int(b) for b in args.batches.split(",") if b]
    only = {o for o in (args.only or "").split(",") if o}
    common = {k: getattr(args, k) for k in ("layers", "prompt_len", "new_tokens", "preset", "device", "page_size",
                                            "bandwidth_gb", "kernel_options", "compile_mode", "fuse_projections",
                                            "kv_block_size", "fuse_kv_write", "cuda_graphs", "dtype")}
    specs = []
    for bs in batches:
        for kind in kinds:
            for mode in modes:
                name = label(kind, mode, args.compile_mode, args.page_size, args.fuse_projections,
                             args.kv_block_size, args.fuse_kv_write, args.cuda_graphs)
                if only and name not in only and f"{name}@{bs}" not in only:
                    continue
                spec = {"name": name, "kind": kind, "mode": mode, "batch": bs, **common,
                        "pipeline": not args.no_pipeline}
                if kind.startswith("ours"):
                    spec.update(check_prompts=min(args.check_prompts, bs), check_tokens=args.check_tokens,
                                do_profile=args.profile and name == "ours_paged_flex" and bs == max(batches),
                                do_lora_refresh=mode == "greedy" and kind == "ours_paged_flex"
                                and bs in {int(b) for b in args.lora_refresh_batches.split(",") if b})
                specs.append(spec)
    return specs


def _row(rows: list[dict], name: str, bs: int) -> dict:
    return next((r for r in rows if r.get("name") == name and r.get("batch") == bs and "tokens_per_s" in r), {})


def hf_baseline(rows: list[dict], bs: int, mode: str) -> tuple[float | None, str]:
    """The faster HF static-cache row at `bs` in `mode`, and what it was: "eager and compiled" or "eager only (...)"."""
    eager, comp = (_row(rows, label(k, mode), bs) for k in ("hf_generate_static", "hf_generate_static_compiled"))
    if comp:
        best = max(v["tokens_per_s"] for v in (eager, comp) if v)
        return best, "eager and compiled, the faster" if eager else "compiled only (eager HF row not run)"
    failed = next((r for r in rows if r.get("name") == label("hf_generate_static_compiled", mode)
                   and r.get("batch") == bs), None)
    why = "compiled HF row not run" if failed is None else \
        f"compiled HF row failed: {failed.get('error') or failed.get('skipped', '')}"[:160]
    return (eager.get("tokens_per_s"), f"eager only ({why})") if eager else (None, "no HF row")


def summarize(rows: list[dict]) -> dict[str, Any]:
    """Summary from the rows alone (so a run cut short or several merged runs can be summarised again)."""
    out: dict[str, Any] = {}
    for bs in sorted({r["batch"] for r in rows if "batch" in r}):
        for mode, tag in (("greedy", ""), ("sample", "_sampled")):
            ours = _row(rows, label("ours_paged_flex", mode), bs)
            if ours:
                out[f"roofline_fraction{tag}_bs{bs}"] = ours["roofline_fraction"]
                out[f"roofline_fraction_datasheet{tag}_bs{bs}"] = ours.get("roofline_fraction_datasheet")
            if "routed_roofline_fraction" in ours:  # a MoE model: the routed experts' bytes, all weights beside
                out[f"moe_decode_routed_roofline{tag}_bs{bs}"] = ours.get("routed_roofline_fraction_datasheet")
                out[f"moe_decode_routed_roofline_copy_bw{tag}_bs{bs}"] = ours["routed_roofline_fraction"]
                out[f"moe_decode_all_weights_roofline{tag}_bs{bs}"] = ours.get("roofline_fraction_datasheet")
                out[f"moe_decode_routed_expert_fraction{tag}_bs{bs}"] = ours["routed_expert_fraction"]
            best, what = hf_baseline(rows, bs, mode)
            if ours and best:
                out[f"vs_hf_generate{tag}_bs{bs}"] = ours["tokens_per_s"] / best
                out[f"hf_baseline{tag}_bs{bs}"] = what
            check = ours.get("hf_check", {})
            if "token_match_rate" in check:
                out[f"greedy_token_match_rate_bs{bs}"] = check["token_match_rate"]
                out[f"greedy_exact_prompts_bs{bs}"] = f"{check['exact_prompts']} of {check['prompts']}"
    for row in rows:  # an engine row that differs from the default (compile mode, page, KV block, fusion), against it
        changed = _variant(row) if row.get("kind") in KINDS and "mode" in row else []
        if changed and "tokens_per_s" in row:
            base, key, bs = _row(rows, label(row["kind"], row["mode"]), row["batch"]), row["name"], row["batch"]
            out[f"roofline_fraction_datasheet_{key}_bs{bs}"] = row.get("roofline_fraction_datasheet")
            out[f"roofline_fraction_{key}_bs{bs}"] = row.get("roofline_fraction")
            if base:
                out[f"{key}_vs_default_{'_'.join(changed)}_bs{bs}"] = row["tokens_per_s"] / base["tokens_per_s"]
    ours64, eager64 = _row(rows, "ours_paged_flex", 64), _row(rows, "ours_paged_flex_eager_step", 64)
    for kind, key in (("hf_generate_static", "eager"), ("hf_generate_static_compiled", "compiled")):
        hf = _row(rows, kind, 64)
        if ours64 and hf:
            out[f"vs_hf_generate_static_{key}_bs64"] = ours64["tokens_per_s"] / hf["tokens_per_s"]
    best64, _ = hf_baseline(rows, 64, "greedy")
    if ours64 and best64:
        out["hf_ceiling_bs64"] = 64 / (ours64["ideal_step_ms"] / 1e3) / best64
    if eager64:
        out["roofline_fraction_datasheet_bs64_eager_step"] = eager64.get("roofline_fraction_datasheet")
        out["roofline_fraction_bs64_eager_step"] = eager64["roofline_fraction"]
    checks = [r["hf_check"] for r in rows if "hf_check" in r]
    rates = [c["token_match_rate"] for c in checks if "token_match_rate" in c]
    if rates:
        out["greedy_token_match_rate_min"] = min(rates)
    if checks:
        out["engine_vs_hf_logprob_max_abs_diff"] = max(c["logprob_max_abs_diff"] for c in checks)
        means = [c["logprob_mean_abs_diff"] for c in checks if "logprob_mean_abs_diff" in c]
        if means:
            out["engine_vs_hf_logprob_mean_abs_diff_max"] = max(means)
    gen = [c["logprob_vs_generate_max_abs_diff"] for c in checks if "logprob_vs_generate_max_abs_diff" in c]
    if gen:  # the greedy rows: against HF generate's own logits (its cached decode path), same prefixes
        out["engine_vs_hf_generate_logprob_max_abs_diff"] = max(gen)
    floor = [c["hf_generate_vs_forward_logprob_mean_abs_diff"] for c in checks
             if "hf_generate_vs_forward_logprob_mean_abs_diff" in c]
    if floor:  # HF's own two paths on the same tokens: what bf16 alone moves
        out["hf_generate_vs_forward_logprob_mean_abs_diff_max"] = max(floor)
    bws = [r["bandwidth"] for r in rows if "bandwidth" in r]
    if bws:
        copy = statistics.median(b["copy_bytes_per_s"] for b in bws)
        sheet = bws[0].get("datasheet_bytes_per_s")
        out["copy_bandwidth_bytes_per_s"], out["datasheet_bandwidth_bytes_per_s"] = copy, sheet
        out["roofline_denominator"] = (
            f"roofline_fraction_*: measured copy bandwidth (bf16 copy, read + write bytes / s, best of 10, in each "
            f"row's own process; median {copy / 1e12:.2f} TB/s); roofline_fraction_datasheet_*: the datasheet HBM "
            f"figure ({'%.2f TB/s' % (sheet / 1e12) if sheet else 'unknown for this device'})")
    refresh = next((r for r in rows if r.get("lora_refresh_s") is not None), None)
    if refresh:
        out["lora_refresh_fraction"] = refresh["lora_refresh_s"] / refresh["total_s"]
    prof = next((r["profile"] for r in rows if isinstance(r.get("profile"), dict) and "error" not in r["profile"]), None)
    if prof:
        out["profile_gpu_busy_fraction"] = prof["gpu_busy_ms_per_step"] / prof["wall_ms_per_step"]
    out["depth_note"] = depth_note(rows, out)
    out["rows_in_own_process"] = all(r.get("process", {}).get("pid") for r in rows if "tokens_per_s" in r)
    return out


def depth_note(rows: list[dict], summary: dict[str, Any]) -> str:
    """What every headline of the file is qualified by: depth, lengths, and which HF baseline the ratios use."""
    timed = [r for r in rows if "layers" in r]
    if not timed:
        return "no rows"
    def of(n: int, preset: str) -> str:  # rows from before `preset` was recorded are 31B's
        full, name = FULL_DEPTH.get(preset, (PRESETS[preset]["num_hidden_layers"], preset))
        return f"{n} of {full} layers" + (f" (full {name} depth)" if n == full else " (reduced-depth ablation)")

    depth = "; ".join(of(n, p) for n, p in sorted({(r["layers"], r.get("preset", "gemma4-31b")) for r in timed}))
    r = timed[0]
    note = f"{depth}, {r['prompt_len']}-token prompts, {r['new_tokens']} new tokens"
    baselines = sorted({v for k, v in summary.items() if k.startswith("hf_baseline")})
    return note + (f"; HF baseline: {', '.join(baselines)}" if baselines else "")


def write(rows: list[dict], out: str | None, partial: bool, history_note: str | None = None, **extra: Any) -> Path:
    summary = summarize(rows)
    if partial:
        summary["partial"] = True
    if history_note:  # kept for comparison, not a current result: docs/benchmarks.md lists it, the README does not
        summary["history_note"] = history_note
    return write_result("rollout", rows, summary, out=out, **extra)


def merge(paths: list[str], out: str, history_note: str | None = None) -> None:
    """One result file from several runs' rows (e.g. the compiled-HF call and the main call); summary recomputed.

    The runs must share commit, device and versions (those are the merged file's); who merged is recorded apart.
    `history_note` marks the file as kept for comparison (e.g. a variant that does not ship), in its summary.
    """
    records = [results_io.read_result(p, "--merge") for p in paths]
    shared = {}
    for key in ("commit", "device", "versions"):
        seen = {json.dumps(r.get(key), sort_keys=True) for r in records}
        if len(seen) > 1:
            raise SystemExit(f"--merge: the files differ in {key} ({', '.join(sorted(seen))}); rows of different "
                             "code or machines are not one result")
        shared[key] = records[0].get(key)
    rows = [row for r in records for row in r["rows"]]
    for row in rows:  # runs before rows were named by compile mode: the name follows the row's own fields
        if row.get("kind") in KINDS and "mode" in row:
            name = label(row["kind"], row["mode"], row.get("compile_mode"), row.get("page_size"),
                         row.get("fuse_projections"), row.get("kv_block_size"), row.get("fuse_kv_write"),
                         row.get("cuda_graphs"))
            if name != row.get("name"):
                row["name_at_run"], row["name"] = row.get("name"), name
    sources = [{"file": Path(p).name, "commit": r.get("commit"), "date": r.get("date"), "command": r.get("command")}
               for p, r in zip(paths, records)]
    write(rows, out, partial=False, history_note=history_note, merged_from=sources,
          merged_by=results_io.provenance("rollout.py --merge"), **shared)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=None,
                    help="default: the preset's full depth (60 for gemma4-31b); 12 = reduced-depth ablation")
    ap.add_argument("--batches", default="16,64,128")
    ap.add_argument("--dtype", default=None, choices=["bfloat16", "float32"],
                    help="the model's dtype (default: bfloat16 on cuda, float32 on cpu); float32 on a GPU checks the "
                         "engine against HF where bf16 rounding cannot flip a token or an expert choice")
    ap.add_argument("--modes", default="greedy,sample", help="greedy and/or sample (temperature 1.0, top-p 1.0)")
    ap.add_argument("--rows", default="ours_paged_flex,hf_generate_static", help=f"row kinds, of {', '.join(KINDS)}")
    ap.add_argument("--only", default=None, help="only these labels, e.g. ours_paged_flex@64,hf_generate_static_sampled")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=512)
    ap.add_argument("--check-prompts", type=int, default=8, help="prompts each engine row checks against HF (0: off)")
    ap.add_argument("--check-tokens", type=int, default=128, help="tokens per prompt the check generates with HF")
    ap.add_argument("--lora-refresh-batches", default="64", help="greedy engine rows that also time a LoRA refresh")
    ap.add_argument("--profile", action="store_true", help="profile a few decode steps at the largest greedy batch")
    ap.add_argument("--row-timeout", type=float, default=540.0, help="seconds one row's process may run")
    ap.add_argument("--budget", type=float, default=570.0, help="seconds for all rows; rows that would start later "
                                                                "are recorded as skipped")
    ap.add_argument("--out", default=None)
    ap.add_argument("--logs", default=None, help="per-row logs (default: <out>.logs next to the result file)")
    ap.add_argument("--preset", default="gemma4-31b", help="model shape (tiny: CPU smoke test of this script)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--page-size", type=int, default=DEFAULT_PAGE_SIZE)
    ap.add_argument("--kv-block-size", type=int, default=None,
                    help="EngineConfig.kv_block_size of engine rows (the ablation row `*_block<N>`; default: the "
                    "engine's)")
    ap.add_argument("--compile-mode", default=None,
                    help="torch.compile mode of the engine's decode step (EngineConfig.compile_mode)")
    ap.add_argument("--no-fuse-projections", dest="fuse_projections", action="store_false",
                    help="engine rows with EngineConfig.fuse_projections off (the ablation row `*_unfused`)")
    ap.add_argument("--no-fuse-kv-write", dest="fuse_kv_write", action="store_false",
                    help="the compiled engine row with EngineConfig.fuse_kv_write off (the ablation row "
                    "`*_kvwrite_op`)")
    ap.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false",
                    help="engine rows with EngineConfig.cuda_graphs off (the row `*_nographs`): a float32 MoE model "
                    "cannot be captured (torch's grouped GEMM reads its offsets on the host below bf16)")
    ap.add_argument("--bandwidth-gb", type=float, default=4.0)
    ap.add_argument("--no-pipeline", action="store_true", help="read every decode step back before the next")
    ap.add_argument("--kernel-options", default=None,
                    help="JSON of flex kernel-option overrides (e.g. a benchmarks/rollout_attention.py result)")
    ap.add_argument("--summarize", default=None, metavar="PATH", help="only recompute the summary of a result file")
    ap.add_argument("--merge", nargs="+", default=None, metavar="PATH", help="merge result files into --out")
    ap.add_argument("--history-note", default=None, help="with --merge: summary.history_note, marking the merged "
                    "file as kept for comparison (left out of the README's headline)")
    args = ap.parse_args(argv)
    if args.history_note and not args.merge:
        ap.error("--history-note: only with --merge (a run's own file is a current result)")
    bad = [k for k in args.rows.split(",") if k and k not in KINDS]
    if bad:
        ap.error(f"--rows: unknown {bad}; choose from {', '.join(KINDS)}")
    bad = [m for m in args.modes.split(",") if m not in ("greedy", "sample")]
    if bad:
        ap.error(f"--modes: unknown {bad}; choose greedy and/or sample")
    if args.kernel_options:
        args.kernel_options = str(Path(args.kernel_options).resolve())
    if args.preset not in PRESETS:
        ap.error(f"--preset: unknown {args.preset!r}; choose from {', '.join(PRESETS)}")
    if args.layers is None:
        args.layers = PRESETS[args.preset]["num_hidden_layers"]
    return args


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    if args.summarize:
        return resummarize(args.summarize, summarize, by="rollout.py --summarize")
    if args.merge:
        return merge(args.merge, args.out, args.history_note)
    specs = build_specs(args)
    out = Path(args.out) if args.out else Path(__file__).resolve().parent / "results" / "rollout.json"
    logs = Path(args.logs) if args.logs else out.with_suffix(".logs")
    extra = {"driver_pid": os.getpid()}
    rows = run_rows(ROWS_SCRIPT, specs, logs, args.row_timeout, args.budget,
                    lambda done: write(done, str(out), partial=len(done) < len(specs), **extra))
    if not rows:
        write(rows, str(out), partial=False, **extra)
    print(f"{'name':36} {'bs':>4} {'tok/s':>10} {'roof.sheet':>10} {'roof.copy':>9} {'match':>6} {'peak GB':>8}  error")
    for r in rows:
        check = r.get("hf_check", {})
        print(f"{r['name']:36} {r['batch']:>4} {r.get('tokens_per_s', float('nan')):>10.1f} "
              f"{r.get('roofline_fraction_datasheet') or float('nan'):>10.3f} "
              f"{r.get('roofline_fraction') or float('nan'):>9.3f} {check.get('token_match_rate', float('nan')):>6.3f} "
              f"{r.get('peak_mem_gb', float('nan')):>8.1f}  {(r.get('error') or r.get('skipped') or '')[:80]}")
    return rows


if __name__ == "__main__":
    from lightning_ffpa.errors import console_entry

    sys.exit(console_entry(main, hold=False))  # a bad option: exit 2 with one line, before any row runs
