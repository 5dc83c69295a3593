"""Turn `benchmarks/results/*.json` into docs: `docs/benchmarks.md` and the README's headline block.

Owns rendering only: every number on those pages is read from a result file here, none is typed by hand.
It does not run benchmarks (the scripts in `benchmarks/` do) and does not draw plots (`benchmarks/report/plots.py`,
called from here unless `--no-plots`).

    python -m benchmarks.report            # rewrite docs/benchmarks.md, the README block, docs/img/*.png
    python -m benchmarks.report --check    # exit 1 if either page is stale (CI; plots are not compared)
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any

from benchmarks.report import tables
from benchmarks.report.results_io import load_results
from benchmarks.report.tables import CURATED, is_number
from benchmarks.report.targets import MEMORY_BARS, measured_at, render_targets

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS_MD = ROOT / "docs" / "benchmarks.md"
README = ROOT / "README.md"
BEGIN = "<!-- BEGIN GENERATED: headline numbers (python -m benchmarks.report) -->"
END = "<!-- END GENERATED: headline numbers -->"
HISTORY_BEGIN = "<!-- BEGIN GENERATED: history (python -m benchmarks.report) -->"
HISTORY_END = "<!-- END GENERATED: history -->"
PREDATES_MARK = "predates the current code"  # how the README's History and the docs mark such a file's numbers

# Summary keys worth a README line: (what was compared, how to print the value). Keys from DESIGN.md
# "Result files"; a key absent from every file (benchmark not recorded yet) prints nothing.
HEADLINES: dict[str, tuple[str, str]] = {
    # Same recipe, peers first (issue of record: each ratio is against the best the alternative can do).
    **{f"ours_vs_sdpa_recipe_tps_{k}": (f"training step, 31B-shaped slice, {k} tokens: ours vs HF SDPA with the same "
                                        "recipe (selective AC, per-layer compile, chunked CE, fused AdamW)",
                                        "{:.2f}x tokens/s") for k in ("8k", "16k", "32k")},
    **{f"ours_vs_flex_recipe_tps_{k}": (f"training step, {k} tokens: ours vs Flex with the same recipe and the "
                                        "best options of a sweep in the same run", "{:.2f}x tokens/s")
       for k in ("8k", "16k", "32k")},
    # Which part of the same-recipe ratio comes from which kernel (the two factors of ours_vs_sdpa_recipe).
    **{f"ours_vs_ours_sdpa_d512_tps_{k}": (f"training step, {k} tokens: FFPA's share of that ratio, ours vs ours with "
                                           "SDPA on the D=512 layers (sliding layers on ours' Flex path in both)",
                                           "{:.2f}x tokens/s") for k in ("8k", "16k", "32k")},
    **{f"ours_sdpa_d512_vs_sdpa_recipe_tps_{k}": (f"training step, {k} tokens: the sliding path's share, ours' "
                                                  "block-sparse Flex vs HF SDPA on the sliding layers (SDPA on the "
                                                  "D=512 layers in both)", "{:.2f}x tokens/s")
       for k in ("8k", "16k", "32k")},
    "ours_vs_liger_tps_8k": ("training step, 8k tokens: ours vs HF + liger-kernel's Gemma4 patches, same recipe "
                             "(the faster of with and without per-layer compile where both ran: `liger_baseline`)",
                             "{:.2f}x tokens/s"),
    **{f"full_depth_lora_ours_vs_sdpa_recipe_tps_{k}": (f"Gemma4-31B, all 60 layers, LoRA r=16, one H200, {k} "
                                                        "tokens: ours (as `lightning-ffpa fit` builds it) vs HF + "
                                                        "PEFT with SDPA and the same recipe", "{:.2f}x tokens/s")
       for k in ("8k", "16k")},
    **{f"full_depth_lora_peak_mem_gb_{who}_16k": (f"Gemma4-31B, all 60 layers, LoRA r=16, one H200, 16k tokens: "
                                                  f"peak allocated memory of {what}", "{:.1f} GiB")
       for who, what in (("ours", "ours"), ("sdpa_recipe", "HF + PEFT with SDPA and the same recipe"))},
    **{f"full_depth_lora_peak_mem_gb_{who}_8k": (f"Gemma4-31B, all 60 layers, LoRA r=16, one H200, 8k tokens: peak "
                                                 f"allocated memory of {what}", "{:.1f} GiB")
       for who, what in (("ours", "ours"), ("sdpa_recipe", "HF + PEFT with SDPA and the same recipe"),
                         ("ours_offload", "ours with full AC, activation offload and 1024-token loss chunks"),
                         ("ours_offload_replicated", "the same with the frozen base kept out of FSDP2 "
                                                     "(`replicate_frozen: auto`)"),
                         ("unsloth", "Unsloth, its faster checkpointing option (`full_depth_lora_unsloth_baseline_8k`)"))},
    "full_depth_lora_ours_vs_unsloth_tps_8k": ("Gemma4-31B, all 60 layers, LoRA r=16, one H200, 8k tokens: ours vs "
                                               "Unsloth (speed only)",
                                               "{:.2f}x tokens/s"),
    "full_depth_lora_ours_offload_vs_unsloth_tps_8k": ("Gemma4-31B, all 60 layers, LoRA r=16, one H200, 8k tokens: "
                                                       "ours with full AC, activation offload and 1024-token loss chunks vs Unsloth",
                                                       "{:.2f}x tokens/s"),
    "full_depth_lora_ours_offload_replicated_vs_unsloth_tps_8k": (
        "Gemma4-31B, all 60 layers, LoRA r=16, one H200, 8k tokens: ours with full AC, activation offload, "
        "1024-token loss chunks and the frozen base out of FSDP2 vs Unsloth", "{:.2f}x tokens/s"),
    # The float8 frozen base (`model.lora.base_dtype: fp8`) against ours with the bf16 base, same run and recipe
    **{f"fp8_base_lora_vs_bf16_tps_{k}": (f"Gemma4-31B, all 60 layers, LoRA r=16, one H200, {k} tokens: ours with "
                                          "the LoRA targets' frozen base stored in float8 (`lora.base_dtype: fp8`, "
                                          "rowwise scales) vs ours with the bf16 base", "{:.2f}x tokens/s")
       for k in ("8k", "16k")},
    **{f"fp8_base_lora_peak_mem_ratio_{k}": (f"Gemma4-31B, all 60 layers, LoRA r=16, one H200, {k} tokens: peak "
                                             "allocated memory of ours with the float8 frozen base relative to ours "
                                             "with the bf16 base (below 1: less memory)", "{:.2f}x")
       for k in ("8k", "16k")},
    "ours_vs_nemo_backend_fwdbwd_8k": ("Gemma4 full-attention layer, 8k tokens, forward+backward: ours vs "
                                       "NeMo-Automodel's FFPA backend", "{:.2f}x"),
    "ours_vs_nemo_backend_step_tps_8k": ("training step, 8k tokens: ours vs NeMo-Automodel's FFPA backend, same "
                                         "recipe", "{:.2f}x tokens/s"),
    "ours_vs_trl_step_speedup": ("GRPO optimizer step, 12-layer 31B-shaped LoRA policy: ours vs TRL's GRPOTrainer",
                                 "{:.2f}x"),
    "ours_mfu_spec_16k": ("training step, 16k tokens: ours' model FLOPs utilisation of the 989 TFLOP/s bf16 "
                          "datasheet peak", "{:.1%}"),
    "ours_mfu_measured_peak_16k": ("training step, 16k tokens: the same, of a measured 8192x8192 bf16 matmul's "
                                   "FLOP/s on the same GPU", "{:.1%}"),
    "ours_vs_sdpa_defaults_tps_8k": ("training step, 8k tokens: what a default Lightning + HF user gains by "
                                     "switching (ours vs HF SDPA, full AC, no compile, HF loss, foreach AdamW)",
                                     "{:.2f}x tokens/s"),
    "ffpa_vs_sdpa_fwd_8k": ("Gemma4 full-attention layer (D=512, 32q/4kv heads, causal, bf16, 8k tokens), "
                            "forward: speedup of our FFPA path over SDPA (SDPA time / ours)", "{:.2f}x"),
    "ffpa_vs_sdpa_fwdbwd_8k": ("same layer, forward+backward: speedup over SDPA", "{:.2f}x"),
    "ffpa_vs_flex_fwdbwd_8k": ("same layer, forward+backward: speedup over Flex with the best options found",
                               "{:.2f}x"),
    "backend_overhead_8k": ("same layer, forward+backward: time of our HF backend path relative to calling "
                            "`ffpa_attn_func` directly (negative: ours is faster; it skips layout copies)",
                            "{:+.1%}"),
    "ours_nocompile_vs_sdpa_tps_8k": ("training step, Gemma4-31B-shaped slice, 8k tokens: FFPA + selective AC + "
                                      "chunked CE (no compile) vs HF SDPA with full AC", "{:.2f}x tokens/s"),
    "attention_swap_vs_sdpa_tps_8k": ("training step, 8k tokens: only the attention swapped to FFPA vs SDPA",
                                      "{:.2f}x tokens/s"),
    "ours_vs_sdpa_tps_8k": ("training step, 8k tokens: FFPA + selective AC + per-layer torch.compile + chunked CE "
                            "vs HF SDPA with full AC", "{:.2f}x tokens/s"),
    "ours_vs_flex_tps_8k": ("training step, 8k tokens: the compiled row above vs Flex at D=512", "{:.2f}x tokens/s"),
    "ours_vs_seed_baseline_tps_8k": ("training step, 8k tokens: the compiled row above vs SDPA enable_gqa "
                                     "at D=512 (row seed_gqa)", "{:.2f}x tokens/s"),
    "ours_vs_sdpa_peak_mem_8k": ("training step, 8k tokens: peak memory of the compiled row above vs SDPA", "{:.2f}x"),
    "ours_mfu_8k": ("training step, 8k tokens: model FLOPs utilisation of the compiled row above (of the measured "
                    "bf16 peak)", "{:.1%}"),
    **{f"ffpa_ring_vs_flex_ring_tps_{k}": (f"context parallel over 2 GPUs, {k} tokens: FFPA ring vs Flex ring (best "
                                           "options of a sweep in the same run)", "{:.2f}x tokens/s") for k in ("32k", "64k")},
    **{f"ffpa_ring_vs_native_cp_tps_{k}": (f"context parallel over 2 GPUs, {k} tokens: FFPA ring vs torch's "
                                           "`context_parallel` over SDPA (full layers)", "{:.2f}x tokens/s")
       for k in ("32k", "64k")},
    "cp2_vs_cp1_grad_max_rel_diff": ("context parallel: largest relative gradient difference CP=2 vs an independent "
                                     "CP=1 reference", "{:.2e}"),
    "ffpa_ring_vs_flex_ring_tps_16k": ("context parallel, 16k tokens: FFPA ring vs Flex ring", "{:.2f}x tokens/s"),
    "cp2_vs_cp1_loss_max_abs_diff": ("context parallel: loss difference CP=2 vs CP=1", "{:.2e}"),
    # Roofline: the datasheet HBM bandwidth is the primary denominator; the copy bandwidth measured on the same
    # GPU (what a plain copy reaches there) follows as the secondary one.
    # MoE (a MoE preset's rollout.py file): the routed experts' bytes first, every weight once beside it
    **{k: v for bs in (64, 16) for k, v in {
        f"moe_decode_routed_roofline_bs{bs}": (f"MoE rollouts, batch {bs}, greedy: decode throughput as a fraction "
                                               "of the HBM roofline over the experts the batch routed to (per layer, "
                                               "the union over the rows), at the datasheet bandwidth", "{:.1%}"),
        f"moe_decode_all_weights_roofline_bs{bs}": (f"MoE rollouts, batch {bs}, greedy: the same step, of the "
                                                    "roofline over every weight once (all experts)", "{:.1%}"),
        f"moe_decode_routed_expert_fraction_bs{bs}": (f"MoE rollouts, batch {bs}, greedy: the share of all expert "
                                                      "bytes a decode step read", "{:.1%}"),
    }.items()},
    "roofline_fraction_datasheet_bs64": ("GRPO rollouts, batch 64, greedy: decode throughput as a fraction of the "
                                         "HBM roofline at the datasheet bandwidth", "{:.1%}"),
    "roofline_fraction_bs64": ("the same, of the copy bandwidth measured on the same GPU", "{:.1%}"),
    "roofline_fraction_datasheet_bs16": ("GRPO rollouts, batch 16, greedy: decode throughput as a fraction of the "
                                         "HBM roofline at the datasheet bandwidth", "{:.1%}"),
    "roofline_fraction_bs16": ("GRPO rollouts, batch 16, greedy: the same, of the copy bandwidth measured on the "
                               "same GPU", "{:.1%}"),
    "roofline_fraction_datasheet_sampled_bs64": ("GRPO rollouts, batch 64, sampled (temperature 1.0, top-p 1.0): "
                                                 "the same fraction, of the datasheet bandwidth", "{:.1%}"),
    "roofline_fraction_sampled_bs64": ("GRPO rollouts, batch 64, sampled: the same fraction, of the measured copy "
                                       "bandwidth", "{:.1%}"),
    "greedy_token_match_rate_bs64": ("GRPO rollouts, batch 64, greedy: the engine's tokens equal to HF's for the "
                                     "same prompts", "{:.1%}"),
    "vs_hf_generate_bs64": ("GRPO rollouts, batch 64: paged flex engine vs HF `generate` with a static cache "
                            "(the faster of eager and compiled where both ran)",
                            "{:.2f}x tokens/s"),
    "vs_hf_generate_sampled_bs64": ("GRPO rollouts, batch 64, sampled: paged flex engine vs the faster HF "
                                    "`generate` row, sampling too", "{:.2f}x tokens/s"),
    "vs_hf_generate_static_eager_bs64": ("GRPO rollouts, batch 64: paged flex engine vs HF `generate`, static cache, "
                                         "eager forward", "{:.2f}x tokens/s"),
    "vs_hf_generate_static_compiled_bs64": ("GRPO rollouts, batch 64: paged flex engine vs HF `generate`, static cache, "
                                            "compiled forward (HF's default on CUDA)", "{:.2f}x tokens/s"),
    "hf_ceiling_bs64": ("GRPO rollouts, batch 64: the most any engine could reach over the faster HF row (decode at "
                        "100% of the HBM roofline, prefill free)", "{:.2f}x"),
    "lora_refresh_fraction": ("GRPO rollouts, batch 64: LoRA refresh time as a fraction of rollout time",
                              "{:.1%}"),
    # engine ablations: one option changed against the default row of the same run
    "ours_paged_flex_block128_vs_default_block_bs64": ("GRPO rollouts, batch 64, same run: one KV block per page "
                                                       "(`kv_block_size: 128`) vs the default 64-token blocks",
                                                       "{:.3f}x tokens/s"),
    "ours_paged_flex_page64_vs_default_page_bs64": ("GRPO rollouts, batch 64, same run: 64-token pages vs the "
                                                    "default 128", "{:.3f}x tokens/s"),
    "ours_paged_flex_unfused_vs_default_fuse_bs64": ("GRPO rollouts, batch 64, same run: projections unfused "
                                                     "(`fuse_projections: false`) vs fused (the default)",
                                                     "{:.3f}x tokens/s"),
    "ours_paged_flex_kvwrite_op_vs_default_kvwrite_bs64": ("GRPO rollouts, batch 64, same run: K/V written by the "
                                                           "`kv_write` op (`fuse_kv_write: false`) vs the fused "
                                                           "scatter (the default)", "{:.3f}x tokens/s"),
    "ours_paged_flex_max_autotune_no_cudagraphs_vs_default_compile_bs64": (
        "GRPO rollouts, batch 64, same run: decode step compiled with `max-autotune-no-cudagraphs` vs the default "
        "mode", "{:.3f}x tokens/s"),
    # Gemma4-26B-A4B (MoE) LoRA at full depth (benchmarks/moe_lora.py)
    **{f"moe_ours_vs_hf_same_recipe_tps_{k}": (f"Gemma4-26B-A4B, all 30 layers, LoRA r=16 (experts included), one "
                                               f"GPU, {k} tokens: ours vs HF + PEFT with the same recipe (SDPA, "
                                               "grouped_mm experts, peft's fold of the expert adapters: its only "
                                               "way for 3-D parameters; selective AC, compile, chunked CE)",
                                               "{:.2f}x tokens/s") for k in ("8k", "16k")},
    **{f"moe_ours_vs_hf_defaults_tps_{k}": (f"Gemma4-26B-A4B, all 30 layers, LoRA r=16, one GPU, {k} tokens: ours "
                                            "vs HF + PEFT defaults (SDPA, eager experts, full AC, HF loss)",
                                            "{:.2f}x tokens/s") for k in ("8k", "16k")},
    **{f"moe_unmerged_vs_folded_expert_lora_tps_{k}": (f"Gemma4-26B-A4B LoRA, {k} tokens, same run: ours' expert "
                                                       "adapters unmerged in the grouped GEMMs vs peft's fold "
                                                       "(`lora.expert_adapters: folded`)", "{:.2f}x tokens/s")
       for k in ("8k", "16k")},
    **{f"moe_sliding_auto_vs_flex_tps_{k}": (f"Gemma4-26B-A4B LoRA, {k} tokens, same run: the sliding layers on FA4 "
                                            "(the Callback's `sliding: auto`) vs Flex (`sliding: flex`)",
                                            "{:.3f}x tokens/s") for k in ("8k", "16k")},
    **{f"moe_mfu_active_spec_{k}": (f"Gemma4-26B-A4B LoRA, {k} tokens, ours: MFU on active parameters (6 x active "
                                    "params x tokens + attention) of the bf16 datasheet peak", "{:.1%}")
       for k in ("8k", "16k")},
    **{f"moe_full_depth_lora_peak_mem_gib_{k}": (f"Gemma4-26B-A4B, all 30 layers, LoRA r=16, {k} tokens, ours: "
                                                 "peak allocated memory", "{:.1f} GiB") for k in ("8k", "16k")},
}
# Row values worth a README line: (benchmark, the row's identifying fields, metric, what it is, format).
ROW_HEADLINES: list[tuple[str, dict[str, Any], str, str, str]] = [
    ("train_throughput", {"row": "ours", "seq": 8192}, "mfu_spec",
     "training step, 8k tokens, ours: model FLOPs utilisation of the 989 TFLOP/s bf16 datasheet peak", "{:.1%}"),
    ("train_throughput", {"row": "ours", "seq": 8192}, "peak_mem_allocated_gb",
     "training step, 8k tokens, ours: peak allocated memory", "{:.1f} GiB"),
    ("train_throughput", {"row": "sdpa_recipe", "seq": 8192}, "peak_mem_allocated_gb",
     "training step, 8k tokens, HF SDPA with ours' recipe: peak allocated memory", "{:.1f} GiB"),
    ("train_throughput", {"row": "sdpa_defaults", "seq": 8192}, "peak_mem_allocated_gb",
     "training step, 8k tokens, HF SDPA defaults (full AC, no compile): peak allocated memory", "{:.1f} GiB"),
]
# Files a harness flaw found after the run keeps out of the README and the targets; docs/benchmarks.md lists
# them with the flaw. Only a re-run replaces one.
_EARLIER = ("written by the earlier training harness: its rows shared one process, so peaks carry memory an "
            "earlier row left alive, and it had no same-recipe baselines")
HARNESS_FLAWS = {
    "train_throughput_dp2": _EARLIER,
    "train_throughput_memory": _EARLIER,
    "fsdp_mesh_of_one": ("its no_fsdp row's model lost the lm_head/embedding tie at `to_empty` and held a second "
                         "2.6 GiB lm_head (static memory 2.6 GiB above the fsdp2 row's), so fsdp2_extra_peak_gib "
                         "is too small by that; fixed in 4335b7c, not re-run"),
    "context_parallel": ("written by the earlier CP harness: its Flex ring ran one fixed option set, not the best of "
                         "a sweep, and its CP=1 parity row ran the same ring code on a group of one (loss only, no "
                         "gradients); the current benchmarks/context_parallel.py needs two GPUs and has not run"),
}
FLAWED_COMMITS = {"fsdp_mesh_of_one": "1e87d5a", "context_parallel": "e3bc125"}  # a flaw fixed since: only that commit's file carries it


# Files the README cited whose runs predate the current code (a review of the result files found these): the
# README lists them under "History" with why, not among its headline numbers; docs/benchmarks.md and the targets
# mark them. Keyed by file and the commit it measured, so a re-run at HEAD (another commit) is current again.
# Counts are commits before 0f30921.
_UNSLOTH_ORDER = "its Unsloth row imported transformers before Unsloth (Unsloth's log: it may then run slower)"
_PEFT_FROZEN = ("its hf_peft_sdpa_recipe row ran FSDP2 with replicate_frozen=false where ours_lora ran auto: the "
                "peak-memory gap between the two rows is that setting; the row now takes ours' strategy options")
PREDATES: dict[str, tuple[str, str]] = {
    "rollout": ("9101ece", "measured at 9101ece (514 commits before 0f30921) with every row in one process, before "
                "the script ran one process per row; rollout_full_depth.json measures the engine as it is now"),
    "attention": ("cffd9f9", "measured at cffd9f9, 362 commits before 0f30921; not re-run since"),
    "nemo_backend": ("ca7476a", "measured at ca7476a, 369 commits before 0f30921; not re-run since"),
    "nemo_backend_step": ("ca7476a", "measured at ca7476a, 369 commits before 0f30921; not re-run since"),
    "grpo_vs_trl": ("35263b8", "measured at 35263b8, 302 commits before 0f30921, before grpo_vs_trl.py compared TRL "
                               "at equal loss type, reward scaling, KL and iterations with a reward that varies "
                               "within groups (cbe33bd)"),
    "full_depth_lora_unsloth": ("2cf6ae8", f"{_UNSLOTH_ORDER}; measured at 2cf6ae8, 341 commits before 0f30921"),
    "full_depth_lora_replicated": ("9b88859", f"{_UNSLOTH_ORDER}; measured at 9b88859, 311 commits before 0f30921"),
    "full_depth_lora": ("d2cee6e", _PEFT_FROZEN),
    "full_depth_lora_profile": ("e7e60b2", _PEFT_FROZEN),
}


def predates(stem: str, record: dict[str, Any]) -> str | None:
    """Why the result file `stem` (this `record` of it) predates the current code (it is kept under History), or
    None: the file of PREDATES' commit only, so a re-run replaces the mark with the file."""
    at, why = PREDATES.get(stem, ("", ""))
    return why if at and str(record.get("commit", "")).startswith(at) else None


