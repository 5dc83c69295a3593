"""Our "ffpa" HF attention backend against the FFPA backend NeMo-Automodel ships, in one harness.

NeMo's ``components/attention/ffpa_attention.py`` is read from the wheel given by ``--nemo-wheel`` at run time
(``nemo_wheel.py``) and registered as ``nemo_ffpa``; ours is ``lightning_ffpa.attention``'s "ffpa". Both are
called as HF calls them: the backend's mask function builds the mask once, then the attention function gets
``[B,H,S,D]`` transposed views of ``[B,S,H*D]`` projections.

- op:   Gemma4-31B full-attention shape (32 q / 4 kv heads, head_dim 512, bf16, scaling 1.0, causal), seqs
        8k/16k, fwd and fwd+bwd, ``dense`` (B=1, no mask) and ``padded`` (B=2, the second row's last quarter
        padded: a 2D padding mask, so both take their varlen path). CUDA-event medians of ``--iters`` after
        ``--warmup``. Numerics: max |diff| of out/dq/dk/dv between the two and each against an fp32 reference
        (the project's reference math, one head at a time). Which path ran is recorded per row (our dispatch and
        kernel counters; NeMo's own once-per-reason fallback log).
- step: the 6-layer 31B slice with ours' training recipe from ``train_rows.py`` (its ``ROWS["ours"]``,
        ``build_model``, ``build_optimizer``, ``loss_fn``), attention ours vs NeMo's; one process per row.
        The SAC must-save set holds the FFPA forward ops in both rows (both backends call the same
        ``torch.ops.ffpa_attn`` kernels), so only the HF attention function differs; NeMo's sliding layers take
        its own route (HF flex, or SDPA with ``--nemo-sliding sdpa``).
Summary: ``ours_vs_nemo_backend_fwdbwd_8k`` (dense, NeMo ms / our ms) and ``ours_vs_nemo_backend_step_tps_8k``
(our tok/s / NeMo's); a ratio is None, with the reason in ``summary_notes``, when either row failed or fell back.

    python benchmarks/nemo_backend.py --nemo-wheel .whl/nemo_automodel-0.7.0-py3-none-any.whl --out $OUT/nemo_backend.json
    CPU smoke: python benchmarks/nemo_backend.py --smoke --out /tmp/nb.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import nemo_wheel  # noqa: E402
from benchmarks.nemo_paths import fell_back, path_record, reset_paths, time_ms  # noqa: E402
from benchmarks.nemo_step import STEP_ROWS, step_child, step_rows  # noqa: E402
from benchmarks.report.results_io import read_result, write_result  # noqa: E402
from lightning_ffpa.attention import backend, kernels  # noqa: E402
from lightning_ffpa.attention.reference import _ref_bwd_math, _ref_fwd_math  # noqa: E402

SCALE = 1.0  # Gemma4's attention scaling (q/k are RMS-normed)
GPU_SHAPE = dict(hq=32, hkv=4, d=512, dtype=torch.bfloat16)
SMOKE_SHAPE = dict(hq=4, hkv=2, d=512, dtype=torch.bfloat16)
IMPLS = ("ours", "nemo")
SMOKE_DEFAULTS = dict(preset="tiny", layers=2, seqs=[128, 256], step_seqs=[64], warmup=1, iters=2, warmup_steps=1,
                      steps=2)


class _Attention(torch.nn.Module):
    """What the backends (and HF's SDPA/eager, where NeMo's falls back) read off HF's attention module."""

    is_causal = True

    def __init__(self, shape: dict, training: bool):
        super().__init__()
        self.head_dim, self.num_key_value_groups = shape["d"], shape["hq"] // shape["hkv"]
        self.scaling, self.attention_dropout = SCALE, 0.0
        self.train(training)


