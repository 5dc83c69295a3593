"""Gemma4-26B-A4B (MoE: 128 experts, top-8) LoRA at full depth on one GPU: ours (the shipped recipe) against HF + PEFT.

Owns the rows below, their summary and the call (one process per (row, seq) through
`benchmarks/row_process.py`, a per-row timeout, a total `--budget-s`, the result rewritten after every row,
`--resume`). What the rows share with the 31B full-depth rows (step statistics, static memory, the FSDP2 recipe
as applied) comes from `benchmarks/lora_step.py`; the loss calls from `benchmarks/train_rows.py`.

Rows, each at --seqs (8k, 16k), batch 1, all 30 layers of the gemma4-26b-a4b preset (random weights initialised
for real), bf16 base, the recipe's LoRA (r=16, lora_alpha 32 on q/k/v/o and the dense MLP's gate/up/down, and
on the 3-D expert stacks `experts.gate_up_proj`, `experts.down_proj` through peft's `target_parameters`):
  ours            `configs/gemma4_26b_a4b.yaml` as a user runs it: `lightning_ffpa.cli.build(..., run=False)` with
                  one-GPU run overrides only (devices 1, max_steps, a tmp run dir, CSV logger, no checkpointing,
                  seq), the CLI's pre-flight, then `trainer.fit`.
  ours_folded_experts  ours with `lora.expert_adapters: folded`: peft folds W + s B A into every expert stack on each
                  forward (ours runs the expert adapters unmerged in the grouped GEMMs, `lightning_ffpa/experts.py`).
  ours_scatter_routing  ours with the routing's backward left to autograd's indexing (index_put into zeros, a scatter
                  with atomics: the code before 654d28d) in place of ours' gathers by the inverse permutation;
                  `moe_gather_vs_scatter_routing_tps_{8k,16k}`.
  ours_flex_sliding  ours with FFPAAttention's `sliding: flex` in place of the yaml's `auto` (FA4 on the sliding
                  layers where flash-attn-4 is installed); `moe_sliding_auto_vs_flex_tps_{8k,16k}`, recorded only when
                  ours' dispatch counts show FA4 ran.
  ours_save_mm_every_other, ours_save_mm_all  ours with only `strategy.sac_save_mm` changed. The yaml's `high_k`
                  saves a matmul when K exceeds the width (2816): at these shapes only o_proj, so the experts'
                  grouped GEMMs run again in the backward (`benchmarks/sac_accounting.py --preset gemma4-26b-a4b`
                  counts the bytes and FLOPs per rule); `moe_save_mm_{rule}_vs_high_k_tps_{8k,16k}`. On the H200:
                    python benchmarks/moe_lora.py --seqs 8192 --rows ours ours_save_mm_every_other ours_save_mm_all --out $OUT/moe_lora_save_mm_8k.json
  hf_same_recipe  ours' model and LoRA through HF Gemma4ForCausalLM + peft `get_peft_model`, SDPA for every
                  layer, `experts_implementation="grouped_mm"`, ours' recipe: the FSDP2Strategy options the yaml
                  gives ours (selective AC, per-layer compile, replicate_frozen), chunked linear CE, fused AdamW,
                  clip 1.0. It differs from ours in the model path only (attention kernels, Gemma4LM).
  unsloth_lora    the same LoRA through Unsloth (`benchmarks/unsloth_row.py`: imported first in its process, its
                  `FastModel` with the expert stacks as `target_parameters`, its offloaded checkpointing and loss);
                  what was tried and the exact error if it cannot run (`moe_ours_vs_unsloth_lora_tps_{8k,16k}`).
                  The device needs Unsloth's wheels (`DEVICE_EXTRA_WHEELS`, GPU_RUNS.md).
  hf_defaults     hf_same_recipe with HF's defaults: eager experts (`experts_implementation="eager"`, a loop over
                  experts), full activation checkpointing (every layer replayed), no compile, HF's loss (full
                  fp32 logits), torch's default AdamW (foreach); same FSDP2 placement and clip.
Timing: per-step wall time, CUDA-synchronised, after --warmup steps (compile happens there): median, min, max of
--steps steps; peak allocated and reserved memory over the timed steps.
FLOPs, two counts per row (lightning_ffpa/callbacks/throughput.py):
  `mfu_active_spec` (the issue's MFU on active parameters): 6 x active params x tokens + 3 x attention, where the
    active params are the base weights one token runs: each layer's attention projections, dense MLP, router
    and top_k=8 of the 128 experts' gate_up and down stacks, plus the lm_head (adapters and the embedding
    lookup not counted); attention is QK^T and PV (causal, or the 1024 window), forward + 2 x backward.
    `active_params` in the row gives the number: 3.82e9 at the preset's shapes (25.2e9 in all), so a step
    counts 214 TFLOPs at 8k and 462 at 16k (35% MFU of 989 TFLOP/s at 8k is a 618 ms step).
  `mfu_spec` (the LoRA count TokenThroughput logs): frozen matmuls 4 x, adapters 6 x (expert adapters at top_k
    of num_experts), attention 3 x.
Both against the datasheet bf16 peak (`peak_bf16_flops`: 989 TFLOP/s on H100 SXM and H200).
`--profile ROW ...`: those rows run one extra step after the timed ones under torch's profiler (`profile` of the row:
top CUDA kernels, GPU busy against wall time; not timed, not in the dispatch counts; the report sums the kernels by
kind). Where the step's time goes (routing, permutation, the grouped GEMMs, the un-permute), one H100 or H200:
  python benchmarks/moe_lora.py --seqs 8192 --rows ours ours_folded_experts hf_same_recipe --profile ours --row-timeout-s 300 --out $OUT/moe_lora_8k_profile.json
(ours compiles each MoE layer whole; the folded rows run much of it eager, so ours' first step takes longer)
One H200 (a call has 10 minutes; hf_defaults, eager experts under full AC without compile, is the slow row, so
it runs in a call of its own; `--resume` takes the earlier call's file, rows already measured are kept):
  python benchmarks/moe_lora.py --seqs 8192 --rows ours hf_same_recipe --out $OUT/moe_lora_8k.json
  python benchmarks/moe_lora.py --seqs 8192 --rows hf_defaults --resume FILE_8K --out $OUT/moe_lora_8k.json
  (the same two calls with --seqs 16384 and moe_lora_16k.json)
CPU smoke (tiny-moe preset, 2 layers, fp32, seq 128, one warm-up and one timed step, compile off):
  python benchmarks/moe_lora.py --cpu --out /tmp/moe_lora.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.lora_step import (  # noqa: E402
    ExtraStepProfile,
    config_overrides,
    fit_as_built,
    one_rank_group,
    place_peft_model,
    recipe_strategy_options,
    static_memory,
    step_stats,
    strategy_settings,
    sync,
)
from benchmarks.report import results_io  # noqa: E402
from benchmarks.report.results_io import RESULTS_DIR  # noqa: E402
from benchmarks.row_process import add_run_options, check_profiled_rows, driver_main, row_at, run_resumed_rows  # noqa: E402
from lightning_ffpa.errors import ConfigError  # noqa: E402

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "gemma4_26b_a4b.yaml"
ROWS = {
    "ours": "configs/gemma4_26b_a4b.yaml through lightning_ffpa.cli.build + trainer.fit (Gemma4LM, the yaml's "
            "FSDP2Strategy, FFPAAttention: FFPA on the D=512 layers, sliding: auto on the others; HF's grouped_mm "
            "experts as transformers sets them)",
    "ours_folded_experts": "ours with lora.expert_adapters: folded (peft's fold of W + s B A into every expert "
                           "stack on each forward, instead of ours' unmerged adapters in the grouped GEMMs)",
    "ours_scatter_routing": "ours with the routing's backward as autograd's indexing gives it (index_put into zeros: "
                            "a scatter with atomics) instead of ours' gathers by the inverse permutation "
                            "(experts._RouteRows), as before 654d28d",
    "ours_flex_sliding": "ours with FFPAAttention's sliding: flex (the sliding-window layers on Flex) instead of the "
                         "yaml's sliding: auto (FA4 where flash-attn-4 is installed and a call can take it)",
    **{f"ours_save_mm_{rule}": (f"ours with strategy.sac_save_mm: {rule} (the yaml's high_k saves only o_proj at "
                                f"26B-A4B's width: the experts' grouped GEMMs are recomputed in the backward)")
       for rule in ("every_other", "all")},
    "hf_same_recipe": "ours' model and LoRA through HF Gemma4ForCausalLM + peft, SDPA for all layers, "
                      "experts_implementation=grouped_mm, ours' recipe (the yaml's FSDP2Strategy options: selective "
                      "AC, per-layer compile, replicate_frozen; chunked linear CE, fused AdamW, clip 1.0)",
    "unsloth_lora": "Unsloth FastModel.from_pretrained + FastModel.get_peft_model, the recipe's LoRA (its linear "
                    "targets, and the expert stacks through target_parameters), Unsloth's own gradient checkpointing "
                    "and compiled loss; imported first in its process (benchmarks/unsloth_row.py)",
    "hf_defaults": "hf_same_recipe with experts_implementation=eager, full AC, no compile, HF's loss (full fp32 "
                   "logits) and torch's default (foreach) AdamW",
}
OURS_ROWS = ("ours", "ours_folded_experts", "ours_scatter_routing", "ours_flex_sliding", "ours_save_mm_every_other",
             "ours_save_mm_all")  # through cli.build
SAVE_MM_ROWS = {"ours_save_mm_every_other": "every_other", "ours_save_mm_all": "all"}
EXPERTS = {"hf_same_recipe": "grouped_mm", "hf_defaults": "eager"}
_SEQ_TAGS = {8192: "8k", 16384: "16k"}
_SHAPE_KEYS = ("preset", "layers", "warmup", "steps", "cpu")  # a resumed file must match these and the commit


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(RESULTS_DIR / "moe_lora.json"), help="result JSON path")
    p.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    p.add_argument("--profile", nargs="+", default=[], choices=list(ROWS), metavar="ROW",
                   help="rows that profile one extra step after the timed ones (top CUDA kernels, busy vs wall)")
    p.add_argument("--seqs", type=int, nargs="+", default=None, help="default 8192 16384 (128 with --cpu)")
    add_run_options(p, budget_s=560.0, row_timeout_s=400.0)
    p.set_defaults(warmup=None, steps=None)  # filled below: 2 and 5 on a GPU, 1 and 1 with --cpu
    p.add_argument("--cpu", action="store_true", help="smoke run on CPU: tiny-moe, 2 layers, fp32, compile off")
    p.add_argument("--summarize", default=None, metavar="PATH", help="only recompute the summary of a result file")
    args = p.parse_args(argv)
    args.preset, args.layers = ("tiny-moe", 2) if args.cpu else ("gemma4-26b-a4b", None)  # None: the preset's 30
    args.seqs = args.seqs or ([128] if args.cpu else [8192, 16384])
    args.warmup = (1 if args.cpu else 2) if args.warmup is None else args.warmup
    args.steps = (1 if args.cpu else 5) if args.steps is None else args.steps
    if args.summarize:
        return args
    if not args.cpu:
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("--cpu", False, "no CUDA GPU here: the rows measure on one GPU; pass --cpu for the "
                                              "tiny-moe smoke run")
        if args.steps < 5:
            raise ConfigError("--steps", args.steps, "a GPU run times at least 5 steps (median, min and max)")
    check_profiled_rows(args)
    if args.warmup < 1:
        raise ConfigError("--warmup", args.warmup, "needs at least one untimed step (compile, optimizer states)")
    return args


def _recipe() -> dict[str, Any]:
    import yaml

    return yaml.safe_load(CONFIG.read_text())


def recipe_lora() -> dict[str, Any]:
    """The yaml's LoRA options (the HF rows build the same adapters)."""
    return dict(_recipe()["model"]["init_args"]["lora"])


