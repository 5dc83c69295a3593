"""Flex decode kernel-option sweep at the rollout benchmark's shapes: time, bandwidth and error per option set.

For each Gemma4-31B layer kind (sliding: head_dim 256, 16 kv heads; full: head_dim 512, 4 kv heads; both
32 q heads, bf16) it builds a paged KV pool and decode BlockMasks exactly as the engine does (PageTable with a
scrambled free list, `logical_block_mask` + `decode_block_mask`, padded rows on slot 0), then calls
`paged_attention` (the engine's attention entry point) with a compiled `flex_attention` under each candidate
option set, installed through `set_kernel_options` as an engine user would. Per candidate and context:
time per call (CUDA-graph replay, as the engine replays decode), achieved bandwidth (the K+V bytes the real
rows need, window-capped, over the time), max abs error against `dense_reference` (fp32), and the error
string when flex refuses to compile or launch. Padded rows must come back finite and zero.

Candidates per head_dim: the built-in options, flex's defaults (None), a BLOCK_N x num_stages x num_warps
grid (sets whose K/V tiles cannot fit shared memory are recorded as skipped, not compiled), then SPLIT_KV and
USE_TMA on top of the best grid entry (flex quietly drops USE_TMA when the inputs miss TMA alignment).
Never ROWS_GUARANTEED_SAFE nor BLOCKS_ARE_CONTIGUOUS.

The summary's `kernel_options` is what `lightning_ffpa.rollout.attention.load_kernel_options(path)` reads
(and `benchmarks/rollout.py --kernel-options PATH`): the fastest valid set per head_dim, or the built-in one
unless the fastest beats it by `--min-speedup`.

    python benchmarks/rollout_attention.py --out $OUT/rollout_attention.json
    python benchmarks/rollout_attention.py --device cpu --tiny   # CPU smoke (eager flex, two candidates)
"""

from __future__ import annotations

import argparse
import gc
import itertools
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.nn.attention.flex_attention import flex_attention

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.report.results_io import write_result  # noqa: E402
from lightning_ffpa.dtypes import parse_dtype  # noqa: E402
from lightning_ffpa.rollout import attention as attn  # noqa: E402
from lightning_ffpa.rollout.engine import EngineConfig  # noqa: E402
from lightning_ffpa.rollout.masks import decode_block_mask, logical_block_mask  # noqa: E402
from lightning_ffpa.rollout.page_table import PageTable  # noqa: E402


@dataclass(frozen=True)
class LayerKind:
    """One attention layer shape as decode sees it."""

    name: str
    head_dim: int
    kv_heads: int
    window: int | None
    layers: int  # how many of these a decode step runs (to report ms per step)


GEMMA4_31B = (LayerKind("sliding", 256, 16, 1024, 10), LayerKind("full", 512, 4, None, 2))
TINY = (LayerKind("sliding", 32, 2, 16, 2), LayerKind("full", 64, 1, None, 1))


@dataclass
class Case:
    """One (layer kind, context) decode input with its reference output and byte counts."""

    context: int
    query: torch.Tensor  # (B, Hq, 1, D), strided like HF's transposed projection
    block_mask: Any
    ref: torch.Tensor  # (B, 1, Hq, D) fp32, what paged_attention returns
    num_real: int
    needed_bytes: int  # K+V bytes the real rows' mask allows (window-capped)
    paged_bytes: int  # K+V bytes of every KV block the mask lists (what the kernel loads)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _free(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


# ---- candidates -----------------------------------------------------------------------------------
def smem_limit(device: str) -> int:
    """Opt-in shared memory per block (bytes); H200: 227 KB."""
    if device != "cuda":
        return 1 << 30
    props = torch.cuda.get_device_properties(0)
    return getattr(props, "shared_memory_per_block_optin", 232448)


def smem_estimate(head_dim: int, block_n: int, num_stages: int, elem: int, block_m: int = 16) -> int:
    """Q tile plus `num_stages` K and V tiles: the buffers a pipelined decode loop keeps resident."""
    return elem * head_dim * (block_m + 2 * block_n * num_stages)


