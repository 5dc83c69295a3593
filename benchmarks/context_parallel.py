"""Ring context parallelism on 2 GPUs: FFPA ring vs Flex ring tokens/s at 16k packed, and cp=2 vs cp=1 parity.

Run: ``torchrun --nproc_per_node 2 benchmarks/context_parallel.py --out $OUT/context_parallel.json``

Rows (each one failing is recorded with its error, never kills the run):
- ``attn_*``: one Gemma4-31B full-attention layer's attention alone (32 q heads, 4 kv heads, D=512), packed
  documents, forward+backward through the ring: FFPA blocks vs Flex blocks.
- ``model_*``: a Gemma4-31B-shaped slice (``--layers`` decoder layers: 5 sliding + 1 full, real hidden size
  and vocabulary, random N(0, 0.02) weights, bf16, no FSDP/optimizer), forward+backward of the token-mean
  loss. Sliding layers use Flex in both rows (halo); only the full-attention blocks differ.
- ``parity_cp1``: the same slice, whole sequence on each GPU alone (ring of one), forward loss, against the
  cp=2 losses. Flex ring rows recompute each block's forward in backward (see lightning_ffpa/cp/flex_blocks.py).
Summary: ``ffpa_ring_vs_flex_ring_tps_16k`` (model slice), ``ffpa_ring_vs_flex_ring_attn_tps_16k``,
``cp2_vs_cp1_loss_max_abs_diff``.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.results_io import write_result  # noqa: E402
from lightning_ffpa.attention import kernels  # noqa: E402
from lightning_ffpa.cp import IGNORE_INDEX, cp_loss_reduce, shard_batch  # noqa: E402
from lightning_ffpa.cp.ring import RingAttention, install_ring  # noqa: E402


def packed_batch(seq_len: int, vocab: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """One row of packed documents (lengths 512..4096) with per-document positions; same on every rank."""
    g = torch.Generator().manual_seed(seed)
    lengths, total = [], 0
    while total < seq_len:
        n = min(int(torch.randint(512, 4097, (1,), generator=g)), seq_len - total)
        lengths.append(n)
        total += n
    docs = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    ids = torch.randint(0, vocab, (1, seq_len), generator=g)
    return {"input_ids": ids, "document_ids": docs, "position_ids": pos}


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a gloo smoke run of the script's logic only


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    dist.barrier()


def timed(fn, warmup: int, iters: int) -> float:
    """Mean seconds per call after warmup, synchronized across the group."""
    for _ in range(warmup):
        fn()
    _sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    _sync()
    return (time.perf_counter() - t0) / iters


def attn_row(kind: str, args, rank: int, world: int, group) -> dict:
    """Attention-only: a 31B full layer (32 q heads, 4 kv heads, D=512) through the ring, fwd+bwd."""
    s = args.seq_len
    batch = packed_batch(s, 1000)
    shard = shard_batch(batch, rank, world)
    layout = shard["ring_layout"]
    g = torch.Generator(device=DEVICE).manual_seed(rank)
    local = s // world
    mk = lambda h: torch.randn(1, local, h, 512, device=DEVICE, dtype=torch.bfloat16, generator=g)  # noqa: E731
    hq, hkv = args.attn_heads
    q, k, v = (t.requires_grad_() for t in (mk(hq), mk(hkv), mk(hkv)))
    ring = RingAttention(group, block_ops=kind)

    def step():
        out = ring.full(q, k, v, layout, 512 ** -0.5)  # random q/k: the usual scale keeps logits sane
        out.backward(torch.ones_like(out))

    sec = timed(step, args.warmup, args.iters)
    return {"row": f"attn_{kind}_ring_cp{world}", "seq_len": s, "ms": round(sec * 1e3, 3),
            "tokens_per_s": round(s / sec, 1), "blocks": dict(ring.stats)}


def build_model(args):
    from transformers import Gemma4ForCausalLM

    from lightning_ffpa.presets import build_text_config

    cfg = build_text_config(args.preset, num_hidden_layers=args.layers)
    with torch.device(DEVICE):
        model = Gemma4ForCausalLM(cfg).to(torch.bfloat16)
    torch.manual_seed(0)  # same weights on every rank; initialise for real (cuda construction may not)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2:
                p.normal_(0.0, 0.02)
            elif "norm" in name or "scalar" in name:
                p.fill_(1.0)
            else:
                p.zero_()
    return model, cfg


def loss_of(model, shard) -> torch.Tensor:
    out = model(input_ids=shard["input_ids"], position_ids=shard["position_ids"], ring_layout=shard["ring_layout"])
    return F.cross_entropy(out.logits.flatten(0, 1).float(), shard["shift_labels"].flatten(),
                           ignore_index=IGNORE_INDEX, reduction="sum")


def model_row(kind: str, model, cfg, args, rank: int, world: int, group) -> dict:
    """Gemma4-31B-shaped slice, fwd+bwd of the global token-mean loss over the CP group."""
    batch = packed_batch(args.seq_len, cfg.vocab_size)
    shard = {k: (v.to(DEVICE) if torch.is_tensor(v) else v) for k, v in shard_batch(batch, rank, world).items()}
    ring = install_ring(model, group, block_ops=kind)
    losses = []

    def step():
        model.zero_grad(set_to_none=True)
        loss = cp_loss_reduce(loss_of(model, shard), shard["num_tokens"], group)
        loss.backward()
        losses.append(loss.item())

    sec = timed(step, args.warmup, args.iters)
    peak = torch.cuda.max_memory_allocated() / 2**30 if DEVICE == "cuda" else 0.0
    return {"row": f"model_{kind}_ring_cp{world}", "layers": args.layers, "seq_len": args.seq_len,
            "ms": round(sec * 1e3, 2), "tokens_per_s": round(args.seq_len / sec, 1), "loss": losses[0],
            "peak_mem_gib": round(peak, 2), "stats": dict(ring.stats)}


def parity_row(model, cfg, args, rank: int, world: int) -> dict:
    """The whole sequence on this GPU alone (a ring of one), forward loss for the cp=2 comparison."""
    solo = [dist.new_group([r]) for r in range(world)][rank]  # every rank must create every group
    batch = packed_batch(args.seq_len, cfg.vocab_size)
    shard = {k: (v.to(DEVICE) if torch.is_tensor(v) else v) for k, v in shard_batch(batch, 0, 1).items()}
    install_ring(model, solo, block_ops="ffpa")
    with torch.no_grad():
        loss = (loss_of(model, shard) / shard["num_tokens"]).item()
    return {"row": "parity_cp1", "seq_len": args.seq_len, "loss": loss}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="result JSON path (default benchmarks/results/context_parallel.json)")
    p.add_argument("--seq-len", type=int, default=16384, help="global packed sequence length")
    p.add_argument("--layers", type=int, default=6, help="decoder layers in the slice (6 = 5 sliding + 1 full)")
    p.add_argument("--preset", default="gemma4-31b", help="presets.build_text_config preset for the slice")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per row (compiles)")
    p.add_argument("--iters", type=int, default=4, help="timed steps per row")
    p.add_argument("--budget-s", type=float, default=270.0, help="skip remaining rows past this wall time")
    p.add_argument("--attn-heads", type=int, nargs=2, default=(32, 4), help="attention rows: q heads, kv heads")
    args = p.parse_args()

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if DEVICE == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group("nccl" if DEVICE == "cuda" else "gloo")
    group = dist.group.WORLD
    t_start = time.perf_counter()
    rows: list[dict] = []

    def run(name, fn):
        if time.perf_counter() - t_start > args.budget_s:
            rows.append({"row": name, "skipped": f"time budget {args.budget_s}s spent"})
            return
        t0 = time.perf_counter()
        try:
            rows.append({**fn(), "wall_s": round(time.perf_counter() - t0, 1)})
        except Exception as exc:  # noqa: BLE001 - one failing row is recorded, the run goes on
            traceback.print_exc()
            rows.append({"row": name, "error": f"{type(exc).__name__}: {exc}"[:500]})
        gc.collect()
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()

    if rank == 0:
        print(f"kernel: {kernels.active_kernel()} ({kernels.ffpa_unavailable_reason() or 'ffpa ok'})", flush=True)
    # Order = priority under the time budget: the two summary keys first, attention-only rows last.
    model, cfg = None, None
    try:
        model, cfg = build_model(args)
    except Exception as exc:  # noqa: BLE001
        rows.append({"row": "build_model", "error": f"{type(exc).__name__}: {exc}"[:500]})
    if model is not None:
        run("model_ffpa", lambda: model_row("ffpa", model, cfg, args, rank, world, group))
        run("parity_cp1", lambda: parity_row(model, cfg, args, rank, world))
        run("model_flex", lambda: model_row("flex", model, cfg, args, rank, world, group))
        model = None
        gc.collect()
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    for kind in ("ffpa", "flex"):
        run(f"attn_{kind}", lambda kind=kind: attn_row(kind, args, rank, world, group))

    by = {r["row"].rsplit("_cp", 1)[0] if "_ring_" in r["row"] else r["row"]: r for r in rows}
    ratio = lambda a, b: (round(by[a]["tokens_per_s"] / by[b]["tokens_per_s"], 3)  # noqa: E731
                          if "tokens_per_s" in by.get(a, {}) and "tokens_per_s" in by.get(b, {}) else None)
    cp1 = by.get("parity_cp1", {}).get("loss")
    diffs = [abs(by[k]["loss"] - cp1) for k in ("model_ffpa_ring", "model_flex_ring") if cp1 is not None
             and "loss" in by.get(k, {})]
    summary = {
        "ffpa_ring_vs_flex_ring_tps_16k": ratio("model_ffpa_ring", "model_flex_ring"),
        "ffpa_ring_vs_flex_ring_attn_tps_16k": ratio("attn_ffpa_ring", "attn_flex_ring"),
        "cp2_vs_cp1_loss_max_abs_diff": max(diffs) if diffs else None,
        "kernel": kernels.active_kernel(),
        "model_slice": None if cfg is None else (
            f"{args.preset} x {args.layers} layers ({cfg.layer_types.count('sliding_attention')} sliding, "
            f"{cfg.layer_types.count('full_attention')} full), bf16, fwd+bwd, cp={world}"),
    }
    if rank == 0:
        for r in rows:
            print({k: r[k] for k in r if k not in ("stats", "blocks")})
        write_result("context_parallel", rows, summary, out=args.out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