def harness_flaw(stem: str, record: dict[str, Any]) -> str | None:
    """The harness flaw a result file carries, if any (one fixed since applies only to its commit's file)."""
    at = FLAWED_COMMITS.get(stem)
    return HARNESS_FLAWS.get(stem) if at is None or str(record.get("commit", "")).startswith(at) else None
STANDARD_KEYS = ("benchmark", "command", "commit", "tree", "date", "finished_at", "device", "versions", "rows", "summary",
                 "script_doc")
NOTE_KEYS = ("depth_note", "model_slice", "memory_note", "history_note", "partial_run")  # strings that qualify a file's headlines
# A file whose summary has a `history_note` is an earlier state kept for comparison: docs/benchmarks.md
# lists it, the README does not.


def script_name(record: dict[str, Any]) -> str:
    """The script that wrote a result file, from its recorded command (`python benchmarks/X.py ...`); the
    benchmark name where the command names none (a benchmark can be named for a variant, e.g. resume_full)."""
    found = re.search(r"benchmarks/(\w+)\.py|-m benchmarks\.(\w+)", str(record.get("command", "")))
    return (found.group(1) or found.group(2)) if found else record["benchmark"]


def script_doc(benchmark: str) -> str | None:
    """The module docstring of benchmarks/<benchmark>.py: what the rows are, as the script says."""
    import ast

    path = ROOT / "benchmarks" / f"{benchmark}.py"
    return ast.get_docstring(ast.parse(path.read_text())) if path.exists() else None