def grid_candidates(head_dim: int, dtype: torch.dtype, limit: int, kv_block: int, tiny: bool):
    """(name, options, skip reason or None) for the built-ins, flex defaults and the tile grid."""
    out = [("builtin", attn.builtin_kernel_options(head_dim, True, dtype), None), ("flex_defaults", None, None)]
    if tiny:
        return out + [("bn16_s1_w4", {"BLOCK_N": 16, "num_stages": 1, "num_warps": 4}, None)]
    elem = torch.finfo(dtype).bits // 8
    # likeliest winners first, in case --budget-s cuts the grid: pipelined loads (2-3 stages), mid tiles
    block_ns = (32, 16, 64) if head_dim > 256 else (64, 32, 128)
    for stages, bn, warps in itertools.product((2, 3, 1), block_ns, (4, 8)):
        opts = {"BLOCK_N": bn, "num_stages": stages, "num_warps": warps}
        need = smem_estimate(head_dim, bn, stages, elem)
        skip = None
        if kv_block % bn:
            skip = f"the KV block {kv_block} is not a multiple of BLOCK_N {bn}"
        elif need > limit:
            skip = f"estimated shared memory {need // 1024} KB > {limit // 1024} KB"
        out.append((f"bn{bn}_s{stages}_w{warps}", opts, skip))
    return out


def followup_candidates(best: dict[str, Any] | None) -> list[tuple[str, dict[str, Any], None]]:
    """SPLIT_KV and TMA on top of the best grid entry (flex reads both for decode)."""
    base = dict(best or {})
    return [(f"best+split{s}", {**base, "SPLIT_KV": s}, None) for s in (2, 4)] + \
           [("best+tma", {**base, "USE_TMA": True}, None)]


def _canon(options: dict[str, Any] | None) -> tuple:
    return tuple(sorted((options or {}).items())) if options is not None else ("<defaults>",)


