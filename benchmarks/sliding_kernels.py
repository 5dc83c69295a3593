"""FA4 against the product's Flex for Gemma4's sliding-window layers, at the op, each row in its own process.

Shape: a Gemma4-31B sliding layer: B=1, 32 q heads, 16 kv heads, head_dim 256, causal window 1024, bf16.
Layouts: `dense` (one sequence of `seq` tokens) and `varlen` (the same tokens packed as DOCS documents of unequal
seeded lengths, `document_lengths`). Each kernel is called as the product's ffpa backend calls it:
  flex                the product's compiled Flex (`attention.flex.flex_forward`, its kernel options) over the
                      product's BlockMask: `masks` sliding window (dense), `PackedDocuments.block_mask` (varlen)
  fa4                 `attention.fa4.fa4_attention` on [B,S,H,D] (dense), `fa4_varlen_attention` with the
                      documents' cu_seqlens (varlen); a row where FA4 cannot run fails with the reason
  flex_flash_backend  flex with kernel_options={"BACKEND": "FLASH"} (torch's FA4 route), recorded as it ends
Inputs are [B,S,H,D] leaves (as the projections give them); Flex gets the [B,H,S,D] views the backend gets.
A row = (kernel, layout, seq): `fwd` (forward with grad enabled, as training runs it) and `fwdbwd` (forward +
backward of q, k, v), median/min/max ms by triton.testing.do_bench (quantiles 0.5/0/1 of its repetitions),
the first fwd+bwd call's seconds (compile included), peak allocated memory over one untimed fwd+bwd, and the max abs
difference of output and dq/dk/dv from the flex row of the same layout and seq (flex rows save their results
to a temp dir the driver passes and removes).
Summary: `fa4_vs_flex_sliding_{fwd,fwdbwd}_{8k,16k,32k}` (dense) and `fa4_vs_flex_sliding_varlen_{fwd,fwdbwd}_*`:
flex ms / fa4 ms (above 1: FA4 is faster); None with the reason in `missing` when a row did not measure.

    python benchmarks/sliding_kernels.py --out $OUT/sliding_kernels.json
"""

from __future__ import annotations

import argparse
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.row_process import measured, run_rows_into  # noqa: E402
from lightning_ffpa.errors import ConfigError  # noqa: E402

HQ, HKV, D, WINDOW, DOCS = 32, 16, 256, 1024, 4
KERNELS = ("flex", "fa4", "flex_flash_backend")  # flex first: the others compare with its saved results
LAYOUTS = ("dense", "varlen")
_TAGS = {8192: "8k", 16384: "16k", 32768: "32k"}


def document_lengths(seq: int, docs: int = DOCS, seed: int = 0) -> list[int]:
    """`docs` unequal document lengths summing to `seq`, from a seeded draw (the same split every run)."""
    rng = random.Random(seed)
    weights = [rng.uniform(0.5, 1.5) for _ in range(docs)]
    lengths = [int(seq * w / sum(weights)) for w in weights[:-1]]
    return [*lengths, seq - sum(lengths)]


def packed_documents(seq: int, device: torch.device | str, docs: int = DOCS):
    """The product's `PackedDocuments` of one row of `seq` tokens split by `document_lengths`."""
    from lightning_ffpa.attention.documents import PackedDocuments

    ids = torch.cat([torch.full((n,), i, dtype=torch.long) for i, n in enumerate(document_lengths(seq, docs))])
    return PackedDocuments.from_document_ids(ids[None].to(device))


def attention_call(kernel: str, layout: str, seq: int, window: int, device: torch.device | str,
                   docs: int = DOCS) -> Callable:
    """`fn(q, k, v) -> out`, all [B,S,H,D], running `kernel` as the product's backend calls it."""
    from lightning_ffpa.attention import fa4, masks
    from lightning_ffpa.attention.flex import flex_forward

    packed = packed_documents(seq, device, docs) if layout == "varlen" else None
    if kernel == "fa4":
        if layout == "dense":
            return lambda q, k, v: fa4.fa4_attention(q, k, v, q.shape[-1] ** -0.5, window)

        def varlen(q, k, v):
            b, s = q.shape[:2]
            out = fa4.fa4_varlen_attention(*(t.reshape(b * s, *t.shape[2:]) for t in (q, k, v)), packed.cu_seqlens,
                                           packed.max_seqlen, q.shape[-1] ** -0.5, window)
            return out.view(b, s, *out.shape[1:])

        return varlen
    if packed is not None:
        block_mask = packed.block_mask(window, torch.device(device))
    else:
        block_mask = masks.build_block_mask(masks.generate_sliding_window(window), 1, seq, seq, device)
    options = {"BACKEND": "FLASH"} if kernel == "flex_flash_backend" else None  # None: the product's options

    def flex(q, k, v):
        out = flex_forward(*(t.transpose(1, 2) for t in (q, k, v)), block_mask, q.shape[-1] ** -0.5, options=options)
        return out.transpose(1, 2)  # (B, S, H, D)

    return flex


def _fa4_refusal(device: torch.device) -> str:
    from lightning_ffpa.attention import fa4, registry

    why = registry.get("fa4").why_not(D, torch.bfloat16, device, needs=("causal", "sliding_window", "gqa"))
    return f"{why} ({fa4.unavailable_detail(device)})" if why.startswith("unavailable") else why