def cell(value: Any) -> str:
    """One table cell: numbers to 4 significant digits, dicts as k=v (zeros dropped), pipes escaped."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        text = f"{value:.4g}"
    elif isinstance(value, dict):
        text = ", ".join(f"{k}={cell(v)}" for k, v in value.items() if v not in (0, None, "", [], {}))
    elif isinstance(value, (list, tuple)):
        text = ", ".join(cell(v) for v in value)
    else:
        text = str(value)
    text = " ".join(text.split())
    if len(text) > 160:
        text = text[:157] + "..."
    return text.replace("|", "\\|")


def table(rows: list[dict[str, Any]], columns: list[str] | None = None) -> str:
    """A markdown table over the union of the rows' keys (first-seen order)."""
    if columns is None:
        columns = []
        for row in rows:
            columns += [k for k in row if k not in columns]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(row.get(c)) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def rel(path: Path, start: Path) -> str:
    """`path` relative to the folder `start` (for links)."""
    import os

    return Path(os.path.relpath(path, start)).as_posix()


def find_row(rows: list[dict[str, Any]], match: dict[str, Any]) -> dict[str, Any] | None:
    """The first row whose fields equal `match` and that carries no error."""
    return next((r for r in rows if "error" not in r and all(r.get(k) == v for k, v in match.items())), None)


