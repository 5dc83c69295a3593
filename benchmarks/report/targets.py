"""The performance targets and where each one stands, read from the result files (docs/benchmarks.md's table).

Owns the list of targets (summary key, bar, what it compares) and their rendering; a target's value is the
newest recorded number for its key, so the table follows the files and nothing in it is typed by hand.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.report.tables import is_number

__all__ = ["FITS", "TARGETS", "render_targets", "target_status"]

# (summary key, result file stem or None for any file, bar, strict, what is compared). "strict": the value must
# exceed the bar (ahead of a peer), else reach it.
TARGETS: list[tuple[str, str | None, float, bool, str]] = [
    ("ours_vs_sdpa_recipe_tps_8k", None, 1.6, False, "training step, 8k: ours vs SDPA, same recipe"),
    ("ours_vs_sdpa_recipe_tps_16k", None, 2.2, False, "training step, 16k: ours vs SDPA, same recipe"),
    ("ours_vs_sdpa_recipe_tps_32k", None, 2.7, False, "training step, 32k: ours vs SDPA, same recipe"),
    ("ours_vs_liger_tps_8k", None, 1.4, False, "training step, 8k: ours vs HF + liger-kernel, same recipe"),
    ("ours_mfu_spec_16k", None, 0.5, False, "training step, 16k: ours' MFU of the 989 TFLOP/s datasheet peak"),
    ("full_depth_lora_ours_vs_sdpa_recipe_tps_8k", None, 1.6, False,
     "60 layers, LoRA r=16, 8k: ours vs HF + PEFT with SDPA, same recipe"),
    ("full_depth_lora_ours_vs_unsloth_tps_8k", None, 1.0, True,
     "60 layers, LoRA r=16, 8k: ours vs Unsloth (and at equal or lower peak memory)"),
    ("full_depth_lora_ours_offload_vs_unsloth_tps_8k", None, 1.0, True,
     "60 layers, LoRA r=16, 8k: ours with full AC, activation offload and 1024-token loss chunks vs Unsloth (and at "
     "equal or lower peak memory)"),
    ("full_depth_lora_ours_offload_replicated_vs_unsloth_tps_8k", None, 1.0, True,
     "60 layers, LoRA r=16, 8k: the offload row with the frozen base out of FSDP2 (`replicate_frozen: auto`) vs "
     "Unsloth (and at equal or lower peak memory)"),
    ("ours_vs_nemo_backend_fwdbwd_8k", None, 1.0, False,
     "full-attention op, 8k, fwd+bwd: ours vs NeMo-Automodel's FFPA backend"),
    ("ours_vs_nemo_backend_step_tps_8k", None, 1.0, True,
     "training step, 8k: ours vs NeMo-Automodel's FFPA backend, same recipe"),
    ("roofline_fraction_datasheet_bs64", "rollout_full_depth", 0.85, False,
     "rollout decode, 60 layers, batch 64: fraction of the HBM roofline at the datasheet bandwidth"),
    ("moe_decode_routed_roofline_bs64", None, 0.60, False,
     "MoE rollout decode (Gemma4-26B-A4B), batch 64: fraction of the HBM roofline over the routed experts' bytes, "
     "at the datasheet bandwidth"),
    ("ours_vs_trl_step_speedup", None, 5.0, False, "GRPO optimizer step: ours vs TRL's GRPOTrainer"),
    ("grpo_full_depth_ours_vs_trl_step", None, 5.0, False,
     "GRPO optimizer step, 60 layers: ours vs TRL's GRPOTrainer (HF generate)"),
    ("grpo_full_depth_decode_roofline_datasheet_bs64", None, 0.75, False,
     "GRPO at full depth, batch 64: the decode's fraction of the datasheet HBM roofline inside the loop"),
    ("unmerged_lora_decode_overhead", None, 0.10, False, "decode: unmerged LoRA's share of decode time against "
     "the merged copy (at most)"),
    ("fp8_full_ft_vs_bf16_tps_16k", None, 1.3, False, "training step, 16k: FP8 full fine-tuning vs ours in bf16"),
    ("fp8_full_ft_final_loss_rel_diff", None, 0.01, False,
     "FP8 full fine-tuning, >= 200 steps: final loss against bf16, relative difference (at most)"),
    ("ours_mfu_bf16eq_spec_16k", None, 0.5, False,
     "training step, 16k, FP8: MFU in bf16-equivalent FLOPs of the bf16 datasheet peak"),
    ("fp8_base_lora_vs_bf16_tps_8k", None, 1.25, False, "60 layers, LoRA, 8k: the float8 frozen base vs bf16"),
    ("fp8_base_lora_peak_mem_ratio_8k", None, 0.6, False,
     "60 layers, LoRA, 8k: the float8 base's peak memory over bf16's (at most)"),
    ("ours_vs_unsloth_shipped_recipe_tps_8k", None, 1.0, True,
     "60 layers, LoRA r=16, 8k: ours as the recipe ships vs Unsloth (and at equal or lower peak memory)"),
    ("moe_ours_vs_hf_same_recipe_tps_8k", None, 1.5, False,
     "26B-A4B, 30 layers, LoRA, 8k: ours vs HF + PEFT with SDPA and grouped experts, same recipe"),
    ("moe_mfu_active_spec_8k", None, 0.35, False,
     "26B-A4B LoRA, 8k: MFU on active parameters of the 989 TFLOP/s datasheet peak"),
    ("grpo_full_depth_fits_4096", None, 1.0, False,
     "GRPO, 31B at full depth in bf16 with LoRA, 4096-token completions: the recipe fits one H200 (exit 0)"),
    ("moe_full_depth_lora_fits_16k", None, 1.0, False,
     "26B-A4B, 30 layers, LoRA, 16k: the recipe's step fits one H200"),
]
# Targets whose value is yes or no (a fit that ran to its end, or ran out of memory), not a number.
FITS = {"grpo_full_depth_fits_4096", "moe_full_depth_lora_fits_16k"}
# Targets whose value must stay at or under the bar.
AT_MOST = {"unmerged_lora_decode_overhead", "fp8_full_ft_final_loss_rel_diff", "fp8_base_lora_peak_mem_ratio_8k"}
_PERCENT = ("ours_mfu", "roofline", "moe_decode", "moe_mfu", "grpo_full_depth_decode", "unmerged_lora_decode",
            "fp8_full_ft_final_loss")
# Targets that also need ours' peak memory at or below the peer's: key -> (ours' memory key, the peer's), read
# from the same file as the ratio.
MEMORY_BARS: dict[str, tuple[str, str]] = {
    "full_depth_lora_ours_vs_unsloth_tps_8k": ("full_depth_lora_peak_mem_gb_ours_8k",
                                               "full_depth_lora_peak_mem_gb_unsloth_8k"),
    "full_depth_lora_ours_offload_vs_unsloth_tps_8k": ("full_depth_lora_peak_mem_gb_ours_offload_8k",
                                                       "full_depth_lora_peak_mem_gb_unsloth_8k"),
    "full_depth_lora_ours_offload_replicated_vs_unsloth_tps_8k": (
        "full_depth_lora_peak_mem_gb_ours_offload_replicated_8k", "full_depth_lora_peak_mem_gb_unsloth_8k"),
    "ours_vs_unsloth_shipped_recipe_tps_8k": ("full_depth_lora_peak_mem_gb_ours_8k",
                                              "full_depth_lora_peak_mem_gb_unsloth_8k"),
}


TARGET_CARD = "H200"  # the card the issues set the bars on; another card's number shows only where it has none


def _newest(results: list[tuple[Path, dict[str, Any]]], key: str, stem: str | None):
    """(path, record) of the newest file on the target card that recorded a number for `key` (any file, or only
    `stem`), else the newest on any card."""
    recorded = (lambda v: isinstance(v, bool)) if key in FITS else is_number
    found = [(p, r) for p, r in results if (stem is None or p.stem == stem) and recorded(r["summary"].get(key))]
    return max(found, key=lambda pr: (not other_card(pr[1]), measured_at(pr[1])), default=(None, None))


def other_card(record: dict[str, Any]) -> str:
    """The file's device where it names one other than the target card, else ""."""
    device = str(record.get("device") or "")
    return "" if not device or TARGET_CARD in device else device