# ----------------------------------------------------------------------------- op level
def _lengths(layout: str, seq: int) -> list[int]:
    return [seq] if layout == "dense" else [seq, seq - seq // 4]


def _inputs(lengths: list[int], shape: dict, device, grad: bool):
    """Leaves [B,S,H*D] (the projection outputs), q/k/v as HF hands them, and the 2D padding mask (or None)."""
    batch, seq, d = len(lengths), max(lengths), shape["d"]
    gen = torch.Generator(device=device).manual_seed(0)
    leaves = [(torch.randn(batch, seq, h * d, device=device, generator=gen) * d**-0.25).to(shape["dtype"])
              .requires_grad_(grad) for h in (shape["hq"], shape["hkv"], shape["hkv"])]
    q, k, v = (x.view(batch, seq, -1, d).transpose(1, 2) for x in leaves)  # (B, H, S, D) views
    pad = torch.arange(seq, device=device)[None] < torch.tensor(lengths, device=device)[:, None]
    return leaves, (q, k, v), (None if bool(pad.all()) else pad)


def _mask(impl: str, nemo, padding, batch: int, seq: int, device):
    """The mask the backend's own HF mask function builds for a causal full-attention layer."""
    from transformers.masking_utils import causal_mask_function

    fn = backend.ffpa_mask if impl == "ours" else nemo.ffpa_mask
    return fn(batch_size=batch, q_length=seq, kv_length=seq, q_offset=0, kv_offset=0,
              mask_function=causal_mask_function, attention_mask=padding, allow_is_causal_skip=True,
              dtype=torch.bfloat16, config=None, use_vmap=False, device=device)


def _attend(impl: str, nemo, module, qkv, mask):
    fn = backend.ffpa_attention_forward if impl == "ours" else nemo.ffpa_attention_forward
    out, _ = fn(module, *qkv, mask, dropout=0.0, scaling=SCALE)
    return out.reshape(out.shape[0], out.shape[1], -1)  # what Gemma4TextAttention does next


def op_timing_row(impl, nemo, seq, layout, mode, shape, device, args) -> dict:
    lengths = _lengths(layout, seq)
    row = {"part": "op", "impl": impl, "seq": seq, "layout": layout, "mode": mode, "lengths": lengths}
    try:
        leaves, qkv, padding = _inputs(lengths, shape, device, grad=mode == "fwd+bwd")
        module = _Attention(shape, training=mode == "fwd+bwd")
        mask = _mask(impl, nemo, padding, len(lengths), seq, device)
        row["mask"] = "none" if mask is None else f"{type(mask).__name__}{list(getattr(mask, 'shape', []))}"
        reset_paths(nemo)
        if mode == "fwd":
            def run():
                with torch.no_grad():
                    _attend(impl, nemo, module, qkv, mask)
        else:
            grad = torch.randn(*leaves[0].shape, device=device, dtype=shape["dtype"])

            def run():
                torch.autograd.grad(_attend(impl, nemo, module, qkv, mask), leaves, grad)
        row.update(time_ms(run, device, args.warmup, args.iters))
    except Exception as exc:  # noqa: BLE001 - the row records the exact error, the run goes on
        row["error"] = f"{type(exc).__name__}: {exc}"[:800]
        traceback.print_exc()
    row.update(path_record(impl, nemo))  # also on error: NeMo logs its fallback before the fallback fails
    reason = fell_back(row, device)
    if reason:
        row["fallback"] = reason
    return row


@torch.no_grad()
def _reference(qkv, grad_out, lengths, shape) -> tuple[torch.Tensor, ...]:
    """fp32 out/dq/dk/dv ([B,S,H,D]) of causal attention over each row's valid tokens, one q head at a time."""
    q, k, v = (t.transpose(1, 2).float() for t in qkv)  # (B, S, H, D)
    do = grad_out.view(*q.shape[:2], shape["hq"], -1).float()
    out, dq, dk, dv = (torch.zeros_like(t) for t in (q, q, k, v))
    groups = shape["hq"] // shape["hkv"]
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")  # no TF32 in the reference
    for b, n in enumerate(lengths):
        for h in range(shape["hq"]):
            g = h // groups
            qh, kh, vh, doh = q[b:b + 1, :n, h:h + 1], k[b:b + 1, :n, g:g + 1], v[b:b + 1, :n, g:g + 1], \
                do[b:b + 1, :n, h:h + 1]
            o, lse = _ref_fwd_math(qh, kh, vh, SCALE, True)
            gq, gk, gv = _ref_bwd_math(doh, qh, kh, vh, o, lse, SCALE, True)
            out[b, :n, h], dq[b, :n, h] = o[0, :, 0], gq[0, :, 0]
            dk[b, :n, g] += gk[0, :, 0]
            dv[b, :n, g] += gv[0, :, 0]
    torch.set_float32_matmul_precision(precision)
    return out, dq, dk, dv


def numerics_row(nemo, seq, layout, shape, device) -> dict:
    """Max |diff| of out and the three input grads: ours vs NeMo, and each vs the fp32 reference."""
    lengths = _lengths(layout, seq)
    row = {"part": "numerics", "seq": seq, "layout": layout, "lengths": lengths}
    try:
        leaves, qkv, padding = _inputs(lengths, shape, device, grad=True)
        grad = torch.randn(*leaves[0].shape, device=device, dtype=shape["dtype"],
                           generator=torch.Generator(device=device).manual_seed(1))
        got = {}
        for impl in IMPLS:
            reset_paths(nemo)
            try:
                mask = _mask(impl, nemo, padding, len(lengths), seq, device)
                out = _attend(impl, nemo, _Attention(shape, training=True), qkv, mask)
                grads = torch.autograd.grad(out, leaves, grad)
                got[impl] = [t.detach().float().view(*t.shape[:2], -1, shape["d"]) for t in (out, *grads)]
            except Exception as exc:  # noqa: BLE001 - the other backend is still compared with the reference
                row[f"{impl}_error"] = f"{type(exc).__name__}: {exc}"[:800]
            row[f"{impl}_path"] = path_record(impl, nemo)
        ref = _reference(qkv, grad, lengths, shape)
        names = ("out", "dq", "dk", "dv")

        def diff(a, b):
            return {n: float((x - y).abs().max()) for n, x, y in zip(names, a, b)}

        row["max_abs_diff"] = {f"{impl}_vs_fp32": diff(got[impl], ref) for impl in got}
        if len(got) == 2:
            row["max_abs_diff"]["ours_vs_nemo"] = diff(got["ours"], got["nemo"])
        row["ref_max_abs"] = {n: float(t.abs().max()) for n, t in zip(names, ref)}
    except Exception as exc:  # noqa: BLE001
        row["error"] = f"{type(exc).__name__}: {exc}"[:800]
        traceback.print_exc()
    return row


# ----------------------------------------------------------------------------- summary and CLI
def _ok(row: dict | None) -> bool:
    return bool(row) and "error" not in row and not row.get("fallback") and not row.get("nemo_fallbacks")


def _why(row: dict | None) -> str:
    return "no row" if row is None else str(row.get("error") or row.get("fallback") or row.get("nemo_fallbacks"))


def _k(seq: int) -> str:
    return f"{seq // 1024}k" if seq % 1024 == 0 else str(seq)


def summarize(rows: list[dict]) -> tuple[dict, dict]:
    """Ratios > 1 mean ours is faster; a None ratio has its reason (error, fallback, no row) in the notes."""
    summary, notes = {}, {}

    def find(**kv):
        return next((r for r in rows if all(r.get(k) == v for k, v in kv.items())), None)

    def ratio(key: str, ours: dict | None, theirs: dict | None, value) -> None:
        ok = _ok(ours) and _ok(theirs)
        summary[key] = round(value(ours, theirs), 4) if ok else None
        if not ok:
            notes[key] = "; ".join(f"{who}: {_why(r)}" for who, r in (("ours", ours), ("nemo", theirs)) if not _ok(r))

    def op(mode, layout, seq):
        return [find(part="op", impl=i, mode=mode, layout=layout, seq=seq) for i in IMPLS]

    ratio("ours_vs_nemo_backend_fwdbwd_8k", *op("fwd+bwd", "dense", 8192), lambda a, b: b["ms"] / a["ms"])
    for seq in sorted({r["seq"] for r in rows if r.get("part") == "op"}):
        for layout in ("dense", "padded"):
            for mode, tag in (("fwd", "fwd"), ("fwd+bwd", "fwdbwd")):
                ratio(f"ours_vs_nemo_backend_{tag}_{layout}_{_k(seq)}", *op(mode, layout, seq),
                      lambda a, b: b["ms"] / a["ms"])
    for seq in sorted({r["seq"] for r in rows if r.get("part") == "step"} | {8192}):
        ratio(f"ours_vs_nemo_backend_step_tps_{_k(seq)}", find(part="step", row="ours", seq=seq),
              find(part="step", row="nemo", seq=seq), lambda a, b: a["tokens_per_s"] / b["tokens_per_s"])
    return summary, notes


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nemo-wheel", type=Path, default=nemo_wheel.DEFAULT_WHEEL, help="nemo_automodel wheel to read")
    p.add_argument("--out", default=None, help="result JSON (rewritten after every row)")
    p.add_argument("--parts", nargs="+", default=["op", "step"], choices=["op", "step"])
    p.add_argument("--seqs", type=int, nargs="+", default=[8192, 16384], help="op-level sequence lengths")
    p.add_argument("--layouts", nargs="+", default=["dense", "padded"], choices=["dense", "padded"])
    p.add_argument("--modes", nargs="+", default=["fwd", "fwd+bwd"], choices=["fwd", "fwd+bwd"])
    p.add_argument("--warmup", type=int, default=3, help="op-level untimed calls")
    p.add_argument("--iters", type=int, default=10, help="op-level timed calls (median)")
    p.add_argument("--step-rows", nargs="+", default=list(STEP_ROWS), choices=list(STEP_ROWS))
    p.add_argument("--step-seqs", type=int, nargs="+", default=[8192])
    p.add_argument("--layers", type=int, default=6, help="5 sliding + 1 full")
    p.add_argument("--preset", default="gemma4-31b")
    p.add_argument("--warmup-steps", type=int, default=3)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--nemo-sliding", default="flex", choices=["flex", "sdpa"],
                   help="NeMo's config switch for its sliding layers (flex is its default)")
    p.add_argument("--budget-s", type=float, default=540.0, help="skip rows that would start past this")
    p.add_argument("--append", action="store_true",
                   help="keep the --out file's rows of the parts not run now (op and step fit in separate calls)")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, our reference op (no timing claims)")
    p.add_argument("--child-row", help=argparse.SUPPRESS)
    p.add_argument("--child-seq", type=int, help=argparse.SUPPRESS)
    p.add_argument("--child-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for key, value in (SMOKE_DEFAULTS.items() if args.smoke else ()):
        if getattr(args, key) == p.get_default(key):  # an option given on the command line wins
            setattr(args, key, value)
    if args.child_row:
        Path(args.child_out).write_text(json.dumps(step_child(args), default=str))
        return
    deadline = time.monotonic() + args.budget_s
    device = torch.device("cpu") if args.smoke else torch.device("cuda", 0)
    shape = SMOKE_SHAPE if args.smoke else GPU_SHAPE
    rows: list[dict] = []
    extra = {"op_shape": {k: str(v) for k, v in shape.items()}, "scale": SCALE, "smoke": args.smoke}
    if args.append and args.out and Path(args.out).is_file():
        earlier = read_result(args.out, "--out")  # one line naming the option if it is no result file
        if earlier.get("benchmark") != "nemo_backend" or earlier.get("smoke") != args.smoke:
            p.error(f"`--append --out {args.out}`: not a nemo_backend result of the same mode (smoke={args.smoke})")
        now = set().union(*({"op": {"op", "numerics"}, "step": {"step"}}[part] for part in args.parts))
        rows = [r for r in earlier["rows"] if r.get("part") not in now]
        extra["earlier_runs"] = earlier.get("earlier_runs", []) + [  # whose rows were kept, recorded here
            {k: earlier.get(k) for k in ("command", "commit", "date", "device")}]

    def record(row: dict) -> None:
        rows.append(row)
        print(json.dumps({k: row.get(k) for k in ("part", "impl", "row", "seq", "layout", "mode", "ms",
                                                   "tokens_per_s", "fallback", "error") if k in row}), flush=True)
        summary, notes = summarize(rows)
        write_result("nemo_backend", rows, summary, out=args.out, summary_notes=notes, **extra)

    try:
        nemo, extra["nemo"] = nemo_wheel.load_backend(args.nemo_wheel)
    except (FileNotFoundError, AttributeError) as exc:
        p.error(str(exc))
    nemo_wheel.register(nemo)
    backend.register_ffpa()
    extra["ours_active_kernel"] = kernels.active_kernel()
    extra["nemo_cp_ring"] = nemo_wheel.probe_cp_ring(args.nemo_wheel)  # in the parent: step rows never import it
    forced = kernels.force_kernel("reference") if args.smoke else contextlib.nullcontext()
    with forced:
        for seq in args.seqs if "op" in args.parts else []:
            for layout in args.layouts:
                for mode in args.modes:
                    for impl in IMPLS:
                        if time.monotonic() > deadline:
                            record({"part": "op", "impl": impl, "seq": seq, "layout": layout, "mode": mode,
                                    "error": f"skipped: past --budget-s {args.budget_s:.0f}"})
                            continue
                        record(op_timing_row(impl, nemo, seq, layout, mode, shape, device, args))
                if time.monotonic() < deadline:
                    record(numerics_row(nemo, seq, layout, shape, device))
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    for row in step_rows(args, deadline) if "step" in args.parts else []:
        record(row)
    if not rows:
        record({"part": "none", "error": "no rows selected"})


if __name__ == "__main__":
    from lightning_ffpa.errors import console_entry

    sys.exit(console_entry(main, hold=False))  # a bad option: exit 2 with one line, before any row runs