def experts_impls(model) -> dict[str, int]:
    """How many MoE expert modules run each `experts_implementation` (read on the model, not assumed)."""
    from lightning_ffpa._compat.transformers import experts_implementation

    found: dict[str, int] = {}
    for m in model.modules():
        if type(m).__name__.endswith("Experts"):  # HF's module, under peft's ParamWrappers
            impl = experts_implementation(m)
            found[impl] = found.get(impl, 0) + 1
    return found


# ----------------------------------------------------------------------------- row: ours (the product path)
def cli_args(spec: dict[str, Any], root: Path) -> list[str]:
    """`lightning-ffpa fit` words for ours: the shipped yaml plus one-GPU run overrides (no `fit`: run=False)."""
    listed = _recipe()["trainer"]["callbacks"]
    callbacks = [c for c in listed if not c["class_path"].endswith("ModelCheckpoint")]  # a save takes minutes
    if spec["row"] == "ours_flex_sliding":
        callbacks = [{**c, "init_args": {**c.get("init_args", {}), "sliding": "flex"}}
                     if c["class_path"].endswith("FFPAAttention") else c for c in callbacks]
    seq = spec["seq"]
    args = ["--config", str(CONFIG), "--trainer.enable_checkpointing", "false",
            "--trainer.callbacks", json.dumps(callbacks), "--trainer.devices", "1",
            "--trainer.max_steps", str(spec["warmup"] + spec["steps"] + bool(spec.get("profile"))), "--trainer.default_root_dir", str(root),
            "--trainer.logger", "lightning.pytorch.loggers.CSVLogger", "--trainer.logger.save_dir", str(root),
            "--trainer.log_every_n_steps", "1", "--model.init_args.preset", spec["preset"],
            "--model.init_args.dtype", spec["dtype"], "--model.init_args.max_seq_length", str(seq),
            "--data.init_args.seq_length", str(seq)]
    if spec["layers"] is not None:
        args += ["--model.init_args.config_overrides", json.dumps(config_overrides(spec))]
    if spec["cpu"]:
        args += ["--trainer.accelerator", "cpu", "--trainer.strategy.init_args.compile", "false",
                 "--trainer.strategy.init_args.param_dtype", "fp32", "--data.init_args.vocab_size", "512"]
    if spec["row"] == "ours_folded_experts":
        args += ["--model.init_args.lora.expert_adapters", "folded"]
    if spec["row"] in SAVE_MM_ROWS:
        args += ["--trainer.strategy.init_args.sac_save_mm", SAVE_MM_ROWS[spec["row"]]]
    return args