def measured_at(record: dict[str, Any]) -> str:
    """When a file's last call ran ("YYYY-MM-DD HH:MM:SS" where the script records its calls or the writer its
    `finished_at`, else the day): two files of one day are told apart by the time of day."""
    return max([str(c.get("date", "")) for c in record.get("calls") or []]
               + [str(record.get(k, "")) for k in ("date", "finished_at")])


def target_status(value: float | None, bar: float, strict: bool, at_most: bool = False) -> str:
    if value is None:
        return "not measured"
    if at_most:
        return "met" if value <= bar else "missed"
    return "met" if (value > bar if strict else value >= bar) else "missed"


def memory_status(summary: dict[str, Any], key: str) -> tuple[str, str | None]:
    """(what to show beside the value, why the memory half of the target is missed or None)."""
    if key not in MEMORY_BARS:
        return "", None
    ours, peer = (summary.get(k) for k in MEMORY_BARS[key])
    if not (is_number(ours) and is_number(peer)):
        return "", "peak memory not recorded"
    shown = f" at {ours:.1f} vs {peer:.1f} GiB"
    return shown, None if ours <= peer else f"ours' peak memory is {ours - peer:.1f} GiB higher"


def render_targets(results: list[tuple[Path, dict[str, Any]]], link_from: Path, rel,
                   marked: dict[str, str] | None = None) -> list[str]:
    """Markdown lines: one table row per target, with the value, its status and the file it came from; a value
    read from a file of `marked` (stem -> mark, e.g. one that predates the current code) carries its mark."""
    out = ["## Targets", "",
           "Each target is a ratio, a fraction or whether a recipe fits, measured in one run on one GPU; the value is "
           "the newest H200 file's (another card's, named beside the file, only where no H200 run has it). "
           "Why a target is missed is written up in [performance notes](performance.md).", "",
           "| target | bar | measured | status | file (commit) |", "|---|---|---|---|---|"]
    for key, stem, bar, strict, what in TARGETS:
        path, rec = _newest(results, key, stem)
        value = rec["summary"][key] if rec else None
        bar_fmt, value_fmt = (("{:.0%}", "{:.1%}") if key.startswith(_PERCENT) else ("{:.2f}x",) * 2)
        bar_text = f"{'<=' if key in AT_MOST else '>' if strict else '>='} {bar_fmt.format(bar)}"
        shown = "-" if value is None else value_fmt.format(value)
        if key in FITS:
            bar_text, shown = "fits", "-" if value is None else "fits" if value else "does not fit"
        status = target_status(value, bar, strict, key in AT_MOST)
        if rec:
            mem_shown, mem_missed = memory_status(rec["summary"], key)
            shown += mem_shown
            status = f"missed: {mem_missed}" if status == "met" and mem_missed else status
        where = (f"[`{path.name}`]({rel(path, link_from)}) (`{str(rec.get('commit', '?'))[:7]}`"
                 f"{', ' + other_card(rec) if other_card(rec) else ''})" if path else "-")
        if path is not None and (marked or {}).get(path.stem):
            status += f" ({marked[path.stem]})"
        out.append(f"| {what} (`{key}`) | {bar_text} | {shown} | {status} | {where} |")
    return out + [""]