def row_ref(match: dict[str, Any], metric: str) -> str:
    """How a headline names a row value, e.g. `rows[row=ours, seq=8192].mfu`."""
    return "rows[" + ", ".join(f"{k}={v}" for k, v in match.items()) + f"].{metric}"


def _reduced_depth(record: dict[str, Any]) -> bool:
    """Whether the file's depth_note says it ran fewer layers than the model has ("12 of 60 layers")."""
    m = re.match(r"(\d+) of (\d+) layers", str(record["summary"].get("depth_note", "")))
    return bool(m) and int(m.group(1)) < int(m.group(2))


def _priority(record: dict[str, Any]) -> tuple[int, bool]:
    """Position of the file's first recorded headline key in HEADLINES (same-recipe and peer ratios come first);
    at the same position a full-depth file comes before a reduced-depth ablation."""
    keys = list(HEADLINES)
    first = min((keys.index(k) for k, v in record["summary"].items() if k in HEADLINES and is_number(v)),
                default=len(keys))
    return first, _reduced_depth(record)


def qualifier(key: str, record: dict[str, Any]) -> str:
    """What a headline's own file says ran, where the key's text alone could claim more: the HF baseline of a
    rollout ratio ("eager only" when no compiled HF row finished at that batch), Unsloth's option row."""
    unsloth = re.fullmatch(r"full_depth_lora_\w+_vs_unsloth_tps_(\w+)", key)
    if unsloth:  # which of Unsloth's options the ratio divides by (the faster that ran), at what memory
        said = record["summary"].get(f"full_depth_lora_unsloth_baseline_{unsloth.group(1)}")
        ours, theirs = (record["summary"].get(k) for k in MEMORY_BARS.get(key, ("", "")))
        peaks = (f", at {ours:.1f} GiB peak allocated against Unsloth's {theirs:.1f} GiB"
                 if is_number(ours) and is_number(theirs) else "")
        return (f"; this run's Unsloth baseline: {said}" if isinstance(said, str) else "") + peaks
    found = re.fullmatch(r"vs_hf_generate(_sampled)?_bs(\d+)", key)
    if not found:
        return ""
    said = record["summary"].get(f"hf_baseline{found.group(1) or ''}_bs{found.group(2)}")
    if isinstance(said, str):
        return f"; this run's HF baseline: {said}"
    compiled = [r for r in record["rows"] if (r.get("name") or r.get("row")) == "hf_generate_static_compiled"
                and r.get("batch") == int(found.group(2)) and "error" not in r]
    return "" if compiled else "; this run's HF baseline: eager only (no compiled HF row finished at this batch)"