def strategy_init_args(spec: dict[str, Any]) -> dict[str, Any]:
    """ours' FSDP2Strategy options (the yaml's, with the overrides `cli_args` passes); hf_defaults then sets full
    AC and no compile."""
    options = recipe_strategy_options(_recipe(), cli_args(spec, Path(".")))
    if spec["row"] == "hf_defaults":
        options.update(activation_checkpointing="full", compile=False)
    return options


def measure_ours(spec: dict[str, Any]) -> dict[str, Any]:
    import torch
    from lightning.pytorch.callbacks import Callback

    from lightning_ffpa import attention, experts
    from lightning_ffpa._compat import torch as torch_compat
    from lightning_ffpa._compat import transformers as hf_compat
    from lightning_ffpa._compat.transformers import find_hf_model
    from lightning_ffpa.callbacks.throughput import train_flops_per_batch

    class StepClock(Callback):
        """Wall time between consecutive batch ends (synchronised); dispatch counts and peaks from the warm-up's end;
        --profile's extra step after the timed ones."""

        def __init__(self) -> None:
            self.times: list[float] = []
            self.losses: list[float] = []
            self.dispatch: dict[str, int] = {}
            self.last = 0.0
            self.extra = ExtraStepProfile(spec["warmup"] + spec["steps"] if spec.get("profile") else None)

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            self.extra.start_if_due(trainer)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            device = trainer.strategy.root_device
            sync(device)
            self.losses.append(float(outputs["loss"]))
            if self.extra.stop():  # the profiled step: not timed, not counted
                pass
            elif trainer.global_step > spec["warmup"]:
                self.times.append(time.perf_counter() - self.last)
                self.dispatch = attention.dispatch_counts()
            elif trainer.global_step == spec["warmup"]:
                attention.reset_dispatch_counts()
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
            self.last = time.perf_counter()

    if spec["row"] == "ours_scatter_routing":  # this row's process only: plain indexing, autograd's backward
        experts._RouteRows.apply = lambda src, index, inverse, group: src[index]
    root = Path(tempfile.mkdtemp(prefix="moe_ours_"))
    words = cli_args(spec, root)
    clock = StepClock()
    cli = fit_as_built(words, clock, reference_kernel=spec["cpu"])
    model = find_hf_model(cli.model)
    row = dict(built_by="lightning_ffpa.cli.build", cli_args=words, strategy=type(cli.trainer.strategy).__qualname__,
               callbacks=[type(c).__qualname__ for c in cli.trainer.callbacks], dispatch=clock.dispatch,
               attn_implementation=hf_compat.config_attn_implementation(model.config),
               lora=cli.model.hparams.lora, experts_implementation=experts_impls(model),
               expert_lora_paths=experts.path_counts(),
               # what this process ran: the Function's own apply (the gathers), or plain indexing put in its place
               routing_backward="index_put (autograd)" if "apply" in vars(experts._RouteRows) else "gather",
               graph_breaks=sum(torch_compat.dynamo_counters()["graph_break"].values()),
               global_step=cli.trainer.global_step, losses=clock.losses, static_memory=static_memory(cli.model),
               strategy_settings=strategy_settings(cli.trainer.strategy, model))
    if spec.get("profile"):
        row["profile"] = clock.extra.profile
    return _with_flops(row, clock.times, spec, model, cli.trainer.strategy.root_device, train_flops_per_batch)


