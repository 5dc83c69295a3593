"""Unmerged-LoRA decode against the merged copy: the rollout engine with `weights="shared"` (the policy's W0 read in
place, LoRA applied unmerged from adapter buffers) and `weights="merged"` (its own full copy, W0 + s*B@A written in),
each row in its own process.

Model: Gemma4-31B shapes at `--layers` (default 12: the depth where the policy and a merged copy both fit one GPU),
bf16, random weights (normal_(0.02)), peft LoRA r=`--lora-r` on every linear layer with non-zero B. The engine runs
its defaults (compiled decode step, CUDA graphs, fused projections); batch `--batch` of random `--prompt-len`
prompts, `--new-tokens` greedy tokens without EOS. Each row times a warm-up, a 1-token run (prefill) and the whole
run, `--steps` times; the decode time is the whole run minus the prefill run, median with min and max.

Rows: `merged` and `shared` (the only thing that differs). Summary: `unmerged_lora_decode_overhead` = shared decode
step / merged decode step - 1 (the unmerged adapters' cost as a fraction of the merged decode time; the issue's
target is <= 0.10), both steps in ms, the peak memory of each row, and how many of the rows' greedy tokens agree.

    python benchmarks/unmerged_lora.py --out $OUT/unmerged_lora.json
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

MODES = ("merged", "shared")
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    """One row: build the policy, the engine's weights in `spec["weights"]`, and time greedy decode."""
    from peft import LoraConfig, get_peft_model

    from benchmarks.rollout_hf import peaks, timed
    from benchmarks.rollout_rows import build_model, prompts_for
    from lightning_ffpa.rollout.engine import EngineConfig, RolloutEngine
    from lightning_ffpa.rollout.sampler import SamplingParams
    from lightning_ffpa.rollout.shared_weights import WeightsPlan

    device = spec["device"]
    torch.manual_seed(0)  # both rows' processes draw the same weights and adapters
    model, cfg = build_model(spec["layers"], spec["preset"], device)
    train = get_peft_model(model, LoraConfig(r=spec["lora_r"], lora_alpha=2 * spec["lora_r"],
                                             target_modules=LORA_TARGETS))
    with torch.no_grad():
        for name, p in train.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.02)  # B = 0 would make the adapters free to skip
    dtype = next(model.parameters()).dtype
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
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    decode, seqs = [], None
    for _ in range(spec["steps"]):
        _, t_prefill = timed(lambda: eng.generate(prompts, 1, greedy), device)
        seqs, t_total = timed(lambda: eng.generate(prompts, new, greedy), device)
        decode.append(max(t_total - t_prefill, 1e-9) / (new - 1))
    sync.refresh()  # what a GRPO step does before its rollout: its time beside the decode's
    _, refresh_s = timed(sync.refresh, device)
    return {"decode_step_ms": statistics.median(decode) * 1e3, "decode_step_ms_min": min(decode) * 1e3,
            "decode_step_ms_max": max(decode) * 1e3, "decode_tokens_per_s": len(prompts) / statistics.median(decode),
            "warmup_s": warm, "refresh_s": refresh_s, "weights_path": sync.weights_path,
            "engine_own_bytes": plan.own_bytes, "aliased_bytes": plan.aliased_bytes, "mode_ran": plan.mode,
            "projection_path": eng.projection_path, "decode_path": eng.decode_path,
            "graph_replays": eng.stats["graph_replays"], "eager_decodes": eng.stats["eager_decodes"],
            "outputs_head": [s.output[:32] for s in seqs[:8]], **peaks(device)}


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The overhead of the shared row over the merged one, when both measured."""
    by = {r["weights"]: r for r in rows if "decode_step_ms" in r}
    summary: dict[str, Any] = {f"{m}_decode_step_ms": by[m]["decode_step_ms"] for m in by}
    summary.update({f"{m}_peak_mem_gib": by[m].get("peak_mem_gb") for m in by})
    if set(MODES) <= set(by):
        merged, shared = by["merged"], by["shared"]
        if not shared["aliased_bytes"]:  # a shared row that copied every weight measures merged against merged
            summary["unmerged_lora_decode_overhead"] = None
            summary["invalid"] = f"the shared row read no policy tensor: {shared['weights_path']}"
            return summary
        summary["unmerged_lora_decode_overhead"] = shared["decode_step_ms"] / merged["decode_step_ms"] - 1
        pairs = [(a, b) for x, y in zip(merged["outputs_head"], shared["outputs_head"]) for a, b in zip(x, y)]
        summary["greedy_token_agreement"] = sum(a == b for a, b in pairs) / max(len(pairs), 1)
        summary["target_overhead_max"] = 0.10
    else:
        summary["unmerged_lora_decode_overhead"] = None
        summary["missing"] = [m for m in MODES if m not in by]
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
    args = ap.parse_args(argv)
    spec = {k: getattr(args, k) for k in ("layers", "preset", "device", "batch", "prompt_len", "new_tokens",
                                          "page_size", "lora_r", "steps")}
    specs = [{**spec, "name": m, "weights": m} for m in MODES]
    out = Path(args.out) if args.out else Path(__file__).resolve().parent / "results" / "unmerged_lora.json"
    return run_rows_into(Path(__file__).resolve(), "unmerged_lora", specs, out, summarize, args.row_timeout_s, args.budget_s)


if __name__ == "__main__":
    from benchmarks.row_process import row_main

    if not row_main(None, measure):
        main()