def _notes(record: dict[str, Any]) -> str:
    return "".join(f"; {record['summary'][k]}" for k in NOTE_KEYS if isinstance(record["summary"].get(k), str))


def _moe_repeat(key: str, record: dict[str, Any]) -> bool:
    """A dense roofline key on a MoE rollout file: its all-weights roofline, which the MoE keys already give; at
    small batches the step reads only the routed experts, so that denominator overstates the bytes."""
    return key.startswith("roofline_fraction") and any(k.startswith("moe_decode_routed_roofline")
                                                        for k in record["summary"])


def headline_lines(results: list[tuple[Path, dict[str, Any]]], link_from: Path) -> list[str]:
    """Per result file, the file whose headline comes first in HEADLINES first: a line naming the run, then one
    bullet per known summary key or row value. A key held by several files of the same benchmark and notes is
    shown once per GPU, from that card's newest run: an H100 run does not hide the H200 number."""
    lines = []
    newest: dict[tuple, Path] = {}
    by_priority = sorted(results, key=lambda pr: _priority(pr[1]))
    for path, record in sorted(reversed(by_priority), key=lambda pr: measured_at(pr[1])):  # ties: the first file
        for key, value in record["summary"].items():
            if key in HEADLINES and is_number(value):
                newest[(record.get("benchmark"), _notes(record), record.get("device"), key)] = path
    for path, record in by_priority:  # stable: file names break ties
        link = f"[`{path.name}`]({rel(path, link_from)})"
        notes = _notes(record)
        bullets = []
        for key, (what, fmt) in HEADLINES.items():
            value = record["summary"].get(key)
            if (is_number(value) and not _moe_repeat(key, record)
                    and newest[(record.get("benchmark"), notes, record.get("device"), key)] == path):
                what += qualifier(key, record)
                bullets.append(f"- **{fmt.format(value)}**: {what}. {link} (`summary.{key}`)")
        for bench, match, metric, what, fmt in ROW_HEADLINES:
            row = find_row(record["rows"], match) if record["benchmark"] == bench else None
            if row is not None and is_number(row.get(metric)):
                bullets.append(f"- **{fmt.format(row[metric])}**: {what}. {link} (`{row_ref(match, metric)}`)")
        if bullets:
            lines += [f"`{path.stem}` on {record.get('device', '?')}, {record.get('date', '?')}{notes}:", "",
                      *bullets, ""]
    return lines[:-1] if lines else lines