# ----------------------------------------------------------------------------- rows: HF + PEFT
def hf_peft_model(spec: dict[str, Any]):
    """A one-rank process group and the preset's HF Gemma4 (SDPA, the row's experts) on meta with the recipe's
    LoRA: (peft model, text config, device)."""
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model

    from lightning_ffpa._compat.transformers import from_config
    from lightning_ffpa.lora import lora_hparam, peft_options
    from lightning_ffpa.presets import build_text_config

    device = one_rank_group(not spec["cpu"])
    cfg = build_text_config(spec["preset"], **config_overrides(spec))
    with torch.device("meta"):
        model = from_config(transformers.Gemma4ForCausalLM, cfg, dtype=getattr(torch, spec["dtype"]),
                            attn_implementation="sdpa", experts_implementation=EXPERTS[spec["row"]])
    lora = peft_options(lora_hparam(recipe_lora()))  # the product's reading of the yaml's options
    return get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", **lora)), cfg, device


def measure_hf(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    from benchmarks.step_probe import profile_step
    from benchmarks.train_rows import loss_fn
    from lightning_ffpa._compat import torch as torch_compat
    from lightning_ffpa._compat import transformers as hf_compat
    from lightning_ffpa.callbacks.throughput import train_flops_per_batch
    from lightning_ffpa.module import build_adamw

    model, cfg, device = hf_peft_model(spec)
    defaults = spec["row"] == "hf_defaults"
    strategy = place_peft_model(model, strategy_init_args(spec), device)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-5) if defaults else build_adamw(model, lr=1e-5)
    ids = torch.randint(0, cfg.vocab_size, (1, spec["seq"]), device=device,
                        generator=torch.Generator(device).manual_seed(0))
    losses, times, dynamo = [], [], torch_compat.dynamo_counters()
    dynamo.clear()

    def step() -> None:
        loss = loss_fn(dict(loss="plain" if defaults else "chunked"), model, ids)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())  # syncs

    for i in range(spec["warmup"] + spec["steps"]):
        if i == spec["warmup"]:
            sync(device)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        step()
        sync(device)
        if i >= spec["warmup"]:
            times.append(time.perf_counter() - t0)
    hf = model.get_base_model()
    row = dict(built_by="transformers.Gemma4ForCausalLM + peft.get_peft_model + FSDP2Strategy.parallelize_module",
               attn_implementation=hf_compat.config_attn_implementation(hf.config),
               experts_implementation=experts_impls(hf), lora=recipe_lora(), optimizer=type(opt).__qualname__,
               optimizer_fused=bool(opt.defaults.get("fused")), loss="HF forward(labels)" if defaults else "chunked",
               strategy_settings=strategy_settings(strategy, model), graph_breaks=sum(dynamo["graph_break"].values()),
               losses=losses, static_memory=static_memory(model))
    row = _with_flops(row, times, spec, hf, device, train_flops_per_batch)
    if spec.get("profile"):
        row["profile"] = profile_step(device, step)  # an extra step, after the peaks are read
    torch.distributed.destroy_process_group()
    return row


