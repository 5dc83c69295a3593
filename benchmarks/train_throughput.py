"""End-to-end training throughput of a Gemma4-31B-shaped slice on H200: ours against honest baselines.

Slice: real 31B dims (hidden 5376, 32 heads, 16/4 kv heads, k_eq_v, window 1024, vocab 262144, softcap 30),
5 sliding + 1 full layer, random weights initialised for real. Every row runs FSDP2 (`parallelize`, the
strategy's recipe) on a (dp, 1) mesh, bf16 params / fp32 reduce, AdamW step, batch 1 x seq per GPU.

Rows (seq 4k and 8k each):
  1 sdpa          HF SDPA (transformers >= 5.13), full AC, plain HF loss: what a Lightning user gets today
  2 seed_gqa      D=512 layers through SDPA enable_gqa (MATH path), else as row 1
  3 flex          Flex for all layers with D=512-safe kernel options, else as row 1
  4 ffpa_swap     "ffpa" attention swapped in only, else as row 1 (the kernel effect alone)
  5 ours          ffpa + selective AC + per-layer compile + chunked fused linear CE, with the product's
                  defaults for everything else: FSDP2Strategy's `sac_save_mm` and `build_adamw` (fused AdamW)
  5b ours_nocompile  row 5 without compile (so a compile failure still leaves a measurement)
  ours_every_other   row 5b with SAC's `every_other` matmul rule (torchtitan's), to A/B the "high_k" default
  (opt-in) ours_all_mm / ours_sac_all_mm   row 5b / 5 with SAC saving every matmul
  (opt-in) ours_foreach   row 5b with the baseline rows' optimizer (plain AdamW), to isolate the optimizer

Baseline rows use what a plain Lightning user gets: `torch.optim.AdamW(model.parameters())` (foreach).
Every row also records where memory goes: one extra untimed step with per-phase peaks (forward+loss,
backward, optimizer) and the memory allocated before the row was built (a leak from an earlier row
shows there). `--profile` adds one profiled step to the "ours*" rows: top CUDA kernels and busy/wall.

Run: python benchmarks/train_throughput.py --out $OUT/train_throughput.json [--profile]
     torchrun --nproc_per_node 2 benchmarks/train_throughput.py --dp 2 --out ...
     CPU smoke: python benchmarks/train_throughput.py --cpu --preset tiny --layers 4 --seqs 256 --warmup 1 --steps 1
"""

from __future__ import annotations

import argparse
import gc
import inspect
import os
import sys
import time
import traceback
import weakref
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.results_io import write_result  # noqa: E402
from benchmarks.step_probe import phase_memory, profile_step  # noqa: E402
from lightning_ffpa._compat import torch as torch_compat  # noqa: E402
from lightning_ffpa._compat import transformers as hf_compat  # noqa: E402
from lightning_ffpa.callbacks.throughput import BF16_PEAK_FLOPS, train_flops_per_batch  # noqa: E402
from lightning_ffpa.loss import linear_cross_entropy  # noqa: E402
from lightning_ffpa.module import build_adamw  # noqa: E402
from lightning_ffpa.parallel import FSDP2Strategy, causal_lm_hidden_states, parallelize  # noqa: E402
from lightning_ffpa.parallel.strategy import MESH_DIM_NAMES, materialize  # noqa: E402
from lightning_ffpa.presets import build_text_config  # noqa: E402

# "ours" rows take the product's defaults, so the benchmark follows them when they change.
PRODUCT_SAVE_MM = inspect.signature(FSDP2Strategy).parameters["sac_save_mm"].default
_BASE = dict(ac="full", compile=False, loss="plain", optim="adamw_default")
_OURS = dict(attn="ffpa", ac="selective", compile=True, loss="chunked", save_mm=PRODUCT_SAVE_MM, optim="product")
ROWS = {
    "sdpa": dict(attn="sdpa", **_BASE),
    "seed_gqa": dict(attn="sdpa_gqa", **_BASE),
    "flex": dict(attn="flex_d512", **_BASE),
    "ffpa_swap": dict(attn="ffpa", **_BASE),
    "ours": dict(_OURS),
    "ours_nocompile": dict(_OURS, compile=False),
    "ours_every_other": dict(_OURS, compile=False, save_mm="every_other"),
    # Opt-in (--rows): the memory-for-speed end of the SAC knob, and the optimizer on its own.
    "ours_all_mm": dict(_OURS, compile=False, save_mm="all"),
    "ours_sac_all_mm": dict(_OURS, save_mm="all"),
    "ours_foreach": dict(_OURS, compile=False, optim="adamw_default"),
}
# Compiled "ours" last: a slow compile can then only cost its own row, never the --budget-s of the others.
DEFAULT_ROWS = ["sdpa", "seed_gqa", "flex", "ffpa_swap", "ours_nocompile", "ours_every_other", "ours"]


