"""Context parallelism on 2 GPUs: FFPA ring vs Flex ring (swept options) vs torch's native context_parallel,
at 32k and 64k, with loss and gradient parity against an independent CP=1 reference.

Owns the run: every row is its own `torchrun --nproc_per_node N` launch (`benchmarks/row_process.py`: per-row
timeout, total `--budget-s`, the result rewritten after every row), the Flex option sweep (one row per
LARGE_HEAD_DIM_CANDIDATES entry, the summary takes the best at each seq), and the summary. What each row is
and how it is measured lives in `benchmarks/cp_rows.py` (its ROWS labels say what differs from `ffpa_ring`);
the gradient comparison in `benchmarks/cp_parity.py`.

Model: a Gemma4-31B-shaped slice, `--layers` decoder layers (6 = 5 sliding + 1 full; full layers D=512, 32 q /
4 kv heads, k_eq_v), real hidden size and vocabulary, random weights, bf16, per-layer activation checkpointing
in every row, forward + backward of the chunked linear CE, no optimizer. `--docs single` (default): one
document (torch's CP takes no mask); `--docs packed`: packed documents (the native row then records why not).
Timed rows: `--warmup` steps, then `--steps` timed ones (median, min, max), tokens/s of the CP group, peak
allocated and reserved memory (the larger rank).
Parity row (`parity`, at `--parity-seq`): the CP=1 reference is the whole sequence on rank 0 with HF's own
attention (`--reference-attn`), masks and loss, no ring code; each CP variant's loss and all-reduced gradients
are compared per parameter group (max abs, and ||g_cp - g_ref|| / ||g_ref||). A second CP=1 reference with
`--noise-attn` gives the noise floor of two correct implementations in the same dtype.

Summary: `ffpa_ring_vs_flex_ring_tps_{32k,64k}` (against the best sweep row), `ffpa_ring_vs_native_cp_tps_*`,
`cp2_vs_cp1_loss_max_abs_diff`, `cp2_vs_cp1_grad_max_rel_diff` (worst group over all variants),
`cp1_noise_floor_*`; a null key's reason is in `summary_missing`.

Run (2 H200s; each call within one 10-minute limit, the second resumes the first's file):
  python benchmarks/context_parallel.py --seqs 32768 --out $OUT/context_parallel.json --budget-s 540
  python benchmarks/context_parallel.py --seqs 65536 --no-parity --resume FILE --out $OUT/context_parallel.json
CPU smoke (2 gloo ranks, tiny preset):  python benchmarks/context_parallel.py --smoke --out /tmp/cp.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.report import results_io  # noqa: E402
from benchmarks.report.results_io import RESULTS_DIR, write_result  # noqa: E402
from benchmarks.row_process import add_run_options, fastest_row, row_at, row_main, run_rows  # noqa: E402
from lightning_ffpa.flex_options import LARGE_HEAD_DIM_CANDIDATES  # noqa: E402

SWEEP = [f"flex_ring_opt{i}" for i in range(len(LARGE_HEAD_DIM_CANDIDATES))]
TIMED = ["ffpa_ring", *SWEEP, "torch_native_cp_sdpa"]
HEADLINE_SEQS = (32768, 65536)
PARITY_KEYED = ("ffpa_ring", "flex_ring_opt0", "torch_native_cp_sdpa")  # summary keys per variant
_SHAPE_KEYS = ("preset", "layers", "dtype", "docs", "ac", "warmup", "steps", "nproc")


def tag(seq: int) -> str:
    """32768 -> '32k'; a length that is not a multiple of 1024 keeps its digits."""
    return f"{seq // 1024}k" if seq % 1024 == 0 else str(seq)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(RESULTS_DIR / "context_parallel.json"), help="result JSON path")
    p.add_argument("--seqs", type=int, nargs="+", default=list(HEADLINE_SEQS), help="global sequence lengths")
    p.add_argument("--rows", nargs="+", default=TIMED, choices=TIMED, help="timed rows, each at every seq")
    p.add_argument("--parity", action=argparse.BooleanOptionalAction, default=True, help="run the parity row first")
    p.add_argument("--parity-seq", type=int, default=8192, help="sequence length of the parity row")
    p.add_argument("--parity-variants", nargs="+", default=["ffpa_ring", "flex_ring_opt0", "torch_native_cp_sdpa"],
                   choices=TIMED, help="CP variants compared with the CP=1 reference")
    p.add_argument("--reference-attn", default="sdpa", help="HF attn_implementation of the CP=1 reference")
    p.add_argument("--noise-attn", default="eager", help="HF attn_implementation of the noise-floor reference")
    p.add_argument("--loss-tol", type=float, default=None, help="parity: max |loss diff| (default by dtype)")
    p.add_argument("--grad-rel-tol", type=float, default=None, help="parity: max relative L2 gradient diff per group")
    p.add_argument("--docs", choices=("single", "packed"), default="single", help="one document or packed ones")
    p.add_argument("--preset", default="gemma4-31b", help="presets.build_text_config preset")
    p.add_argument("--layers", type=int, default=6, help="decoder layers (the last one full attention)")
    p.add_argument("--ac", action=argparse.BooleanOptionalAction, default=True, help="per-layer activation ckpt")
    add_run_options(p, budget_s=540.0, row_timeout_s=300.0)
    p.add_argument("--nproc", type=int, default=2, help="ranks per launch (the CP size)")
    p.add_argument("--smoke", action="store_true", help="CPU, gloo, tiny preset, 2 layers, short sequences, fp32")
    args = p.parse_args(argv)
    args.dtype = "float32" if args.smoke else "bfloat16"
    if args.smoke:
        args.preset, args.layers = "tiny", 2
        args.seqs = [s for s in args.seqs if s not in HEADLINE_SEQS] or [256]
        args.parity_seq = min(args.parity_seq, 128)
    args.loss_tol = args.loss_tol if args.loss_tol is not None else (1e-4 if args.smoke else 2e-2)
    args.grad_rel_tol = args.grad_rel_tol if args.grad_rel_tol is not None else (1e-3 if args.smoke else 5e-2)
    from lightning_ffpa.errors import ConfigError

    for s in [*args.seqs, args.parity_seq]:
        if s % (2 * args.nproc):
            raise ConfigError("--seqs/--parity-seq", s, f"must be a multiple of 2 x --nproc = {2 * args.nproc}")
    if args.steps < 1 or args.warmup < 0:
        raise ConfigError("--steps", args.steps, "needs at least one timed step and no negative warmup")
    return args


def specs(args, done: set[tuple[str, int]]) -> list[dict]:
    """Row specs in run order: parity first (cheap, and it decides whether the timed rows mean anything)."""
    base = dict(preset=args.preset, layers=args.layers, dtype=args.dtype, docs=args.docs, ac=args.ac,
                warmup=args.warmup, steps=args.steps, smoke=args.smoke)
    out = []
    for i, v in enumerate(args.parity_variants if args.parity else []):  # the first one also measures the noise floor
        if (f"parity_{v}", args.parity_seq) not in done:
            out.append(dict(base, row=f"parity_{v}", name=f"parity_{v}_{args.parity_seq}", seq=args.parity_seq,
                            variant=v, reference_attn=args.reference_attn, noise_attn=args.noise_attn if i == 0
                            else None, loss_tol=args.loss_tol, grad_rel_tol=args.grad_rel_tol))
    out += [dict(base, row=r, name=f"{r}_{s}", seq=s) for s in args.seqs for r in args.rows if (r, s) not in done]
    return out


# ----------------------------------------------------------------------------- summary
def best_flex(rows: list[dict], seq: int) -> tuple[dict | None, str | None]:
    """The fastest finished Flex sweep row at `seq`, or why there is none."""
    row, why = fastest_row(rows, SWEEP, seq, "tokens_per_s")
    return row, why and f"no Flex sweep row finished: {why}"


def summarize(rows: list[dict], seqs: list[int]) -> tuple[dict, dict]:
    """Summary keys (null when a row is missing) and the reason for every null."""
    summary, missing = {}, {}

    def put(key, value, why):
        summary[key] = value
        if value is None:
            missing[key] = why or "not measured"

    for seq in sorted({*HEADLINE_SEQS, *seqs}):
        t = tag(seq)
        ffpa, why_ffpa = row_at(rows, "ffpa_ring", seq)
        flex, why_flex = best_flex(rows, seq)
        native, why_native = row_at(rows, "torch_native_cp_sdpa", seq)
        ratio = lambda a, b: a["tokens_per_s"] / b["tokens_per_s"] if a and b else None  # noqa: E731
        put(f"ffpa_ring_vs_flex_ring_tps_{t}", ratio(ffpa, flex), "; ".join(filter(None, (why_ffpa, why_flex))))
        put(f"flex_ring_best_row_{t}", flex and flex["row"], why_flex)
        put(f"ffpa_ring_vs_native_cp_tps_{t}", ratio(ffpa, native), "; ".join(filter(None, (why_ffpa, why_native))))
        put(f"ffpa_ring_tokens_per_s_{t}", ffpa and ffpa["tokens_per_s"], why_ffpa)
    ran, whys = {}, []
    for v in PARITY_KEYED:
        row, why = row_at(rows, f"parity_{v}", _parity_seq(rows, v))
        if row:
            ran[v] = row
        else:
            whys.append(why)
        put(f"cp2_vs_cp1_grad_max_rel_diff_{v}", row and row["grads"]["max_rel_l2"], why)
        put(f"cp2_vs_cp1_loss_abs_diff_{v}", row and row["loss_abs_diff"], why)
    others = [r for r in rows if r.get("row", "").startswith("parity_") and "grads" in r]
    why = "no parity row finished: " + "; ".join(whys)
    put("cp2_vs_cp1_loss_max_abs_diff", max((r["loss_abs_diff"] for r in others), default=None), why)
    put("cp2_vs_cp1_grad_max_rel_diff", max((r["grads"]["max_rel_l2"] for r in others), default=None), why)
    noise = next((r["noise_floor"] for r in others if r.get("noise_floor")), None)
    put("cp1_noise_floor_loss_abs_diff", noise and noise["loss_abs_diff"], "no parity row measured the noise floor")
    put("cp1_noise_floor_grad_max_rel_diff", noise and noise["grads"]["max_rel_l2"],
        "no parity row measured the noise floor")
    put("parity_seq", others[0]["seq"] if others else None, why)
    return summary, missing


def _parity_seq(rows: list[dict], variant: str) -> int | None:
    return next((r["seq"] for r in reversed(rows) if r.get("row") == f"parity_{variant}"), None)


def parity_failures(rows: list[dict]) -> dict[str, list[str]]:
    """Per parity row: why it misses the tolerances ([] = within them), or why it has no result."""
    return {r["row"]: r.get("failures", [str(r.get("error") or r.get("skipped"))[:300]])
            for r in rows if r.get("row", "").startswith("parity_")}


# ----------------------------------------------------------------------------- driver and child
def drive(args) -> None:
    kept, calls = results_io.load_resume(args.resume, {k: getattr(args, k) for k in _SHAPE_KEYS})
    todo = specs(args, {(r["row"], r["seq"]) for r in kept})
    out = Path(args.out)
    this_call = dict(command=" ".join([Path(sys.executable).name, *sys.argv]),
                     date=time.strftime("%Y-%m-%d %H:%M:%S"), rows=[s["name"] for s in todo])

    def save(rows: list[dict]) -> None:
        summary, missing = summarize([*kept, *rows], args.seqs)
        write_result("context_parallel", [*kept, *rows], summary, out=out, summary_missing=missing,
                     calls=[*calls, this_call], budget_s=args.budget_s, row_timeout_s=args.row_timeout_s,
                     parity_failures=parity_failures([*kept, *rows]), labels=_labels(), **{k: getattr(args, k) for k in _SHAPE_KEYS})

    save([])
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(args.nproc)]
    run_rows(Path(__file__).resolve(), todo, out.parent / f"{out.stem}_logs", args.row_timeout_s, args.budget_s,
             save, launcher=launcher)


def _labels() -> dict[str, str]:
    from benchmarks.cp_rows import ROWS

    return ROWS


def _measure(spec: dict) -> dict:
    from benchmarks.cp_rows import measure

    return measure(spec)


def main(argv: list[str] | None = None) -> None:
    if row_main(argv, _measure):  # a rank of one row's launch
        return
    drive(parse_args(argv))


if __name__ == "__main__":
    from lightning_ffpa.errors import console_entry

    sys.exit(console_entry(main, hold=False))  # a bad option: exit 2 with one line, before any row runs