def _with_flops(row: dict[str, Any], times: list[float], spec: dict[str, Any], model, device,
                lora_count) -> dict[str, Any]:
    """The step statistics (LoRA-count MFU) and the MoE count: active params, their TFLOPs per step and MFU."""
    from lightning_ffpa.callbacks.throughput import active_params, active_train_flops_per_batch

    row.update(step_stats(times, spec["seq"], lora_count(model, 1, spec["seq"]), device))
    active = active_train_flops_per_batch(model, 1, spec["seq"])
    peak = row["spec_bf16_peak_tflops"]
    row.update(active_params=active_params(model), active_tflops_per_step=active / 1e12,
               flop_count="6 x active_params x tokens + 3 x attention (QK^T, PV) forward FLOPs",
               mfu_active_spec=active / (row["step_ms_median"] / 1e3) / (peak * 1e12) if peak else None)
    return row


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    """One (row, seq) in this process: the row's measurement, or an `error` saying why it has none."""
    if spec["row"] == "unsloth_lora":  # before anything imports transformers or peft in this process
        from benchmarks.unsloth_row import measure_unsloth

        return measure_unsloth({**spec, "smoke": spec["cpu"], "lora": recipe_lora()})
    row = (measure_ours if spec["row"] in OURS_ROWS else measure_hf)(spec)
    if not all(v == v and abs(v) < 1e4 for v in row["losses"]):
        row["error"] = f"non-finite loss {row['losses']}"
    return row