# ----------------------------------------------------------------------------- baseline attentions
def _register_baselines() -> None:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import sdpa_mask

    def sdpa_gqa(module, query, key, value, attention_mask, scaling=None, **kwargs):
        """D=512 layers through SDPA enable_gqa (no mask, is_causal); others HF SDPA."""
        if module.head_dim != 512:
            return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling, enable_gqa=True)
        return out.transpose(1, 2).contiguous(), None  # (B, S, H, D)

    hf_compat.register_attention("sdpa_gqa", sdpa_gqa)
    hf_compat.register_mask("sdpa_gqa", sdpa_mask)

    from torch.nn.attention.flex_attention import create_block_mask

    from lightning_ffpa.attention.flex import flex_forward  # the product's compiled flex + D=512 options

    masks: dict = {}

    def block_mask(seq, window, device):
        key = (seq, window)
        if key not in masks:
            def causal(b, h, q, kv):
                return q >= kv

            def sliding(b, h, q, kv):
                return (q >= kv) & (q - kv < window)

            masks[key] = create_block_mask(sliding if window else causal, None, None, seq, seq, device=device)
        return masks[key]

    def flex(module, query, key, value, attention_mask, scaling=None, **kwargs):
        """Flex for both layer types with D=512-safe tiles (HF's own flex path fails at D=512)."""
        bm = block_mask(query.shape[2], getattr(module, "sliding_window", None), query.device)
        out = flex_forward(query, key, value, bm, scaling)  # (B, H, S, D)
        return out.transpose(1, 2).contiguous(), None

    def no_mask(*args, **kwargs):
        return None

    hf_compat.register_attention("flex_d512", flex)
    hf_compat.register_mask("flex_d512", no_mask)


# ----------------------------------------------------------------------------- helpers
def _dispatch():
    from lightning_ffpa import attention

    return attention.dispatch_counts, attention.reset_dispatch_counts


def measure_bf16_peak(device) -> float:
    """FLOP/s of an 8192^3 bf16 matmul on this device (the MFU denominator)."""
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    n, t0 = 20, time.perf_counter()
    for _ in range(n):
        a @ b
    torch.cuda.synchronize()
    return 2 * 8192**3 * n / (time.perf_counter() - t0)


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_model(spec: dict, mesh, layers: int, device, preset: str):
    import transformers

    types = ["sliding_attention"] * (layers - 1) + ["full_attention"]
    cfg = build_text_config(preset, num_hidden_layers=layers, layer_types=types)
    if spec["attn"] == "ffpa":
        from lightning_ffpa.attention import kernels, register_ffpa

        if device.type == "cuda" and not kernels.ffpa_available():
            # An "ffpa" row timed on the sdpa fallback would be a silent mislabel: fail the row instead.
            raise RuntimeError(f"FFPA CuTeDSL unavailable: {kernels.ffpa_unavailable_reason()}")
        register_ffpa()
    hf_compat.set_config_attn_implementation(cfg, "sdpa")
    with torch.device("meta"):
        model = transformers.Gemma4ForCausalLM(cfg)
    hf_compat.set_attn_implementation(model, spec["attn"])  # the FFPAAttention Callback's own setter
    strategy = FSDP2Strategy(activation_checkpointing=spec["ac"], compile=spec["compile"],  # product defaults
                             param_dtype="bf16" if device.type == "cuda" else "fp32")
    parallelize(model, mesh, activation_checkpointing=spec["ac"], compile=spec["compile"],
                sac_save_mm=spec.get("save_mm", PRODUCT_SAVE_MM),
                mp_policy=strategy.mp_policy(), reshard_after_forward=True)
    materialize(model, device)  # the strategy's meta -> device init (HF _init_weights, real random values)
    bad = [n for n, p in model.named_parameters() if not torch.isfinite(p.to_local() if hasattr(p, "to_local") else p).all()]
    if bad:
        raise RuntimeError(f"non-finite weights after init: {bad[:3]}")
    model.train()
    return model


