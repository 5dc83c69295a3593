"""Flex kernel options for Gemma4's sliding-window layers in training: an op-level sweep on one GPU.

Why: at 16k the sliding layers' Flex backward is the second-largest attention cost of ours' step, about six
times its forward (docs/performance.md), and `lightning_ffpa.flex_options` ships torch's defaults at head_dim
256 (only D > 256 was ever tuned). This script times candidate option sets before any is shipped.

Shape: a Gemma4-31B sliding layer: B=1, 32 q heads, 16 kv heads, head_dim 256, causal window 1024, bf16, the
product's BlockMask (`attention.masks`), flex compiled with static shapes as `attention/flex.py` calls it.
Rows: each candidate in CANDIDATES at each --seqs, forward+backward (gradients of q, k, v), median ms by
triton's do_bench; `max_autotune` compiles flex with inductor's max-autotune instead of fixed options. Every row
checks its output and gradients against the `torch_defaults` row (max abs difference); a candidate that
does not compile or fit is recorded with its error.
Summary: `sliding_best_vs_default_fwdbwd_{8k,16k}` (torch_defaults ms / the best row's ms) and the best row.

    python benchmarks/sliding_options.py --out $OUT/sliding_options.json
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.report.results_io import write_result  # noqa: E402
from lightning_ffpa.attention import masks  # noqa: E402
from lightning_ffpa.errors import ConfigError  # noqa: E402

HQ, HKV, D, WINDOW = 32, 16, 256, 1024


def _opts(fwd: tuple[int, int, int, int], bwd: tuple[int, int, int, int, int, int]) -> dict[str, int]:
    """(BLOCK_M, BLOCK_N, stages, warps) forward; (M1, N1, M2, N2, stages, warps) backward."""
    out = dict(zip(("fwd_BLOCK_M", "fwd_BLOCK_N", "fwd_num_stages", "fwd_num_warps"), fwd))
    out.update(zip(("bwd_BLOCK_M1", "bwd_BLOCK_N1", "bwd_BLOCK_M2", "bwd_BLOCK_N2", "bwd_num_stages",
                    "bwd_num_warps"), bwd))
    return out


# Backward tiles keep BLOCK_N1 % BLOCK_M1 == 0 and BLOCK_M2 % BLOCK_N2 == 0 (torch's backward config rule).
CANDIDATES: dict[str, dict[str, int] | None] = {
    "torch_defaults": {},  # what the product ships at head_dim 256 (BACKEND only)
    "fwd64x64s2_bwd32x64s2": _opts((64, 64, 2, 4), (32, 64, 64, 32, 2, 4)),
    "fwd128x64s2w8_bwd64x64s1w8": _opts((128, 64, 2, 8), (64, 64, 64, 64, 1, 8)),
    "fwd128x32s2_bwd32x128s1w8": _opts((128, 32, 2, 4), (32, 128, 128, 32, 1, 8)),
    "fwd64x32s3_bwd64x128s1w8": _opts((64, 32, 3, 4), (64, 128, 128, 64, 1, 8)),
    "max_autotune": None,  # inductor picks (compile mode max-autotune-no-cudagraphs)
}


def check_candidates() -> None:
    """Each fixed set satisfies the backward rule (a broken set would only fail at compile time on the GPU)."""
    for name, o in CANDIDATES.items():
        if o and (o["bwd_BLOCK_N1"] % o["bwd_BLOCK_M1"] or o["bwd_BLOCK_M2"] % o["bwd_BLOCK_N2"]):
            raise ValueError(f"candidate {name}: backward tiles break BLOCK_N1 % BLOCK_M1 == 0 or "
                             f"BLOCK_M2 % BLOCK_N2 == 0: {o}")


def _flex(name: str):
    from torch.nn.attention.flex_attention import flex_attention

    if CANDIDATES[name] is None:
        return torch.compile(flex_attention, dynamic=False, mode="max-autotune-no-cudagraphs"), None
    return torch.compile(flex_attention, dynamic=False), {"BACKEND": "TRITON", **CANDIDATES[name]}


def measure(name: str, seq: int, reference: dict | None) -> dict:
    """One candidate at one length: fwd+bwd median ms and its difference from the reference row's results."""
    import triton

    torch.compiler.reset()  # a fresh compile per row: options are part of the graph
    gen = torch.Generator("cuda").manual_seed(0)
    q, k, v = (torch.randn(1, h, seq, D, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
               for h in (HQ, HKV, HKV))
    grad_out = torch.randn(1, HQ, seq, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    block_mask = masks.build_block_mask(masks.generate_sliding_window(WINDOW), 1, seq, seq, "cuda")
    fn, options = _flex(name)

    def step():
        out = fn(q, k, v, block_mask=block_mask, scale=D**-0.5, enable_gqa=True, kernel_options=options)
        out.backward(grad_out)
        return out

    t0 = time.perf_counter()
    out = step()
    row = dict(row=name, seq=seq, options=options, compile_s=round(time.perf_counter() - t0, 1))
    results = dict(out=out.detach(), dq=q.grad.clone(), dk=k.grad.clone(), dv=v.grad.clone())
    for t in (q, k, v):
        t.grad = None
    row["ms"] = float(triton.testing.do_bench(step, warmup=10, rep=300, return_mode="median",
                                              grad_to_none=[q, k, v]))
    if reference is not None:
        row["max_abs_diff_vs_defaults"] = {key: float((results[key] - reference[key]).abs().max())
                                           for key in results}
    row["_results"] = results
    return row


def summarize(rows: list[dict], seqs: list[int]) -> dict:
    summary: dict = {}
    for seq in seqs:
        done = [r for r in rows if r["seq"] == seq and "ms" in r]
        default = next((r["ms"] for r in done if r["row"] == "torch_defaults"), None)
        best = min(done, key=lambda r: r["ms"], default=None)
        tag = f"{seq // 1024}k"
        summary[f"sliding_best_vs_default_fwdbwd_{tag}"] = default / best["ms"] if default and best else None
        summary[f"sliding_best_row_{tag}"] = best["row"] if best else None
    return summary


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="result JSON path")
    p.add_argument("--seqs", type=int, nargs="+", default=[8192, 16384])
    p.add_argument("--rows", nargs="+", default=list(CANDIDATES), choices=list(CANDIDATES))
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise ConfigError("device", "cpu", "this sweep times compiled Triton kernels and needs a CUDA GPU")
    check_candidates()
    rows: list[dict] = []
    for seq in args.seqs:
        reference = None
        for name in ["torch_defaults", *[r for r in args.rows if r != "torch_defaults"]]:
            try:
                row = measure(name, seq, reference)
                results = row.pop("_results")
                reference = reference or results
            except Exception as exc:  # noqa: BLE001 - a set that does not compile or fit is a result
                row = dict(row=name, seq=seq, options=CANDIDATES[name],
                           error=f"{type(exc).__name__}: {exc}"[:400], trace=traceback.format_exc()[-1500:])
            rows.append(row)
            print(f"{name:32s} {seq:6d} {row.get('ms', row.get('error'))!s:.60s}", flush=True)
            write_result("sliding_options", rows, summarize(rows, args.seqs), out=args.out,
                         shape=dict(B=1, Hq=HQ, Hkv=HKV, D=D, window=WINDOW, dtype="bfloat16"))
            torch.cuda.empty_cache()


if __name__ == "__main__":
    from lightning_ffpa.errors import console_entry

    sys.exit(console_entry(main, hold=False))