def clean_commit(record: dict[str, Any]) -> bool:
    """Whether the file names the one commit it measured (a hex sha, as results_io writes it, and no file of
    its recorded `tree` differing from that commit)."""
    differs = (record.get("tree") or {}).get("differs_from_commit")
    return bool(re.fullmatch(r"[0-9a-f]{7,40}", str(record.get("commit", "")))) and differs is not True


def tree_note(tree: dict[str, Any] | None) -> str:
    """The provenance line's tail for a file's `tree` (benchmarks/report/checkout.py): its digest and whether the
    files differed from the commit; empty for a file written before trees were recorded."""
    if not tree:
        return ""
    differs = {True: "differs from the commit", False: "as committed", None: "not compared (no git)"}
    return f"; tree: `{str(tree.get('sha256'))[:12]}` ({differs.get(tree.get('differs_from_commit'))})"


def current(results: list[tuple[Path, dict[str, Any]]]) -> list[tuple[Path, dict[str, Any]]]:
    """The files the README's headline numbers read: not kept as history, not predating the current code, without
    a harness flaw, and naming the one commit they measured."""
    return [(p, r) for p, r in _sound(results) if predates(p.stem, r) is None]


def historical(results: list[tuple[Path, dict[str, Any]]]) -> list[tuple[Path, dict[str, Any]]]:
    """The files that predate the current code (PREDATES) and are otherwise sound: the README's History section
    reads these, and the targets read them beside the current ones, marked."""
    return [(p, r) for p, r in _sound(results) if predates(p.stem, r) is not None]


def _sound(results: list[tuple[Path, dict[str, Any]]]) -> list[tuple[Path, dict[str, Any]]]:
    """Files not kept as history (`history_note`), without a harness flaw, naming the one commit they measured."""
    return [(p, r) for p, r in results if "history_note" not in r["summary"] and harness_flaw(p.stem, r) is None
            and clean_commit(r)]


def render_headline(results: list[tuple[Path, dict[str, Any]]]) -> str:
    """The README block between the BEGIN/END markers (history and flawed-harness files left out)."""
    lines = headline_lines(current(results), ROOT)
    if not lines:
        lines = ["- No benchmark has been recorded yet (`benchmarks/results/` is empty)."]
    body = "\n".join(lines)
    return (f"{BEGIN}\n{body}\n\nAll tables and plots: [docs/benchmarks.md](docs/benchmarks.md). "
            f"Regenerate with `python -m benchmarks.report`.\n{END}")