# ---- inputs ---------------------------------------------------------------------------------------
def build_cases(kind: LayerKind, contexts: list[int], batch: int, padded: int, page_size: int, kv_block: int,
                q_heads: int, dtype: torch.dtype, device: str, ref_chunk: int, seed: int = 0):
    """Pools shared by every context (same shapes: one compile per candidate) and one Case per context."""
    g = torch.Generator().manual_seed(seed)
    real = batch - padded
    max_len = -(-max(contexts) // page_size) * page_size
    blocks = max_len // page_size
    num_pages = real * blocks + 2
    pool = num_pages * page_size
    shape = (1, kind.kv_heads, pool, kind.head_dim)
    k_pool = torch.randn(shape, generator=g).to(device, dtype)
    v_pool = torch.randn(shape, generator=g).to(device, dtype)
    k32, v32 = k_pool.float(), v_pool.float()
    logical = logical_block_mask(max_len, kv_block, kind.window, device)
    elem = k_pool.element_size()
    per_tok = 2 * kind.kv_heads * kind.head_dim * elem
    cases = []
    for ctx in contexts:
        pt = PageTable(num_pages, page_size, real + 1, blocks, device)
        lo = max(1, ctx - page_size // 2)
        lens = torch.randint(lo, ctx + 1, (real,), generator=g).tolist()  # rows end at different page offsets
        slots = pt.fill_scrambled(lens, g)  # pages not consecutive, as in a running engine
        slot_t = torch.tensor(slots + [0] * padded, device=device)
        pos_t = torch.tensor([n - 1 for n in lens] + [0] * padded, device=device)
        bm = decode_block_mask(logical, pt.table, pt.owner, slot_t, pos_t, page_size, kv_block, kind.window)
        # q ~ N(0, 1/D) so scores ~ N(0, 1) at scale 1 (Gemma4's): a spread softmax, where a missed or extra
        # page moves the output far more than bf16 rounding does (a near one-hot softmax would hide it)
        q = (torch.randn(batch, 1, q_heads, kind.head_dim, generator=g) * kind.head_dim ** -0.5)
        q = q.to(device, dtype).transpose(1, 2)  # (B, Hq, 1, D), strided like HF's transposed projection
        ref = torch.empty(batch, q_heads, 1, kind.head_dim, dtype=torch.float32, device=device)
        for c in range(0, batch, ref_chunk):  # chunks: SDPA's GQA path materialises K/V per query head
            sl = slice(c, c + ref_chunk)
            bm_c = decode_block_mask(logical, pt.table, pt.owner, slot_t[sl], pos_t[sl], page_size, kv_block,
                                     kind.window)
            ref[sl] = attn.dense_reference(q[sl].float(), k32, v32, block_mask=bm_c, scale=1.0, enable_gqa=True)
        window = kind.window or max_len
        needed = sum(min(n, window) for n in lens) * per_tok
        listed = bm.kv_num_blocks[:real].sum() + (bm.full_kv_num_blocks[:real].sum()
                                                   if bm.full_kv_num_blocks is not None else 0)
        cases.append(Case(ctx, q, bm, ref.transpose(1, 2), real, needed, int(listed) * kv_block * per_tok))
    del k32, v32
    return k_pool, v_pool, cases


# ---- timing ---------------------------------------------------------------------------------------
def time_call(fn, device: str, iters: int, warmup: int) -> tuple[float, str]:
    """Seconds per call: CUDA-graph replay on GPU (as the engine replays decode), a plain loop on CPU."""
    if device != "cuda":
        t = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t) / iters, "eager_loop"
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(warmup):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / iters, "cuda_graph"


def run_candidate(kind: LayerKind, name: str, options, k_pool, v_pool, cases: list[Case], args,
                  dtype: torch.dtype) -> list[dict[str, Any]]:
    """One option set over every context: install it, compile once, check and time each context."""
    attn.reset_kernel_options()
    torch.compiler.reset()  # a fresh compile per candidate: no recompile limit, no stale kernels
    attn.set_kernel_options(kind.head_dim, True, options, dtype)
    flex = torch.compile(flex_attention, dynamic=False) if args.compile else flex_attention
    module = torch.nn.Module()
    module.sliding_window = kind.window
    rows, failed = [], None
    for case in cases:
        row = {"name": f"{kind.name}_d{kind.head_dim}", "kind": kind.name, "head_dim": kind.head_dim,
               "kv_heads": kind.kv_heads, "window": kind.window, "context": case.context,
               "batch": case.query.shape[0], "padded_rows": case.query.shape[0] - case.num_real,
               "candidate": name, "options": options, "attention_path": "flex_compiled" if args.compile else
               "flex_eager", "needed_kv_bytes": case.needed_bytes, "paged_kv_bytes": case.paged_bytes}
        if failed is not None:  # same shapes, same compiled kernel: a compile/launch failure repeats
            row.update(error=f"not run: failed at context {failed}", valid=False)
            rows.append(row)
            continue
        try:
            ctx = attn.StepContext({kind.window: case.block_mask}, decode=True, flex=flex)

            def call(ctx=ctx, case=case):
                return attn.paged_attention(module, case.query, k_pool, v_pool, ctx, scaling=1.0,
                                            sliding_window=kind.window)[0]

            _sync(args.device)
            t0 = time.perf_counter()
            out = call()
            _sync(args.device)
            row["first_call_s"] = time.perf_counter() - t0  # includes the compile on the first context
            real, pad = out[:case.num_real].float(), out[case.num_real:]
            row["finite"] = bool(torch.isfinite(out).all())
            row["padded_rows_zero"] = bool((pad == 0).all()) if pad.numel() else True
            row["max_abs_err"] = float((real - case.ref[:case.num_real]).abs().max())
            row["ref_max_abs"] = float(case.ref.abs().max())
            row["valid"] = row["finite"] and row["padded_rows_zero"] and row["max_abs_err"] <= args.atol
            sec, how = time_call(call, args.device, args.iters, args.warmup)
            row.update(us_per_call=sec * 1e6, timing=how, bandwidth_gb_s=case.needed_bytes / sec / 1e9,
                       paged_bandwidth_gb_s=case.paged_bytes / sec / 1e9)
        except Exception as err:  # noqa: BLE001 - a refused option set is a result, not a crash
            row["error"] = f"{type(err).__name__}: {str(err)[:400]}"
            row["valid"] = False
            failed = case.context
            if args.verbose:
                traceback.print_exc()
        rows.append(row)
    return rows


def _mean_us(rows: list[dict[str, Any]]) -> float | None:
    """Mean time over contexts if the set was valid at every context."""
    if not rows or not all(r.get("valid") and "us_per_call" in r for r in rows):
        return None
    return sum(r["us_per_call"] for r in rows) / len(rows)


def sweep_kind(kind: LayerKind, args, dtype: torch.dtype, deadline: float) -> tuple[list[dict], dict]:
    """All candidates for one layer kind (no new compile after `deadline`); returns rows and its summary entry."""
    k_pool, v_pool, cases = build_cases(kind, args.contexts, args.batch, args.padded, args.page_size,
                                        args.kv_block, args.q_heads, dtype, args.device, args.ref_chunk)
    rows, by_name, seen = [], {}, set()
    queue = grid_candidates(kind.head_dim, dtype, smem_limit(args.device), args.kv_block, args.tiny)
    followed = args.tiny
    while queue or not followed:
        if not queue:  # grid done: SPLIT_KV / TMA on top of the best valid grid entry
            followed = True
            valid = [(us, opts) for opts, us, _ in by_name.values() if us is not None]
            queue = followup_candidates(min(valid, key=lambda v: v[0])[1]) if valid else []
            continue
        name, options, skip = queue.pop(0)
        key = _canon(options)
        if key in seen:
            continue  # e.g. built-ins == flex defaults at head_dim 256
        seen.add(key)
        if skip is None and time.perf_counter() > deadline:
            skip = "this kind's share of --budget-s is spent"
        if skip is not None:
            rows.append({"name": f"{kind.name}_d{kind.head_dim}", "kind": kind.name, "head_dim": kind.head_dim,
                         "candidate": name, "options": options, "skipped": skip, "valid": False})
            continue
        cand_rows = run_candidate(kind, name, options, k_pool, v_pool, cases, args, dtype)
        rows += cand_rows
        by_name[name] = (options, _mean_us(cand_rows), cand_rows)
        _free(args.device)
    attn.reset_kernel_options()
    builtin = by_name.get("builtin", (None, None, []))
    valid = {n: v for n, v in by_name.items() if v[1] is not None}
    entry: dict[str, Any] = {"head_dim": kind.head_dim, "num_candidates": len(by_name),
                             "num_valid": len(valid), "builtin_options": builtin[0], "builtin_us": builtin[1]}
    if valid:
        best = min(valid, key=lambda n: valid[n][1])
        opts, us, brows = valid[best]
        entry.update(best=best, best_options=opts, best_us=us,
                     best_bandwidth_gb_s=sum(r["bandwidth_gb_s"] for r in brows) / len(brows),
                     speedup_vs_builtin=builtin[1] / us if builtin[1] else None,
                     ms_per_step_builtin=builtin[1] * kind.layers / 1e3 if builtin[1] else None,
                     ms_per_step_best=us * kind.layers / 1e3)
    del k_pool, v_pool, cases
    _free(args.device)
    return rows, entry


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64, help="decode rows, padded rows included")
    ap.add_argument("--padded", type=int, default=2, help="rows that are padding (slot 0, fully masked)")
    ap.add_argument("--contexts", default="512,768", help="context lengths (each row ends in the last half page)")
    ap.add_argument("--page-size", type=int, default=128)
    ap.add_argument("--kv-block", type=int, default=None,
                    help="the decode masks' KV block (EngineConfig.kv_block_size; default: the engine's for the page)")
    ap.add_argument("--q-heads", type=int, default=32)
    ap.add_argument("--kinds", default="sliding,full", help="which layer kinds to sweep")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes and three candidates (CPU smoke test)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--atol", type=float, default=5e-3,
                    help="max abs error vs dense_reference for a valid set (bf16 rounding gives ~1e-3 here; "
                    "one page of 5 missed moves some outputs by ~0.3)")
    ap.add_argument("--min-speedup", type=float, default=1.02,
                    help="summary.kernel_options keeps the built-in set unless the best beats it by this factor")
    ap.add_argument("--budget-s", type=float, default=180.0,
                    help="seconds of sweeping after which no new candidate is compiled (skips are recorded)")
    ap.add_argument("--ref-chunk", type=int, default=2, help="rows per dense_reference call (SDPA's GQA path "
                    "copies K/V per q head: 2 rows at head_dim 512 is ~6 GB)")
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    args.contexts = [int(c) for c in str(args.contexts).split(",")]
    if args.kv_block is None:
        args.kv_block = EngineConfig(page_size=args.page_size).decode_block
    if args.kv_block < 1 or args.page_size % args.kv_block:
        raise ValueError(f"`--kv-block={args.kv_block}` must divide `--page-size={args.page_size}`")
    args.compile = args.device == "cuda"  # the engine compiles flex on CUDA and runs it eagerly on CPU
    dtype = parse_dtype("--dtype", args.dtype, allow_auto=False)
    kinds = [k for k in (TINY if args.tiny else GEMMA4_31B) if k.name in args.kinds.split(",")]
    if not kinds:
        raise ValueError(f"`--kinds={args.kinds}` names none of sliding, full")
    if args.padded >= args.batch:
        raise ValueError(f"`--padded={args.padded}` must be smaller than `--batch={args.batch}`")
    t_start = time.perf_counter()
    rows, per_kind = [], {}
    with torch.inference_mode():  # as the engine: no autograd tracing in compiled flex
        for i, kind in enumerate(kinds):
            # each kind gets an equal share of what is left, so a slow first kind cannot starve the second
            left = args.budget_s - (time.perf_counter() - t_start)
            deadline = time.perf_counter() + left / (len(kinds) - i)
            try:
                kind_rows, entry = sweep_kind(kind, args, dtype, deadline)
                rows += kind_rows
                per_kind[f"{kind.name}_d{kind.head_dim}"] = entry
            except Exception as err:  # noqa: BLE001 - e.g. OOM building one kind's pools
                rows.append({"name": f"{kind.name}_d{kind.head_dim}", "error": f"{type(err).__name__}: {err}"})
                traceback.print_exc()
            finally:
                attn.reset_kernel_options()
    summary: dict[str, Any] = {"per_kind": per_kind, "wall_s": time.perf_counter() - t_start}
    summary["kernel_options"] = [
        {"head_dim": e["head_dim"], "decode": True, "dtype": args.dtype,
         "options": e["builtin_options"] if (e.get("speedup_vs_builtin") or 2) < args.min_speedup
         else e["best_options"]}
        for e in per_kind.values() if "best_options" in e]
    steps = [e for e in per_kind.values() if e.get("ms_per_step_builtin") is not None]
    if len(steps) == len(kinds) and steps:
        summary["flex_ms_per_step_builtin"] = sum(e["ms_per_step_builtin"] for e in steps)
        summary["flex_ms_per_step_best"] = sum(e["ms_per_step_best"] for e in steps)
    summary["shape_note"] = (f"batch {args.batch} ({args.padded} padded), contexts {args.contexts}, "
                             f"page {args.page_size}, KV block {args.kv_block}, {args.q_heads} q heads, {args.dtype}")
    write_result("rollout_attention", rows, summary, out=args.out)
    print(f"{'kind':12} {'ctx':>5} {'candidate':16} {'us/call':>9} {'GB/s':>7} {'max_err':>8}  valid / error")
    for r in rows:
        note = r.get("error") or r.get("skipped") or ("ok" if r.get("valid") else "INVALID")
        print(f"{r.get('name', ''):12} {r.get('context', ''):>5} {r.get('candidate', ''):16} "
              f"{r.get('us_per_call', float('nan')):>9.1f} {r.get('bandwidth_gb_s', float('nan')):>7.0f} "
              f"{r.get('max_abs_err', float('nan')):>8.1e}  {str(note)[:70]}")
    return {"rows": rows, "summary": summary}


if __name__ == "__main__":
    main()