def build_optimizer(spec: dict, model):
    """The product's AdamW (`build_adamw`: fused on CUDA) for "ours" rows; a plain user's AdamW otherwise."""
    if spec["optim"] == "product":
        return build_adamw(model, lr=1e-5)
    return torch.optim.AdamW(model.parameters(), lr=1e-5)  # torch's default: foreach on CUDA


def loss_fn(spec: dict, model, ids):
    if spec["loss"] == "plain":
        return model(input_ids=ids, labels=ids, use_cache=False).loss  # HF: softcap, fp32 CE over full logits
    hidden = causal_lm_hidden_states(model, input_ids=ids)  # (B, S, H)
    return linear_cross_entropy(hidden[:, :-1].flatten(0, 1), model.lm_head.weight, ids[:, 1:].flatten(),
                                softcap=model.config.final_logit_softcapping, chunk_size=4096)


def _gib(device) -> float | None:
    return torch.cuda.memory_allocated(device) / 2**30 if device.type == "cuda" else None


def run_row(name: str, spec: dict, seqs, args, mesh, device, peak: float, rank: int) -> tuple[list[dict], object]:
    """Rows for every seq, and a weakref to the row's model (the caller checks it was freed)."""
    out, model_ref = [], None
    get_counts, reset_counts = _dispatch()
    model = opt = loss = None
    allocated_at_start = _gib(device)
    try:
        model = build_model(spec, mesh, args.layers, device, args.preset)
        model_ref = weakref.ref(model)
        opt = build_optimizer(spec, model)
        for seq in seqs:
            row = dict(row=name, seq=seq, **spec, allocated_before_row_gb=allocated_at_start)
            try:
                gen = torch.Generator(device=device).manual_seed(rank)
                ids = torch.randint(0, model.config.vocab_size, (1, seq), device=device, generator=gen)
                reset_counts()
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                dynamo_stats = torch_compat.dynamo_counters()
                dynamo_stats.clear()
                times, losses = [], []
                graphs_after_warmup = 0
                for step in range(args.warmup + args.steps):
                    if step == args.warmup:
                        graphs_after_warmup = dynamo_stats["stats"]["unique_graphs"]
                    _sync(device)
                    t0 = time.perf_counter()
                    loss = loss_fn(spec, model, ids)
                    loss.backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    _sync(device)
                    if step >= args.warmup:
                        times.append(time.perf_counter() - t0)
                    losses.append(loss.item())
                    # The graph behind `loss` holds FSDP state -> the whole model: drop it every step.
                    loss = None
                step_s = sum(times) / len(times)
                flops = train_flops_per_batch(model, 1, seq)
                row.update(step_ms=step_s * 1e3, tokens_per_s_per_gpu=seq / step_s,
                           peak_mem_gb=torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0,
                           mfu=flops / step_s / peak if device.type == "cuda" else None,  # no CPU peak
                           model_tflops_per_step=flops / 1e12,
                           first_loss=losses[0], last_loss=losses[-1], dispatch=get_counts(),
                           # compile health: graph breaks, and graphs compiled during the timed steps
                           # (non-zero means recompiles inside the timing)
                           graph_breaks=sum(dynamo_stats["graph_break"].values()),
                           compiled_graphs=dynamo_stats["stats"]["unique_graphs"],
                           recompiles_timed=dynamo_stats["stats"]["unique_graphs"] - graphs_after_warmup)
                # Untimed extra steps: where the memory goes, and (opt-in) where the time goes.
                row["memory_phases"] = phase_memory(device, partial(loss_fn, spec, model, ids),
                                                    torch.Tensor.backward, partial(_opt_step, opt))
                if args.profile and name.startswith("ours"):
                    row["profile"] = profile_step(device, partial(_train_step, spec, model, opt, ids))
                if not all(map(lambda v: v == v and abs(v) < 1e4, losses)):
                    row["error"] = f"non-finite loss {losses}"
            except Exception as e:  # noqa: BLE001 - one failing row must not kill the run
                row["error"] = f"{type(e).__name__}: {e}"[:800]
                traceback.print_exc()
            loss = None
            out.append(row)
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        out += [dict(row=name, seq=s, **spec, error=f"build: {type(e).__name__}: {e}"[:800]) for s in seqs]
    finally:
        del model, opt, loss
        torch.compiler.reset()  # compiled code holds the model's modules
        gc.collect()  # FSDP state <-> module reference cycles: only the cycle collector frees a model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out, model_ref