def render_history(results: list[tuple[Path, dict[str, Any]]]) -> str:
    """The README's History block: the headline numbers of files that predate the current code, each with why."""
    lines = [f"Each result file below {PREDATES_MARK}: it was measured before a change to the code or the harness "
             "named beside it, so its numbers are a record of that run, not a claim about this commit. The headline "
             "numbers above do not read them; re-running the file's command at HEAD replaces it.", ""]
    for path, record in sorted(historical(results), key=lambda pr: _priority(pr[1])):
        block = headline_lines([(path, record)], ROOT)
        if block:
            lines += [block[0], "", f"It {PREDATES_MARK}: {predates(path.stem, record)}.", *block[1:], ""]
    if len(lines) == 2:
        lines.append(f"No recorded file {PREDATES_MARK}.")
    return f"{HISTORY_BEGIN}\n" + "\n".join(lines).rstrip() + f"\n{HISTORY_END}"


def curated(rec: dict[str, Any]) -> bool:
    """Whether a result file gets a curated table: a benchmark of tables.CURATED, not kept as history."""
    return rec.get("benchmark") in CURATED and "history_note" not in rec.get("summary", {})


def _predates_note(stem: str, record: dict[str, Any]) -> str:
    """The curated table's mark for a file that predates the current code (its section below says why)."""
    return (f" **It {PREDATES_MARK}** ([History](../README.md#history)); its section below says why."
            if predates(stem, record) else "")


def _trimmed(lines: list[str]) -> list[str]:
    while lines and not lines[-1]:
        lines = lines[:-1]
    return lines


def curated_section(results: list[tuple[Path, dict[str, Any]]], link_from: Path, plotted: set[str]) -> list[str]:
    """'Curated tables': per curated result file, its provenance line, table(s) and plot."""
    order = list(CURATED)
    files = sorted(((p, r) for p, r in results if curated(r)), key=lambda pr: order.index(pr[1]["benchmark"]))
    if not files:
        return []
    out = ["## Curated tables", "",
           "The comparisons to read first, one table per result file. Every column header links the file and names "
           "the JSON field its cells come from; a ratio is printed only where the file's summary recorded it. "
           f"{tables.DASH} marks a row that failed or was skipped (the note under the table gives the first "
           "line of its error); an empty cell, a row that was not run; n/a, a field the row did not record "
           "(e.g. memory on CPU).", ""]
    for path, rec in files:
        what, render = CURATED[rec["benchmark"]]
        link = rel(path, link_from)
        notes = "".join(f"; {rec['summary'][k]}" for k in NOTE_KEYS if isinstance(rec["summary"].get(k), str))
        out += [f"### {what}: `{path.stem}`", "",
                f"[`{rel(path, ROOT)}`]({link}), {rec.get('device', '?')}, {rec.get('date', '?')}, "
                f"commit `{rec.get('commit', '?')}`{notes}.{_predates_note(path.stem, rec)}", "",
                *_trimmed(render(rec, link)), ""]
        if path.stem in plotted:
            out += [f"![{path.stem}](img/{path.stem}.png)", ""]
    return out


