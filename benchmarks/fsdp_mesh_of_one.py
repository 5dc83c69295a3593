"""What FSDP2 costs in GPU memory on one GPU (a mesh of one), where it shards nothing.

Owns two rows, each in its own process, on the gemma4-31b preset's real shapes at reduced depth with the
full-depth LoRA run's recipe (bf16 base, LoRA r=16 on every linear layer, full AC, the chunked loss, AdamW):
  fsdp2    the product's `parallelize` over a 1x1 mesh: `fully_shard` per decoder layer and at the root, as
           `FSDP2Strategy` applies it on one GPU.
  no_fsdp  the same model with AC only (`parallelize(model, mesh=None)`): no parameter is gathered.
  fsdp2_replicate_frozen  fsdp2 with `replicate_frozen=True`: the product's fix, frozen weights out of FSDP2.
Each row records static memory (after the optimizer's first step), the peak over one step after a warm-up step,
and the parameter bytes of the root unit (embedding = tied lm_head, final norm) and of one decoder layer in the
dtype FSDP2 gathers them. On a mesh of one FSDP2 still copies each unit's parameters into an unsharded buffer
when it gathers (torch's world-size-1 path), the root's for the whole step (`reshard_after_forward=False`):
`summary.fsdp2_extra_peak_gib` is the peak difference, beside the root and layer sizes that would explain it;
`summary.replicate_frozen_saves_gib` is what `replicate_frozen` takes off the fsdp2 row's peak.
No timing claim: the rows are run for memory.

One H200 (about three minutes):  python benchmarks/fsdp_mesh_of_one.py --out $OUT/fsdp_mesh_of_one.json
CPU smoke (tiny preset, fp32, CPU memory is not measured): python benchmarks/fsdp_mesh_of_one.py --smoke --out F
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.report.results_io import RESULTS_DIR, write_result  # noqa: E402
from benchmarks.row_process import row_at, row_main, run_rows  # noqa: E402
from lightning_ffpa.errors import ConfigError  # noqa: E402

ROWS = {"fsdp2": "fully_shard per decoder layer and at the root over a 1x1 mesh (FSDP2Strategy on one GPU)",
        "no_fsdp": "fsdp2 without fully_shard: activation checkpointing only, no parameter gathered",
        "fsdp2_replicate_frozen": "fsdp2 with the frozen base out of FSDP2 (`replicate_frozen`, what "
                                  "FSDP2Strategy(replicate_frozen='auto') does on one GPU): only the adapters gathered"}
GIB = 2**30


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(RESULTS_DIR / "fsdp_mesh_of_one.json"), help="result JSON path")
    p.add_argument("--layers", type=int, default=6, help="decoder layers (the last one full attention)")
    p.add_argument("--seq", type=int, default=4096, help="tokens per step (batch 1)")
    p.add_argument("--row-timeout-s", type=float, default=240.0, help="one row's process is killed after this")
    p.add_argument("--smoke", action="store_true", help="CPU: tiny preset, fp32, seq 64")
    args = p.parse_args(argv)
    if args.layers < 2:
        raise ConfigError("--layers", args.layers, "needs at least one sliding and one full-attention layer")
    if args.smoke:
        args.seq = min(args.seq, 64)
    return args


def _unit_bytes(module, dtype) -> int:
    """Bytes of `module`'s parameters in the dtype FSDP2 gathers them (None: as stored)."""
    return sum(p.numel() * (p.element_size() if dtype is None else dtype.itemsize) for p in module.parameters())


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    from benchmarks.full_depth_lora import peft_model_on_meta
    from benchmarks.train_rows import loss_fn
    from lightning_ffpa._compat.transformers import find_decoder_layers
    from lightning_ffpa.module import build_adamw
    from lightning_ffpa.parallel import parallelize
    from lightning_ffpa.parallel.dims import ParallelDims
    from lightning_ffpa.parallel.strategy import materialize

    model, cfg, device, mp = peft_model_on_meta(spec)
    cuda = device.type == "cuda"
    hf = model.get_base_model()
    layers = getattr(*find_decoder_layers(hf))
    sizes = dict(root_unit_gib=(_unit_bytes(model, mp.param_dtype) - sum(_unit_bytes(la, mp.param_dtype)
                                                                         for la in layers)) / GIB,
                 one_layer_gib=max(_unit_bytes(la, mp.param_dtype) for la in layers) / GIB)
    mesh = ParallelDims(1).build_mesh(device.type) if spec["row"] != "no_fsdp" else None
    parallelize(model, mesh, activation_checkpointing="full", compile=False, mp_policy=mp,
                replicate_frozen=spec["row"] == "fsdp2_replicate_frozen")
    torch.manual_seed(0)
    materialize(model, device)  # keeps the plain model's lm_head tied too (its first run's flaw: see docs)
    model.train()
    opt = build_adamw(model, lr=1e-5)
    ids = torch.randint(0, cfg.vocab_size, (1, spec["seq"]), device=device)

    def step() -> float:
        loss = loss_fn(dict(loss="chunked"), model, ids)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    losses = [step()]  # the warm-up step creates the optimizer states
    row = dict(**sizes, fsdp_modules=sum(type(m).__name__.startswith("FSDP") for m in model.modules()),
               tied_lm_head=hf.lm_head.weight is hf.get_input_embeddings().weight)
    if cuda:
        torch.cuda.synchronize()
        row["static_allocated_gib"] = torch.cuda.memory_allocated(device) / GIB
        torch.cuda.reset_peak_memory_stats(device)
    losses.append(step())
    if cuda:
        row.update(peak_allocated_gib=torch.cuda.max_memory_allocated(device) / GIB,
                   peak_reserved_gib=torch.cuda.max_memory_reserved(device) / GIB)
    torch.distributed.destroy_process_group()
    return dict(row, losses=losses)