# ----------------------------------------------------------------------------- driver
def summarize(rows: list[dict]) -> tuple[dict, dict]:
    """The summary keys, and for each null one the reason."""
    summary, missing = {}, {}

    def put(key: str, value: Any, why: str | None) -> None:
        summary[key] = value
        if value is None:
            missing[key] = why or "no value recorded"

    for seq, tag in _SEQ_TAGS.items():
        (ours, why_ours) = row_at(rows, "ours", seq)
        for peer in ("hf_same_recipe", "hf_defaults", "unsloth_lora"):
            other, why_other = row_at(rows, peer, seq)
            put(f"moe_ours_vs_{peer}_tps_{tag}", ours["tokens_per_s"] / other["tokens_per_s"] if ours and other
                else None, "; ".join(filter(None, (why_ours, why_other))))
        folded, why_folded = row_at(rows, "ours_folded_experts", seq)
        put(f"moe_unmerged_vs_folded_expert_lora_tps_{tag}",
            ours["tokens_per_s"] / folded["tokens_per_s"] if ours and folded else None,
            "; ".join(filter(None, (why_ours, why_folded))))
        scatter, why_scatter = row_at(rows, "ours_scatter_routing", seq)
        put(f"moe_gather_vs_scatter_routing_tps_{tag}",
            ours["tokens_per_s"] / scatter["tokens_per_s"] if ours and scatter else None,
            "; ".join(filter(None, (why_ours, why_scatter))))
        flex, why_flex = row_at(rows, "ours_flex_sliding", seq)
        fa4_ran = bool(ours and sum(n for k, n in (ours.get("dispatch") or {}).items() if k.startswith("fa4")))
        put(f"moe_sliding_auto_vs_flex_tps_{tag}",
            ours["tokens_per_s"] / flex["tokens_per_s"] if ours and flex and fa4_ran else None,
            "; ".join(filter(None, (why_ours, why_flex))) or "ours' sliding layers ran Flex too (auto found no FA4)")
        for name, rule in SAVE_MM_ROWS.items():
            saving, why_saving = row_at(rows, name, seq)
            put(f"moe_save_mm_{rule}_vs_high_k_tps_{tag}",
                saving["tokens_per_s"] / ours["tokens_per_s"] if ours and saving else None,
                "; ".join(filter(None, (why_ours, why_saving))))
        put(f"moe_mfu_active_spec_{tag}", ours and ours.get("mfu_active_spec"),
            why_ours or "row ours recorded no datasheet peak (not a CUDA device)")
        put(f"moe_full_depth_lora_peak_mem_gib_{tag}", ours and ours.get("peak_mem_allocated_gb"),
            why_ours or "row ours recorded no device memory")
        oom = bool(why_ours and "out of memory" in why_ours.lower())  # ran and failed for memory: does not fit
        put(f"moe_full_depth_lora_fits_{tag}", True if ours else False if oom else None,
            why_ours or "row ours recorded no measurement")
    return summary, missing


def drive(args) -> None:
    kept, calls = results_io.load_resume(args.resume, {k: getattr(args, k) for k in _SHAPE_KEYS})
    done = {(r["row"], r["seq"]) for r in kept}
    dtype = "float32" if args.cpu else "bfloat16"
    specs = [dict(row=name, name=f"{name}_{seq}", seq=seq, preset=args.preset, layers=args.layers, dtype=dtype,
                  warmup=args.warmup, steps=args.steps, cpu=args.cpu, label=ROWS[name],
                  profile=name in args.profile)
             for seq in args.seqs for name in args.rows if (name, seq) not in done]
    run_resumed_rows(Path(__file__).resolve(), "moe_lora", specs, Path(args.out), (kept, calls), summarize,
                     args.row_timeout_s, args.budget_s, **{k: getattr(args, k) for k in _SHAPE_KEYS})


def main(argv: list[str] | None = None) -> None:
    driver_main(argv, "moe_lora.py", measure, parse_args, summarize, drive)


if __name__ == "__main__":
    from lightning_ffpa.errors import console_entry

    sys.exit(console_entry(main, hold=False))  # a bad option: exit 2 with one line, before any row runs
