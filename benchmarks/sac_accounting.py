"""What each SAC matmul rule saves and recomputes per decoder layer, counted on the meta device (no GPU).

Owns the accounting only (the rules live in lightning_ffpa/parallel/checkpointing.py). It builds a
1 sliding + 1 full layer model of a preset's real shapes on `meta`, wraps it with the product's
`parallelize(activation_checkpointing="selective", sac_save_mm=rule)`, runs one forward at batch 1 x seq
and records every policy answer with the bytes of the op's output and, for matmuls, the FLOPs a
recompute would redo. Attention goes through a counted stand-in op with the FFPA forward's outputs
(o in bf16, lse in fp32) that the policy must save, as it saves the real FFPA/flex/SDPA forwards.
Layer inputs that checkpoint itself keeps (hidden states) are the same for every rule and not counted.

Run: python benchmarks/sac_accounting.py --out $OUT/sac_accounting.json   (CPU, seconds)
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_ffpa._compat import transformers as hf_compat  # noqa: E402
from lightning_ffpa.parallel import checkpointing, parallelize  # noqa: E402
from lightning_ffpa.parallel.checkpointing import SAVE_MM_RULES, CheckpointPolicy  # noqa: E402
from lightning_ffpa.presets import build_text_config  # noqa: E402

_ATTN_OP = "lightning_ffpa_acct.attn.default"


@torch.library.custom_op("lightning_ffpa_acct::attn", mutates_args=())
def _attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    raise NotImplementedError("accounting stand-in: meta tensors only")


@_attn.register_fake
def _(q, k, v):
    b, h, s, d = q.shape
    return q.new_empty(b, s, h, d), q.new_empty(b, h, s, dtype=torch.float32)  # o (B, S, H, D), lse (B, H, S)


def _attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    out, _ = _attn(query, key, value)
    return out, None


def _nbytes(out) -> int:
    outs = out if isinstance(out, (tuple, list)) else (out,)
    return sum(t.numel() * t.element_size() for t in outs if isinstance(t, torch.Tensor))


def account(preset: str = "gemma4-31b", seq: int = 8192, rules=SAVE_MM_RULES, lora: dict | None = None) -> dict:
    """{rule: [per layer {layer_type, saved_bytes, saved_mm_bytes, recompute_mm_flops, mm_flops, saved_ops}]};
    `lora` (`model.lora` options) wraps the model in peft LoRA first, as the fit does before `parallelize`."""
    import transformers

    hf_compat.register_attention("acct", _attention)
    hf_compat.register_mask("acct", lambda *a, **k: None)
    types = ["sliding_attention", "full_attention"]
    cfg = build_text_config(preset, num_hidden_layers=2, layer_types=types, vocab_size=256)
    hf_compat.set_config_attn_implementation(cfg, "acct")
    result = {}
    real = checkpointing.sac_policy
    for rule in rules:
        records: dict[int, list] = defaultdict(list)
        held: dict[int, dict] = {}  # each invocation's `meta` kept alive: a freed one's id could key the next layer

        def recording(meta, save_ops, mm_ops, save_mm, ctx, op, *args, records=records, held=held, **kwargs):
            decision = real(meta, save_ops, mm_ops, save_mm, ctx, op, *args, **kwargs)
            held.setdefault(id(meta), meta)
            if not ctx.is_recompute:
                out = op(*args, **{k: v for k, v in kwargs.items() if k != "width"})
                flops, name = 0, str(op).removeprefix("aten.").removesuffix(".default")
                if op in mm_ops:
                    k = checkpointing.mm_reduction_dim(op, args)
                    flops, name = 2 * k * _nbytes(out) // out.element_size(), f"{name}(K={k})"
                records[id(meta)].append((name, decision == CheckpointPolicy.MUST_SAVE, _nbytes(out), flops))
            return decision

        checkpointing.sac_policy = recording
        try:
            with torch.device("meta"):
                model = transformers.Gemma4ForCausalLM(cfg).to(torch.bfloat16)
            if lora:
                from lightning_ffpa.lora import apply_lora, unwrap_peft

                # peft keeps the adapters in fp32; FSDP2's param_dtype computes them in bf16, as here
                model = unwrap_peft(apply_lora(model, lora)).to(torch.bfloat16)
            parallelize(model, None, activation_checkpointing="selective", sac_save_mm=rule,
                        sac_extra_save_ops=[_ATTN_OP])
            ids = torch.zeros(1, seq, dtype=torch.long, device="meta")
            masks = {t: None for t in types}  # a precomputed mapping skips HF mask building (needs .item())
            model.model(input_ids=ids, attention_mask=masks, use_cache=False)
        finally:
            checkpointing.sac_policy = real
        layers = []
        for layer_type, recs in zip(types, records.values()):
            mm = [r for r in recs if r[3] > 0]
            layers.append(dict(
                layer_type=layer_type,
                saved_bytes=sum(r[2] for r in recs if r[1]),
                saved_mm_bytes=sum(r[2] for r in mm if r[1]),
                mm_flops=sum(r[3] for r in mm),
                recompute_mm_flops=sum(r[3] for r in mm if not r[1]),
                saved_ops=[r[0] for r in recs if r[1]],
            ))
        result[rule] = layers
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="gemma4-31b")
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--sliding", type=int, default=5, help="sliding layers per full layer in the slice totals")
    p.add_argument("--out", default=None, help="result JSON path")
    args = p.parse_args()
    res = account(args.preset, args.seq)
    rows, mib = [], 2**20
    print(f"{'rule':12} {'layer':8} {'saved MiB':>10} {'mm MiB':>8} {'recompute GFLOP':>16}  saved ops")
    for rule, layers in res.items():
        for lay in layers:
            print(f"{rule:12} {lay['layer_type'][:7]:8} {lay['saved_bytes'] / mib:>10.0f} "
                  f"{lay['saved_mm_bytes'] / mib:>8.0f} {lay['recompute_mm_flops'] / 1e9:>16.0f}  {lay['saved_ops']}")
            rows.append(dict(rule=rule, seq=args.seq, **lay))
    summary = {}
    for rule, (sliding, full) in res.items():
        summary[f"{rule}_slice_saved_gib"] = (args.sliding * sliding["saved_bytes"] + full["saved_bytes"]) / 2**30
        summary[f"{rule}_slice_recompute_tflop"] = (
            args.sliding * sliding["recompute_mm_flops"] + full["recompute_mm_flops"]) / 1e12
    for k, v in summary.items():
        print(f"{k:36} {v:8.2f}")
    if args.out:
        from benchmarks.report.results_io import write_result

        write_result("sac_accounting", rows, summary, out=args.out, preset=args.preset, device_used="meta")


if __name__ == "__main__":
    main()
