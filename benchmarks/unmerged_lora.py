"""Unmerged-LoRA decode against the merged copy, and over a float8 base: the rollout engine with `weights="shared"`
(the policy's W0 read in place, LoRA applied unmerged from adapter buffers) and `weights="merged"` (its own full copy,
W0 + s*B@A written in), each row in its own process.

Model: Gemma4-31B shapes at `--layers` (default 12: the depth where the policy and a merged copy both fit one GPU),
bf16, random weights (normal_(0.02)), peft LoRA r=`--lora-r` on every linear layer with non-zero B. The engine runs
its defaults (compiled decode step, CUDA graphs, fused projections); batch `--batch` of random `--prompt-len`
prompts, `--new-tokens` greedy tokens without EOS. Each row times a warm-up, a 1-token run (prefill) and the whole
run, `--steps` times; the decode time is the whole run minus the prefill run, median with min and max.

Rows (`--rows`, default all, in this order):
- `merged` and `shared`: the only thing that differs is the engine's weights.
- `shared_fp8`: `shared` except that the policy's LoRA bases are stored in float8 (`model.lora.base_dtype: fp8`:
  `fp8_base.quantize_lora_bases` after the peft wrapping, once the weights are final, before the engine's plan, as
  the GRPO module does), so decode reads W0 in float8 through the policy's matmul path (`scaled_mm` where the GPU
  has FP8, else `dequantize`; a CUDA GPU below capability 8.9 refuses the row). It records the conversion summary
  and `fp8_base.path_counts()` (forward calls per matmul path; a CUDA-graph replay runs no Python, so on CUDA these
  are the calls of eager runs and of the graphs' capture: which path the captured graphs hold).
- `shared_no_expert_lora` (only with `--expert-lora`, a MoE preset): `shared` with LoRA on the linear targets only.
`--expert-lora` puts LoRA on the expert stacks too (`target_parameters: experts.gate_up_proj, experts.down_proj`,
through `lora.apply_lora`, so unmerged inside the grouped GEMMs as the GRPO recipe runs them) in every other row.
Each row records `weight_bytes_per_step`: the bytes of every weight tensor the engine's model reads in a decode step
(`aliased_bytes + engine_own_bytes`, each tensor at its stored size: float8 at one byte, with its scales).

Summary: `unmerged_lora_decode_overhead` = shared decode step / merged decode step - 1 (the unmerged adapters' cost
as a fraction of the merged decode time; the issue's target is <= 0.10), `fp8_base_decode_vs_shared_bf16` = shared
decode step / shared_fp8 decode step (above 1: the float8 base decodes faster), each row's decode step in ms and peak
memory, `expert_lora_decode_overhead` = shared / shared_no_expert_lora decode step - 1 (what the expert adapters
cost a decode step), and how many greedy tokens agree (`greedy_token_agreement`: shared against merged, which must match;
`fp8_greedy_token_agreement`: shared_fp8 against shared, which drifts after a while: recorded, not checked). A key
that cannot be computed is None, with the reason under `why_none`.

    python benchmarks/unmerged_lora.py --out $OUT/unmerged_lora.json
    python benchmarks/unmerged_lora.py --rows shared shared_fp8 --batch 16 --out $OUT/unmerged_lora_fp8_b16.json
    python benchmarks/unmerged_lora.py --preset gemma4-26b-a4b --layers 30 --batch 16 --expert-lora \\
        --rows shared shared_no_expert_lora --out $OUT/unmerged_lora_moe_b16.json
    python benchmarks/unmerged_lora.py --preset tiny --device cpu --layers 2 --batch 2 --prompt-len 8 \\
        --new-tokens 8 --steps 1 --out /tmp/u.json        # CPU smoke of the script
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.row_process import run_rows_into  # noqa: E402

MODES = ("merged", "shared", "shared_fp8")  # the default rows; a row's `weights` is shared or merged
NO_EXPERT_LORA = "shared_no_expert_lora"  # with --expert-lora only
ROWS = (*MODES, NO_EXPERT_LORA)  # every row name, in run order
EXPERT_STACKS = ["experts.gate_up_proj", "experts.down_proj"]
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    """One row: build the policy, the engine's weights in `spec["weights"]`, and time greedy decode."""
    from benchmarks.rollout_hf import peaks, timed
    from benchmarks.rollout_rows import build_model, prompts_for
    from lightning_ffpa import experts, fp8_base
    from lightning_ffpa.lora import apply_lora
    from lightning_ffpa.rollout.engine import EngineConfig, RolloutEngine
    from lightning_ffpa.rollout.sampler import SamplingParams
    from lightning_ffpa.rollout.shared_weights import WeightsPlan

    device = spec["device"]
    fp8 = spec.get("base_dtype") == "fp8"
    if fp8:  # before the build, as the module's `configure_model`: a CUDA GPU below 8.9 is refused, never run bf16
        fp8_matmul = fp8_base.matmul_path(torch.device(device))
    torch.manual_seed(0)  # every row's process draws the same weights and adapters
    model, cfg = build_model(spec["layers"], spec["preset"], device)
    lora = {"r": spec["lora_r"], "lora_alpha": 2 * spec["lora_r"], "target_modules": LORA_TARGETS,
            **({"target_parameters": EXPERT_STACKS} if spec.get("expert_lora") else {})}
    train = apply_lora(model, lora, "unmerged_lora.lora")
    with torch.no_grad():
        for name, p in train.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.02)  # B = 0 would make the adapters free to skip
    dtype = next(model.parameters()).dtype  # read before the swap: the engine's dtype stays the model's
    # The float8 swap after the peft wrapping, on final weights, before the engine's plan (`HFModule.build_model`)
    fp8_row = {"fp8_conversion": fp8_base.quantize_lora_bases(train), "fp8_matmul_path": list(fp8_matmul)} if fp8 else {}
    plan = WeightsPlan(train, spec["weights"], dtype, torch.device(device))
    sync = plan.build()
    prompts = prompts_for(spec["batch"], spec["prompt_len"], cfg.vocab_size)
    plen, new, page = spec["prompt_len"], spec["new_tokens"], spec["page_size"]
    max_len = -(-(plen + new) // page) * page
    eng = RolloutEngine(sync.inference, EngineConfig(page_size=page, num_pages=len(prompts) * (max_len // page) + 2,
                                                     max_batch_size=len(prompts), max_seq_len=max_len,
                                                     max_prefill_tokens=16384))
    greedy = SamplingParams(temperature=0.0)
    _, warm = timed(lambda: eng.generate(prompts, 4, greedy), device)  # compiles and captures
    if fp8:
        fp8_row["fp8_path_counts_warmup"] = fp8_base.path_counts()
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    decode, seqs = [], None
    for _ in range(spec["steps"]):
        _, t_prefill = timed(lambda: eng.generate(prompts, 1, greedy), device)
        seqs, t_total = timed(lambda: eng.generate(prompts, new, greedy), device)
        decode.append(max(t_total - t_prefill, 1e-9) / (new - 1))
    sync.refresh()  # what a GRPO step does before its rollout: its time beside the decode's
    _, refresh_s = timed(sync.refresh, device)
    if fp8:
        fp8_row["fp8_path_counts"] = fp8_base.path_counts()  # since the process began: warm-up and timed runs
    return {**fp8_row, "decode_step_ms": statistics.median(decode) * 1e3, "decode_step_ms_min": min(decode) * 1e3,
            "decode_step_ms_max": max(decode) * 1e3, "decode_tokens_per_s": len(prompts) / statistics.median(decode),
            "warmup_s": warm, "refresh_s": refresh_s, "weights_path": sync.weights_path,
            "engine_own_bytes": plan.own_bytes, "aliased_bytes": plan.aliased_bytes, "mode_ran": plan.mode,
            "weight_bytes_per_step": plan.aliased_bytes + plan.own_bytes,
            "projection_path": eng.projection_path, "decode_path": eng.decode_path,
            "graph_replays": eng.stats["graph_replays"], "eager_decodes": eng.stats["eager_decodes"],
            "lora": lora, "expert_lora_paths": experts.path_counts(),
            "outputs_head": [s.output[:32] for s in seqs[:8]], **peaks(device)}


def _agreement(a: dict[str, Any], b: dict[str, Any]) -> float:
    """The fraction of the two rows' recorded greedy tokens (`outputs_head`) that are equal, position by position."""
    pairs = [(x, y) for xs, ys in zip(a["outputs_head"], b["outputs_head"]) for x, y in zip(xs, ys)]
    return sum(x == y for x, y in pairs) / max(len(pairs), 1)


def _read_no_policy_tensor(row: dict[str, Any]) -> str | None:
    """Why a shared row measures no shared engine (it copied every weight), None when it read the policy's."""
    return None if row["aliased_bytes"] else f"the {row['name']} row read no policy tensor: {row['weights_path']}"


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The shared row against the merged one, and the float8-base row against the shared one, where both measured."""
    by = {r["name"]: r for r in rows if "decode_step_ms" in r}
    summary: dict[str, Any] = {f"{m}_decode_step_ms": by[m]["decode_step_ms"] for m in by}
    summary.update({f"{m}_peak_mem_gib": by[m].get("peak_mem_gb") for m in by})
    why_none: dict[str, str] = {}
    missing = [m for m in MODES if m not in by]
    if missing:
        summary["missing"] = missing
    shared = by.get("shared")
    summary["unmerged_lora_decode_overhead"] = None
    if "merged" not in by or shared is None:
        why_none["unmerged_lora_decode_overhead"] = f"no measured {' or '.join(m for m in MODES[:2] if m not in by)} row"
    elif (invalid := _read_no_policy_tensor(shared)) is not None:  # merged against merged
        summary["invalid"] = why_none["unmerged_lora_decode_overhead"] = invalid
    else:
        summary["unmerged_lora_decode_overhead"] = shared["decode_step_ms"] / by["merged"]["decode_step_ms"] - 1
        summary["greedy_token_agreement"] = _agreement(by["merged"], shared)
        summary["target_overhead_max"] = 0.10
    fp8 = by.get("shared_fp8")
    summary["fp8_base_decode_vs_shared_bf16"] = summary["fp8_greedy_token_agreement"] = None
    if shared is None or fp8 is None:
        why = f"no measured {' or '.join(m for m in MODES[1:] if m not in by)} row"
    elif (why := _read_no_policy_tensor(shared) or _read_no_policy_tensor(fp8)) is None:
        if not sum(fp8.get("fp8_path_counts", {}).values()):
            why = f"the shared_fp8 row ran no float8 base matmul: {fp8.get('fp8_path_counts')}"
        else:
            summary["fp8_base_decode_vs_shared_bf16"] = shared["decode_step_ms"] / fp8["decode_step_ms"]
            summary["fp8_base_weight_bytes_vs_shared_bf16"] = (shared["weight_bytes_per_step"]
                                                               / fp8["weight_bytes_per_step"])
            summary["fp8_greedy_token_agreement"] = _agreement(shared, fp8)
    if why is not None:
        why_none["fp8_base_decode_vs_shared_bf16"] = why_none["fp8_greedy_token_agreement"] = why
    bare = by.get(NO_EXPERT_LORA)
    if bare is not None or (shared or {}).get("lora", {}).get("target_parameters"):
        summary["expert_lora_decode_overhead"] = None
        if shared is None or bare is None:
            why_none["expert_lora_decode_overhead"] = f"no measured {'shared' if shared is None else NO_EXPERT_LORA} row"
        else:
            summary["expert_lora_decode_overhead"] = shared["decode_step_ms"] / bare["decode_step_ms"] - 1
    if why_none:
        summary["why_none"] = why_none
    return summary


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--preset", default="gemma4-31b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=512)
    ap.add_argument("--page-size", type=int, default=128)
    ap.add_argument("--lora-r", type=int, default=16)
    ap.add_argument("--out", default=None)
    ap.add_argument("--steps", type=int, default=5, help="timed runs per row (median, min and max)")
    ap.add_argument("--budget-s", type=float, default=570.0, help="the whole call ends within this many seconds")
    ap.add_argument("--row-timeout-s", type=float, default=280.0, help="one row's process is killed after this")
    ap.add_argument("--rows", nargs="+", default=list(MODES), choices=ROWS,
                    help="rows to run, in the order merged, shared, shared_fp8, shared_no_expert_lora")
    ap.add_argument("--expert-lora", action="store_true",
                    help="LoRA on the expert stacks too (a MoE preset), except in the shared_no_expert_lora row")
    args = ap.parse_args(argv)
    from lightning_ffpa.presets import build_text_config

    if args.expert_lora and not getattr(build_text_config(args.preset), "enable_moe_block", False):
        ap.error(f"--expert-lora: `--preset {args.preset}` has no MoE layers (use gemma4-26b-a4b or tiny-moe)")
    if NO_EXPERT_LORA in args.rows and not args.expert_lora:
        ap.error(f"--rows {NO_EXPERT_LORA}: needs --expert-lora (it is the shared row without the expert adapters)")
    spec = {k: getattr(args, k) for k in ("layers", "preset", "device", "batch", "prompt_len", "new_tokens",
                                          "page_size", "lora_r", "steps")}
    specs = [{**spec, "name": m, "weights": "shared" if m == NO_EXPERT_LORA else m.removesuffix("_fp8"),
              "expert_lora": args.expert_lora and m != NO_EXPERT_LORA,
              **({"base_dtype": "fp8"} if m.endswith("_fp8") else {})}
             for m in ROWS if m in args.rows]
    out = Path(args.out) if args.out else Path(__file__).resolve().parent / "results" / "unmerged_lora.json"
    return run_rows_into(Path(__file__).resolve(), "unmerged_lora", specs, out, summarize, args.row_timeout_s, args.budget_s)


if __name__ == "__main__":
    from benchmarks.row_process import row_main

    if not row_main(None, measure):
        main()