def _opt_step(opt) -> None:
    opt.step()
    opt.zero_grad(set_to_none=True)


def _train_step(spec: dict, model, opt, ids) -> None:
    loss_fn(spec, model, ids).backward()
    _opt_step(opt)


def _phase_peak(phase: dict) -> str:
    """GiB peak on CUDA; on CPU (no absolute counter) the MiB above the phase start, as "+NM"."""
    if "peak_gb" in phase:
        return f"{phase['peak_gb']:.1f}"
    return f"+{phase['peak_above_start_gb'] * 1024:.0f}M"


def memory_note(rows: list[dict]) -> str | None:
    """A headline caveat when a row started with memory an earlier row left alive (its peak includes it)."""
    leaked = max((r.get("allocated_before_row_gb") or 0.0 for r in rows), default=0.0)
    if leaked < 1.0:
        return None
    return (f"peak memory of some rows includes up to {leaked:.1f} GiB an earlier row left alive "
            "(rows[].allocated_before_row_gb); compare peaks from a run without earlier rows")


def _ratio(rows, a, b, key, seq=8192):
    def get(name):
        for r in rows:
            if r["row"] == name and r["seq"] == seq and "error" not in r:
                return r[key]
        return None

    x, y = get(a), get(b)
    return None if x is None or y is None else x / y


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="result JSON path")
    p.add_argument("--seqs", type=int, nargs="+", default=[4096, 8192])
    p.add_argument("--rows", nargs="+", default=DEFAULT_ROWS, choices=list(ROWS))
    p.add_argument("--layers", type=int, default=6, help="5 sliding + 1 full by default")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--budget-s", type=float, default=420.0, help="skip remaining rows past this many seconds")
    p.add_argument("--dp", type=int, default=1, help="data-parallel GPUs (launch with torchrun when > 1)")
    p.add_argument("--preset", default="gemma4-31b", help="presets.py shape; 'tiny' with --cpu for a smoke run")
    p.add_argument("--cpu", action="store_true", help="smoke-run on CPU (gloo, no timing claims)")
    p.add_argument("--profile", action="store_true", help="profile one extra step of the ours* rows (top kernels)")
    args = p.parse_args()

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != args.dp:
        raise SystemExit(f"`--dp {args.dp}` needs WORLD_SIZE={args.dp} (torchrun --nproc_per_node {args.dp}); got {world}")
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    if args.cpu:
        device = torch.device("cpu")
        torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    else:
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        torch.distributed.init_process_group("nccl", rank=rank, world_size=world, device_id=device)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (world, 1), mesh_dim_names=MESH_DIM_NAMES)  # the strategy's mesh shape
    _register_baselines()
    peak = 1.0 if args.cpu else measure_bf16_peak(device)
    rows: list[dict] = []
    t_start = time.perf_counter()
    # Per-layer compile with static shapes: 2 layer kinds x 2 seqs x (maybe) per-layer guards can pass
    # dynamo's default recompile limit of 8, which would silently drop layers to eager mid-benchmark.
    torch_compat.raise_recompile_limit(64)
    for name in args.rows:
        skip = [time.perf_counter() - t_start > args.budget_s]
        torch.distributed.broadcast_object_list(skip, src=0)  # rank-uniform, or dp ranks would hang
        if skip[0]:
            rows += [dict(row=name, seq=s, **ROWS[name], error=f"skipped: past --budget-s {args.budget_s:.0f}")
                     for s in args.seqs]
            continue
        new_rows, model_ref = run_row(name, ROWS[name], args.seqs, args, mesh, device, peak, rank)
        gc.collect()
        if model_ref is not None and model_ref() is not None:  # would inflate the next row's memory
            for r in new_rows:
                r["warning"] = "model still alive after the row; later rows' memory includes it"
        rows += new_rows
        if rank == 0:
            print(f"[{time.perf_counter() - t_start:6.0f}s] {name} done", flush=True)

    summary = {
        "ours_vs_sdpa_tps_8k": _ratio(rows, "ours", "sdpa", "tokens_per_s_per_gpu"),
        "ours_vs_flex_tps_8k": _ratio(rows, "ours", "flex", "tokens_per_s_per_gpu"),
        "ours_vs_seed_baseline_tps_8k": _ratio(rows, "ours", "seed_gqa", "tokens_per_s_per_gpu"),
        "attention_swap_vs_sdpa_tps_8k": _ratio(rows, "ffpa_swap", "sdpa", "tokens_per_s_per_gpu"),
        "ours_vs_sdpa_peak_mem_8k": _ratio(rows, "ours", "sdpa", "peak_mem_gb"),
        "ours_mfu_8k": next((r["mfu"] for r in rows if r["row"] == "ours" and r["seq"] == 8192 and "error" not in r),
                            None),
        "ours_nocompile_vs_sdpa_tps_8k": _ratio(rows, "ours_nocompile", "sdpa", "tokens_per_s_per_gpu"),
        "ours_nocompile_vs_sdpa_peak_mem_8k": _ratio(rows, "ours_nocompile", "sdpa", "peak_mem_gb"),
        "high_k_vs_every_other_tps_8k": _ratio(rows, "ours_nocompile", "ours_every_other", "tokens_per_s_per_gpu"),
        "high_k_vs_every_other_peak_mem_8k": _ratio(rows, "ours_nocompile", "ours_every_other", "peak_mem_gb"),
        "ours_sac_save_mm": PRODUCT_SAVE_MM,
    }
    note = memory_note(rows)
    if note:
        summary["memory_note"] = note
    if rank == 0:
        print(f"\n{'row':16} {'seq':>5} {'tok/s/gpu':>10} {'step ms':>8} {'peak GB':>8} {'MFU':>6} {'gb/rc':>5} "
              f"{'fwd/bwd/opt peak GB':>20} {'before':>6}  error")
        for r in rows:
            if "error" in r:
                print(f"{r['row']:16} {r['seq']:>5} {'-':>10} {'-':>8} {'-':>8} {'-':>6} {'-':>5} {'-':>20} {'-':>6}  "
                      f"{r['error'][:90]}")
                continue
            ph = r.get("memory_phases") or {}
            phases = "/".join(_phase_peak(ph[k]) for k in ("forward_loss", "backward", "optimizer")) if ph else "-"
            before = r.get("allocated_before_row_gb")
            print(f"{r['row']:16} {r['seq']:>5} {r['tokens_per_s_per_gpu']:>10.0f} {r['step_ms']:>8.1f} "
                  f"{r['peak_mem_gb']:>8.1f} {'-' if r['mfu'] is None else format(r['mfu'], '.1%'):>6} "
                  f"{r['graph_breaks']:>2}/{r['recompiles_timed']:<2} {phases:>20} "
                  f"{'-' if before is None else f'{before:.1f}':>6}  {r.get('warning', '')}")
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        spec_peak = next((v for k, v in BF16_PEAK_FLOPS.items() if k in name), None)
        write_result("train_throughput", rows, summary, out=args.out, measured_bf16_peak_tflops=peak / 1e12,
                     spec_bf16_peak_tflops=spec_peak and spec_peak / 1e12, dp=world, layers=args.layers,
                     warmup=args.warmup, steps=args.steps, preset=args.preset)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