def render_benchmarks_md(results: list[tuple[Path, dict[str, Any]]], plotted: set[str]) -> str:
    """docs/benchmarks.md: per result file, its provenance, summary, rows and plot."""
    docs = BENCHMARKS_MD.parent
    out = [
        "# Benchmarks",
        "",
        "<!-- Generated by `python -m benchmarks.report` from benchmarks/results/*.json. Do not edit by hand. -->",
        "",
        "Every number on this page is read from a result file in `benchmarks/results/`. Each file records the",
        "exact command, commit, device and library versions of its run; files written since 2026-12-05 also record",
        "`tree`, a SHA-256 over the package, benchmark and example files as they were on disk, and whether they",
        "differed from the commit (benchmarks/report/checkout.py). Ratios in a summary come from rows measured in the same",
        "run. To record a run, run the benchmark script with `--out` and regenerate this page; see",
        "[How to reproduce](#how-to-reproduce).",
        "",
        *curated_section(results, docs, plotted),
        *render_targets(current(results) + historical(results), docs, rel,
                        {p.stem: PREDATES_MARK for p, _ in historical(results)}),
        "## Headline numbers",
        "",
        *(headline_lines(results, docs) or ["No benchmark has been recorded yet."]),
        "",
    ]
    for path, rec in results:
        name, script = path.stem, script_name(rec)  # several result files can come from one script
        link = f"[`{rel(path, ROOT)}`]({rel(path, docs)})"
        out += [f"## {name}", "", f"Source: {link}", ""]
        doc = rec.get("script_doc")
        if doc:
            out += [f"What `benchmarks/{script}.py` measured (its docstring when it ran):", "", "```text", doc,
                    "```", ""]
        elif doc := script_doc(script):
            out += [f"What `benchmarks/{script}.py` measures today (its current docstring: this file predates "
                    "recorded docstrings, and the script may have changed since it ran):", "", "```text", doc,
                    "```", ""]
        if not clean_commit(rec):
            out += ["**Provenance incomplete:** the file's `commit` is not one commit id, so it is not known which "
                    "code it measured. It is kept as a record and is not cited in the README or the targets; "
                    "re-run its script to replace it.", ""]
        if why := predates(name, rec):
            out += [f"**It {PREDATES_MARK}:** {why}. The README lists it under [History](../README.md#history), "
                    "not among its headline numbers; re-run its command at HEAD to replace it.", ""]
        if flaw := harness_flaw(name, rec):
            out += [f"**Harness flaw:** {flaw}. It is kept as a record and is not cited in the README or the "
                    "targets.", ""]
        out += [f"- device: {cell(rec.get('device'))}; date: {cell(rec.get('date'))}; "
                f"commit: `{cell(rec.get('commit'))}`" + tree_note(rec.get("tree")),
                f"- versions: {cell(rec.get('versions', {}))}",
                f"- command: `{cell(rec.get('command'))}`"]
        extras = {k: v for k, v in rec.items() if k not in STANDARD_KEYS}
        out += [f"- {k}: {cell(v)}" for k, v in extras.items()]
        out += ["", f"### {name}: summary ({link})", "",
                table([{"key": k, "value": v} for k, v in rec["summary"].items()]), ""]
        if name in plotted and not curated(rec):  # curated files show their plot beside their table
            out += [f"![{name}](img/{name}.png)", ""]
        link_rel = rel(path, docs)
        if kinds := tables.kernel_time(rec, link_rel) or tables.decode_kernel_time(rec, link_rel):
            out += [f"### {name}: kernel time by kind ({link})", "", *kinds]
        out += [f"### {name}: rows ({link})", "", table(rec["rows"]), ""]
    out += [
        "## How to reproduce",
        "",
        "Each script accepts `--out PATH`, records failing rows with their error instead of stopping, and prints",
        "a compact table at the end. The row-per-process scripts (`train_throughput`, `rollout`, `full_depth_lora`,",
        "`grpo_vs_trl`, `nemo_backend`) take `--rows`/`--seqs` (or `--batches`), a time budget (`--budget-s`, `--budget`) and",
        "`--resume`/`--merge` so that one table can be filled over several calls of at most ten minutes; each",
        "rewrites its file after every row; a row killed at its time limit leaves every thread's Python stack at",
        "the end of its log. Peers' packages (liger-kernel, trl, unsloth, the nemo-automodel wheel)",
        "are named in each script's docstring. All run on one H200 except context_parallel, which needs two GPUs:",
        "",
        "```bash",
        "python benchmarks/attention.py --out benchmarks/results/attention.json",
        "python benchmarks/train_throughput.py --seqs 8192 --rows ours sdpa_recipe sdpa_defaults liger_recipe "
        "--out benchmarks/results/train_throughput.json",
        "python benchmarks/train_throughput.py --resume benchmarks/results/train_throughput.json --seqs 8192 16384 "
        "32768 --rows flex_recipe ours sdpa_recipe --out benchmarks/results/train_throughput.json",
        "python benchmarks/full_depth_lora.py --rows ours_lora hf_peft_sdpa_recipe --seqs 8192 "
        "--out benchmarks/results/full_depth_lora.json",
        "python benchmarks/nemo_backend.py --parts op step --out benchmarks/results/nemo_backend.json",
        "python benchmarks/rollout.py --batches 64 --out benchmarks/results/rollout_full_depth.json",
        "python benchmarks/grpo_vs_trl.py --out benchmarks/results/grpo_vs_trl.json",
        "python benchmarks/rollout_attention.py --out benchmarks/results/rollout_attention.json",
        "python benchmarks/sliding_options.py --out benchmarks/results/sliding_options.json   # sliding-layer Flex options",
        "python benchmarks/fit_recipes.py --out benchmarks/results/fit_recipes.json   # every shipped YAML, as users run it",
        "python benchmarks/resume.py --variant lora --out benchmarks/results/resume_lora.json",
        "python benchmarks/context_parallel.py --seqs 32768 65536 --out benchmarks/results/context_parallel.json"
        "   # launches torchrun itself, 2 GPUs",
        "python -m benchmarks.report    # this page, the README headline block, docs/img/*.png",
        "```",
        "",
    ]
    return "\n".join(out)


def replace_block(text: str, block: str, begin: str = BEGIN, end: str = END) -> str:
    """`text` with the begin..end block swapped for `block` (which includes the markers)."""
    start, stop = text.find(begin), text.find(end)
    if start < 0 or stop < start:
        raise ValueError(f"README.md has no '{begin}' ... '{end}' block to fill")
    return text[:start] + block + text[stop + len(end):]


def write_pages(pages: dict[Path, str], command: str, check: bool) -> int:
    """Write generated pages, or with `check` return 1 (and name `command`) if any on disk is stale."""
    if check:
        stale = [str(p.relative_to(ROOT)) for p, text in pages.items() if not p.exists() or p.read_text() != text]
        if stale:
            print(f"stale: {stale}; run `{command}`", file=sys.stderr)
        return int(bool(stale))
    for path, text in pages.items():
        path.write_text(text)
        print(f"wrote {path.relative_to(ROOT)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="exit 1 if docs/benchmarks.md or README.md is stale")
    p.add_argument("--no-plots", action="store_true", help="do not redraw docs/img/*.png")
    args = p.parse_args(argv)

    from benchmarks.report import plots

    results = load_results()
    plotted = {path.stem for path, rec in results if plots.can_plot(rec)}
    readme = replace_block(README.read_text(), render_headline(results))
    pages = {BENCHMARKS_MD: render_benchmarks_md(results, plotted),
             README: replace_block(readme, render_history(results), HISTORY_BEGIN, HISTORY_END)}
    if args.check:
        return write_pages(pages, "python -m benchmarks.report", check=True)
    write_pages(pages, "python -m benchmarks.report", check=False)
    if not args.no_plots:
        for path in plots.draw_all(results):
            print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