def summarize(rows: list[dict]) -> tuple[dict, dict]:
    seq = next((r.get("seq") for r in rows), None)
    found = {name: row_at(rows, name, seq) for name in ROWS}
    why = [w for _, w in found.values() if w]
    why += [f"row {name} recorded no GPU peak (it ran without a GPU)" for name, (r, _) in found.items()
            if r and "peak_allocated_gib" not in r]
    if why:
        return dict(fsdp2_extra_peak_gib=None), dict(fsdp2_extra_peak_gib="; ".join(why))
    by = {name: r for name, (r, _) in found.items()}
    fsdp2 = by["fsdp2"]
    return dict(fsdp2_extra_peak_gib=fsdp2["peak_allocated_gib"] - by["no_fsdp"]["peak_allocated_gib"],
                fsdp2_extra_static_gib=fsdp2["static_allocated_gib"] - by["no_fsdp"]["static_allocated_gib"],
                replicate_frozen_saves_gib=fsdp2["peak_allocated_gib"] - by["fsdp2_replicate_frozen"]["peak_allocated_gib"],
                root_unit_gib=fsdp2["root_unit_gib"], one_layer_gib=fsdp2["one_layer_gib"]), {}


def main(argv: list[str] | None = None) -> None:
    if row_main(argv, measure):  # a child: one row
        return
    args = parse_args(argv)
    preset, dtype = ("tiny", "float32") if args.smoke else ("gemma4-31b", "bfloat16")
    specs = [dict(row=name, name=name, label=label, preset=preset, layers=args.layers, seq=args.seq, dtype=dtype,
                  smoke=args.smoke) for name, label in ROWS.items()]
    out = Path(args.out)

    def save(rows: list[dict]) -> None:
        summary, missing = summarize(rows)
        write_result("fsdp_mesh_of_one", rows, summary, out=out, summary_missing=missing, preset=preset,
                     layers=args.layers, seq=args.seq, recipe="bf16 base, LoRA r=16 all-linear, full AC, chunked loss")

    run_rows(Path(__file__).resolve(), specs, out.parent / f"{out.stem}_logs", args.row_timeout_s,
             len(specs) * args.row_timeout_s, save)


if __name__ == "__main__":
    from lightning_ffpa.errors import console_entry

    sys.exit(console_entry(main, hold=False))  # a bad option: exit 2 with one line, before any row runs