def _bench(fn: Callable, grads: list[torch.Tensor]) -> dict[str, float]:
    import triton

    med, lo, hi = triton.testing.do_bench(fn, warmup=10, rep=300, grad_to_none=grads, quantiles=[0.5, 0.0, 1.0])
    return dict(ms=med, ms_min=lo, ms_max=hi)


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    """One (kernel, layout, seq) row on the GPU."""
    kernel, layout, seq = spec["kernel"], spec["layout"], spec["seq"]
    device = torch.device("cuda")
    if kernel == "fa4" and _fa4_refusal(device):
        raise RuntimeError(f"FA4 cannot take this call here: {_fa4_refusal(device)}")  # never a silent Flex run
    gen = torch.Generator(device).manual_seed(0)
    q, k, v = (torch.randn(1, seq, h, D, device=device, dtype=torch.bfloat16, generator=gen).requires_grad_()
               for h in (HQ, HKV, HKV))  # (B, S, H, D)
    grad_out = torch.randn(1, seq, HQ, D, device=device, dtype=torch.bfloat16, generator=gen)
    call = attention_call(kernel, layout, seq, WINDOW, device)

    def fwdbwd():
        call(q, k, v).backward(grad_out)

    row: dict[str, Any] = dict(documents=document_lengths(seq) if layout == "varlen" else [seq])
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = call(q, k, v)
    out.backward(grad_out)
    torch.cuda.synchronize()
    row["first_call_s"] = round(time.perf_counter() - t0, 2)
    results = dict(out=out.detach(), dq=q.grad.clone(), dk=k.grad.clone(), dv=v.grad.clone())
    q.grad = k.grad = v.grad = None
    del out
    ref = Path(spec["ref_dir"]) / f"{layout}_{seq}.pt"
    if kernel == "flex":
        torch.save({key: t.cpu() for key, t in results.items()}, ref)
    elif ref.exists():
        saved = torch.load(ref)
        row["max_abs_diff_vs_flex"] = {key: float((t.float() - saved[key].to(device).float()).abs().max())
                                       for key, t in results.items()}
    else:
        row["max_abs_diff_vs_flex"] = f"no flex results at {layout}/{seq} (its row did not measure)"
    del results
    torch.cuda.reset_peak_memory_stats()  # one untimed fwd+bwd: do_bench's own L2-flush buffer stays out of the peak
    fwdbwd()
    row["peak_mem_allocated_gb"] = torch.cuda.max_memory_allocated() / 2**30  # inputs and grads included
    q.grad = k.grad = v.grad = None
    row["fwd"] = _bench(lambda: call(q, k, v), [q, k, v])
    row["fwdbwd"] = _bench(fwdbwd, [q, k, v])
    row["device_name"] = torch.cuda.get_device_name()
    return row


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """flex ms / fa4 ms per layout, mode and seq; None with the reason (`missing`) where a row did not measure."""
    summary: dict[str, Any] = {}
    missing: dict[str, str] = {}

    def find(kernel: str, layout: str, seq: int) -> tuple[dict | None, str]:
        hit = [r for r in rows if (r.get("kernel"), r.get("layout"), r.get("seq")) == (kernel, layout, seq)]
        if not hit:
            return None, f"row {kernel}/{layout} at seq {seq} is not in this result"
        if not measured(hit[-1]) or "fwdbwd" not in hit[-1]:
            why = str(hit[-1].get("error") or hit[-1].get("skipped"))[:300]
            return None, f"row {kernel}/{layout} at seq {seq} has no measurement: {why}"
        return hit[-1], ""

    for layout in LAYOUTS:
        for seq, tag in _TAGS.items():
            (fa4, why_fa4), (flex, why_flex) = find("fa4", layout, seq), find("flex", layout, seq)
            for mode in ("fwd", "fwdbwd"):
                key = f"fa4_vs_flex_sliding_{'varlen_' if layout == 'varlen' else ''}{mode}_{tag}"
                summary[key] = flex[mode]["ms"] / fa4[mode]["ms"] if fa4 and flex else None
                if summary[key] is None:
                    missing[key] = "; ".join(filter(None, (why_fa4, why_flex)))
    summary["missing"] = missing
    return summary


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="result JSON path")
    p.add_argument("--seqs", type=int, nargs="+", default=[8192, 16384, 32768])
    p.add_argument("--kernels", nargs="+", default=list(KERNELS), choices=KERNELS)
    p.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=LAYOUTS)
    p.add_argument("--budget-s", type=float, default=570.0, help="the whole call ends within this many seconds")
    p.add_argument("--row-timeout-s", type=float, default=240.0, help="one row's process is killed after this")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise ConfigError("device", "cpu", "this benchmark times FA4 and compiled Flex kernels and needs a CUDA GPU")
    kernels = [k for k in KERNELS if k in args.kernels]  # flex first, whatever order was given
    ref_dir = tempfile.mkdtemp(prefix="sliding_kernels_")
    specs = [dict(name=f"{kernel}_{layout}_{seq}", kernel=kernel, layout=layout, seq=seq, ref_dir=ref_dir)
             for seq in args.seqs for layout in args.layouts for kernel in kernels]
    try:
        run_rows_into(Path(__file__).resolve(), "sliding_kernels", specs, Path(args.out), summarize,
                      args.row_timeout_s, args.budget_s)
    finally:
        shutil.rmtree(ref_dir, ignore_errors=True)


if __name__ == "__main__":
    from benchmarks.row_process import row_main
    from lightning_ffpa.errors import console_entry

    if not row_main(None, measure):
        sys.exit(console_entry(main, hold=False))
