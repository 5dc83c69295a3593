"""Full-depth LoRA on one GPU, the way people fine-tune Gemma4-31B: ours (the product path) against HF + PEFT and Unsloth.

Owns the rows below, the run (one process per (row, seq) through `benchmarks/row_process.py`, a per-row timeout,
a total `--budget-s`, the result rewritten after every row, `--resume` of an earlier call's file) and the
summary. The Unsloth row lives in `benchmarks/unsloth_row.py`; what the rows share (the LoRA FLOP
count, static memory, step statistics) in `benchmarks/lora_step.py`.

Rows, each at --seqs (8k, 16k), batch 1, all 60 layers of the gemma4-31b preset (random weights initialised for
real), LoRA r=16 (lora_alpha 32) on every linear layer of the decoder, bf16 base weights:
  ours_lora            `configs/gemma4_ffpa.yaml` built by `lightning_ffpa.cli.build(..., run=False)` with one-GPU
                       overrides (devices 1, max_steps, a tmp run dir, CSV logger, no checkpointing, `model.dtype
                       bfloat16`, the LoRA), the CLI's pre-flight, then `trainer.fit`.
  hf_peft_sdpa_recipe  the same model and LoRA through HF + PEFT (`get_peft_model`), SDPA for every layer, ours'
                       recipe: the FSDP2Strategy ours_lora's CLI builds (the yaml's strategy options with the same
                       overrides, `replicate_frozen` included: `strategy_init_args`) applied on one GPU, selective
                       AC, per-layer compile, chunked linear CE, fused AdamW, clip 1.0 (train_rows' `sdpa_recipe`
                       with a LoRA wrap). Both rows record `strategy_settings`; they differ in the model path only.
  unsloth_lora         the same LoRA through Unsloth's FastModel; what was tried and the exact error if it cannot run.
  ours_lora_fp8base    ours_lora with `model.lora.base_dtype: fp8` (the frozen base of every LoRA target stored
                       float8_e4m3fn with rowwise fp32 scales, `lightning_ffpa/fp8_base.py`). Not in the default
                       --rows (ask for it). It records the fit's start-up report (`fp8_base_conversion`: how many base
                       weights were converted and their bytes, `fp8_base_startup`: the module's line,
                       `fp8_base_matmul_path`) and the matmul path counts over the timed steps (`fp8_base_paths`,
                       `fp8_base.path_counts()`); a row that converted nothing, ran no float8-base matmul, or on CUDA
                       never took the scaled_mm (FP8 tensor-core) path is an error, not a number.
Timing: per-step wall time, CUDA-synchronised, after --warmup steps (compile happens there): median, min, max of
--steps steps; peak allocated and reserved memory over the timed steps. MFU counts LoRA FLOPs (frozen weights get
no weight-gradient matmul: 4 x frozen matmul params x tokens, 6 x adapter params x tokens, attention fwd + bwd)
against the datasheet bf16 peak (989 TFLOP/s on H200).

Why 60 layers fit one H200 (each row's `static_memory` counts it on the built model): the base is 30.70e9 params x
2 bytes (bf16) = 57.2 GiB. LoRA r=16 on all linear layers adds 122.4e6 params, which peft keeps in fp32: with
their gradients and two AdamW moments, 16 bytes each = 1.8 GiB. Frozen weights have no gradient or optimizer
state (a full fine-tune would need 16 bytes for each of the 30.7e9 params, 457 GiB), so ~59 GiB is static and the
rest of the 141 GiB holds activations (selective AC) and the bf16 layer FSDP2 gathers at a time.

`--profile ROW ...`: those rows run one extra step after the timed ones under torch's profiler (`profile` of the
row: top CUDA kernels, GPU busy against wall time; not timed, and not in the dispatch counts).
One H200, one call per seq (each well under 10 minutes):
  python benchmarks/full_depth_lora.py --rows ours_lora hf_peft_sdpa_recipe --seqs 8192 --out $OUT/full_depth_lora.json
  python benchmarks/full_depth_lora.py --rows ours_lora hf_peft_sdpa_recipe --seqs 16384 --resume FILE --out ...
The float8 base against ours in bf16 (`fp8_base_lora_vs_bf16_tps_{8k,16k}`, `fp8_base_lora_peak_mem_ratio_{8k,16k}`:
float8 row / ours_lora, tokens/s and peak allocated memory at that seq; one H200, ours_lora's bf16 base does not fit
an 80 GB H100 at full depth):
  python benchmarks/full_depth_lora.py --rows ours_lora ours_lora_fp8base --seqs 8192 --out $OUT/full_depth_lora_fp8base.json
and at 16384 one row per call (about 290 s each), `--resume FILE --budget-s 560 --row-timeout-s 540`.
A row killed at its timeout after it wrote its whole row (a slow exit) keeps its measurement; `--summarize FILE`
recomputes a file's summary with that rule (recorded in the file as `summary_recomputed`).
CPU smoke (tiny preset, 2 layers, fp32, seq 64, compile off, the FFPA op's CPU reference; the float8 row takes
the dequantise path there):
  python benchmarks/full_depth_lora.py --smoke --rows ours_lora hf_peft_sdpa_recipe ours_lora_fp8base --out /tmp/fdl.json
"""

from __future__ import annotations

import argparse
import json
import sys
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
from benchmarks.row_process import (  # noqa: E402
    add_run_options,
    check_profiled_rows,
    driver_main,
    fastest_row,
    row_at,
    run_resumed_rows,
)
from lightning_ffpa.errors import ConfigError  # noqa: E402

# No transformers at module level: an Unsloth row's process runs this file and must import Unsloth first.

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "gemma4_ffpa.yaml"
LORA = dict(r=16, lora_alpha=32, target_modules="all-linear")
ROWS = {
    "ours_lora": "configs/gemma4_ffpa.yaml through lightning_ffpa.cli.build + trainer.fit (Gemma4LM, FSDP2Strategy "
                 "with the yaml's replicate_frozen, FFPAAttention: FFPA for the D=512 layers, the yaml's sliding: auto for "
                 "the sliding layers: FA4 where it runs, else block-sparse Flex; the row's dispatch says which)",
    "ours_lora_offload": "ours_lora with activation_checkpointing=full, activation_offload=true (each layer's saved "
                         "input waits in pinned host memory), loss_chunk_size=1024 (a quarter of the chunked "
                         "loss's fp32 logits at a time) and replicate_frozen=false (the frozen base sharded by "
                         "FSDP2): ours at the memory Unsloth's offloading reaches",
    "ours_lora_offload_replicated": "ours_lora_offload with replicate_frozen=auto (on one GPU the frozen base "
                                    "stays out of FSDP2: no gathered copy of its units, the embedding's included)",
    "hf_peft_sdpa_recipe": "HF Gemma4ForCausalLM + peft get_peft_model, SDPA for all layers, ours' recipe (ours_lora's "
                           "FSDP2Strategy options, replicate_frozen included, on one GPU: selective AC, per-layer "
                           "compile, chunked linear CE, fused AdamW, clip 1.0)",
    "unsloth_lora": "Unsloth FastModel.from_pretrained + FastModel.get_peft_model (its gradient checkpointing, its "
                    "compiled Gemma4 forward and loss), fused AdamW, clip 1.0",
    "unsloth_lora_gc": "unsloth_lora with use_gradient_checkpointing=True (plain checkpointing) in place of its "
                       "offloaded \"unsloth\" mode: Unsloth's other option; the faster of the two is the baseline",
    "ours_lora_fp8base": "ours_lora with model.lora.base_dtype: fp8 (the frozen base of every LoRA target stored "
                         "float8_e4m3fn with rowwise fp32 scales)",
}
UNSLOTH_ROWS = ("unsloth_lora", "unsloth_lora_gc")
SHIPPED_LORA_ROW = "ours_lora"  # the recipe's options with LoRA, bf16 base: what ships (the float8 base is opt-in)
FP8_BASE_ROWS = ("ours_lora_fp8base",)  # rows whose LoRA stores its frozen base in float8 (`lora_of`)
OPT_IN_ROWS = FP8_BASE_ROWS  # not in the default --rows: the default set is already more than one call's budget
_SEQ_TAGS = {8192: "8k", 16384: "16k"}
_SHAPE_KEYS = ("preset", "layers", "warmup", "steps", "smoke")  # a resumed file must match these and the commit


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(RESULTS_DIR / "full_depth_lora.json"), help="result JSON path")
    p.add_argument("--rows", nargs="+", default=[r for r in ROWS if r not in OPT_IN_ROWS], choices=list(ROWS),
                   help=f"default: every row but {', '.join(OPT_IN_ROWS)}")
    p.add_argument("--seqs", type=int, nargs="+", default=None, help="default 8192 16384 (64 with --smoke)")
    add_run_options(p, budget_s=540.0, row_timeout_s=330.0)
    p.add_argument("--smoke", action="store_true", help="CPU: tiny preset, 2 layers, fp32, compile off")
    p.add_argument("--summarize", default=None, metavar="PATH", help="only recompute the summary of a result file")
    p.add_argument("--profile", nargs="+", default=[], choices=[r for r in ROWS if r not in UNSLOTH_ROWS], metavar="ROW",
                   help="rows that profile one extra step after the timed ones (top CUDA kernels, busy vs wall)")
    args = p.parse_args(argv)
    args.preset, args.layers = ("tiny", 2) if args.smoke else ("gemma4-31b", None)  # None: the preset's 60
    args.seqs = args.seqs or ([64] if args.smoke else [8192, 16384])
    if not args.smoke and args.steps < 5:
        raise ConfigError("--steps", args.steps, "a GPU run times at least 5 steps (median, min and max)")
    if args.warmup < 1:
        raise ConfigError("--warmup", args.warmup, "needs at least one untimed step (compile, optimizer states)")
    check_profiled_rows(args)
    return args


# ----------------------------------------------------------------------------- row: ours (the product path)
def lora_of(row: str) -> dict[str, Any]:
    """The row's `model.lora`: LORA, with `base_dtype: fp8` for a float8-base row (its one difference)."""
    return {**LORA, "base_dtype": "fp8"} if row in FP8_BASE_ROWS else dict(LORA)


def fp8_base_error(row: dict[str, Any], device_type: str) -> str | None:
    """Why a float8-base row holds no float8-base measurement, or None: no base weight was converted, no
    float8-base matmul ran in the timed steps, or on CUDA none took the FP8 tensor-core path (`scaled_mm`)."""
    conversion, paths = row.get("fp8_base_conversion") or {}, row.get("fp8_base_paths") or {}
    if not conversion.get("converted"):
        return f"no LoRA base weight was stored in float8 (the module's fp8_base report: {conversion or None})"
    if not sum(paths.values()):
        return (f"no float8-base matmul ran in the timed steps (fp8_base.path_counts(): {paths}): a row labelled "
                "fp8 that ran another base")
    if device_type == "cuda" and not paths.get("scaled_mm"):
        return (f"no float8 matmul (scaled_mm) ran on CUDA in the timed steps, only {paths}: every base matmul "
                "dequantised W0 to bf16")
    return None


def recipe_callbacks(window: int) -> tuple[list[dict], list[str]]:
    """The recipe's callbacks without checkpointing (a 31B save would take minutes and most of the disk) and
    with TokenThroughput's window at the timed steps (its own reading, beside ours), and the ones dropped."""
    import yaml

    listed = yaml.safe_load(CONFIG.read_text())["trainer"]["callbacks"]
    keep = [c for c in listed if not c["class_path"].endswith("ModelCheckpoint")]
    for c in keep:
        if c["class_path"].endswith("TokenThroughput"):
            c["init_args"] = {**c.get("init_args", {}), "window_size": window}
    return keep, [c["class_path"] for c in listed if c not in keep]


def cli_args(spec: dict[str, Any], root: Path) -> list[str]:
    """`lightning-ffpa fit` words for this row: the shipped recipe plus one-GPU overrides (no `fit`: run=False)."""
    seq, smoke = spec["seq"], spec["smoke"]
    args = ["--config", str(CONFIG), "--trainer.enable_checkpointing", "false",
            "--trainer.callbacks", json.dumps(recipe_callbacks(spec["steps"])[0]), "--trainer.devices", "1", "--trainer.max_steps", str(spec["warmup"] + spec["steps"] + bool(spec.get("profile"))),
            "--trainer.default_root_dir", str(root), "--trainer.logger", "lightning.pytorch.loggers.CSVLogger",
            "--trainer.logger.save_dir", str(root), "--trainer.log_every_n_steps", "1",
            "--model.init_args.preset", spec["preset"], "--model.init_args.dtype", spec["dtype"],
            "--model.init_args.lora", json.dumps(lora_of(spec["row"])), "--model.init_args.max_seq_length", str(seq),
            "--data.init_args.seq_length", str(seq)]
    if spec["layers"] is not None:
        args += ["--model.init_args.config_overrides", json.dumps(config_overrides(spec))]
    if spec["row"] in ("ours_lora_offload", "ours_lora_offload_replicated"):
        replicate = "auto" if spec["row"] == "ours_lora_offload_replicated" else "false"
        args += ["--trainer.strategy.init_args.activation_checkpointing", "full",
                 "--trainer.strategy.init_args.activation_offload", "true", "--model.init_args.loss_chunk_size", "1024",
                 "--trainer.strategy.init_args.replicate_frozen", replicate]
    if smoke:
        args += ["--trainer.accelerator", "cpu", "--trainer.strategy.init_args.compile", "false",
                 "--trainer.strategy.init_args.param_dtype", "fp32", "--data.init_args.vocab_size", "512"]
    return args


def strategy_init_args(spec: dict[str, Any]) -> dict[str, Any]:
    """ours_lora's FSDP2Strategy options: the recipe's `init_args` with the strategy overrides `cli_args` passes
    for this run. The HF + PEFT row builds its strategy from these, so the two cannot drift apart."""
    import yaml

    return recipe_strategy_options(yaml.safe_load(CONFIG.read_text()), cli_args({**spec, "row": "ours_lora"}, Path(".")))


def measure_ours(spec: dict[str, Any]) -> dict[str, Any]:
    import tempfile

    import torch
    from lightning.pytorch.callbacks import Callback

    from benchmarks.fit_recipes import read_metrics
    from benchmarks.gpu_clocks import ClockSampler
    from lightning_ffpa import attention, fp8_base
    from lightning_ffpa._compat import torch as torch_compat
    from lightning_ffpa._compat import transformers as hf_compat
    from lightning_ffpa._compat.transformers import find_hf_model
    from lightning_ffpa.attention import kernels
    from lightning_ffpa.callbacks.throughput import train_flops_per_batch

    class StepClock(Callback):
        """Wall time between consecutive batch ends (CUDA-synchronised); counters and peaks reset after warm-up."""

        def __init__(self) -> None:
            self.times: list[float] = []
            self.losses: list[float] = []
            self.last: float | None = None
            self.extra = ExtraStepProfile(spec["warmup"] + spec["steps"] if spec.get("profile") else None)
            self.counts: tuple[dict, dict, dict] = ({}, {}, {})
            self.clocks: ClockSampler | None = None

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            self.extra.start_if_due(trainer)  # --profile: one extra step after the timed ones, not timed

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            device = trainer.strategy.root_device
            sync(device)
            now = time.perf_counter()
            self.losses.append(float(outputs["loss"]))
            if self.extra.stop():  # the profiled step: not timed, not counted
                pass
            elif trainer.global_step > spec["warmup"]:
                self.times.append(now - self.last)
                # of the timed steps (the dispatch reset clears the float8-base path counts too)
                self.counts = (attention.dispatch_counts(), kernels.kernel_counts(), fp8_base.path_counts())
                if trainer.global_step == spec["warmup"] + spec["steps"]:
                    self.clocks.stop()
            elif trainer.global_step == spec["warmup"]:  # the last warm-up step: count from here
                attention.reset_dispatch_counts()
                self.graphs_after_warmup = torch_compat.dynamo_counters()["stats"]["unique_graphs"]
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                self.clocks = ClockSampler(device, interval_s=0.2).start()
            self.last = time.perf_counter()

    root = Path(tempfile.mkdtemp(prefix="fdl_ours_"))
    words = cli_args(spec, root)
    clock = StepClock()
    cli = fit_as_built(words, clock, reference_kernel=spec["smoke"])
    device = cli.trainer.strategy.root_device
    model = find_hf_model(cli.model)
    row = dict(built_by="lightning_ffpa.cli.build", cli_args=words, preflight="lightning_ffpa.validation.preflight",
               strategy=type(cli.trainer.strategy).__qualname__,
               callbacks=[type(c).__qualname__ for c in cli.trainer.callbacks],
               dropped_callbacks=recipe_callbacks(spec["steps"])[1], attn_implementation=hf_compat.config_attn_implementation(model.config),
               dispatch=clock.counts[0], kernels=clock.counts[1],
               graph_breaks=sum(torch_compat.dynamo_counters()["graph_break"].values()),
               recompiles_timed=torch_compat.dynamo_counters()["stats"]["unique_graphs"] - clock.graphs_after_warmup,
               global_step=cli.trainer.global_step, losses=clock.losses, static_memory=static_memory(cli.model),
               checkpoint_files=sorted(str(f.relative_to(root)) for f in root.rglob("*ckpt*")),
               # the recipe's TokenThroughput reading (its window may be longer than the run: then none)
               token_throughput_logged={k: v for k, v in read_metrics(root).items()
                                        if "per_sec" in k or "mfu" in k or "peak_memory" in k},
               activation_offload=cli.trainer.strategy.activation_offload_stats,
               strategy_settings=strategy_settings(cli.trainer.strategy, model),
               gpu_clocks=clock.clocks.summary() if clock.clocks else {"unavailable": "no timed steps"})
    row.update(step_stats(clock.times, spec["seq"], train_flops_per_batch(model, 1, spec["seq"]), device))
    if spec["row"] in FP8_BASE_ROWS:  # what the fit's start-up reported, and the paths the timed steps took
        report = getattr(cli.model, "fp8_base", None)  # HFModule keeps quantize_lora_bases' report
        row.update(fp8_base_conversion=report, fp8_base_paths=clock.counts[2],
                   fp8_base_matmul_path=list(fp8_base.matmul_path(device)),
                   fp8_base_startup=fp8_base.describe(report, device) if report else None)
        why = fp8_base_error(row, device.type)
        if why:
            row["error"] = why
    if spec.get("profile"):
        row["profile"] = clock.extra.profile
    return row


# ----------------------------------------------------------------------------- row: HF + PEFT, same recipe
def peft_model_on_meta(spec: dict[str, Any]):
    """A one-rank process group (nccl on the GPU, gloo in the smoke run) and the preset's Gemma4 (SDPA) built on
    meta with the run's LoRA: (peft model, text config, device, FSDP2 mixed-precision policy)."""
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model

    from lightning_ffpa._compat.transformers import from_config
    from lightning_ffpa.parallel import FSDP2Strategy
    from lightning_ffpa.presets import build_text_config

    cuda = not spec["smoke"]
    device = one_rank_group(cuda)
    cfg = build_text_config(spec["preset"], **config_overrides(spec))
    with torch.device("meta"):
        model = from_config(transformers.Gemma4ForCausalLM, cfg, dtype=getattr(torch, spec["dtype"]),
                            attn_implementation="sdpa")
    model = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", **LORA))
    return model, cfg, device, FSDP2Strategy(param_dtype="bf16" if cuda else "fp32").mp_policy()


def measure_hf_peft(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    from benchmarks.gpu_clocks import ClockSampler
    from benchmarks.step_probe import profile_step
    from benchmarks.train_rows import loss_fn
    from lightning_ffpa import attention
    from lightning_ffpa._compat import torch as torch_compat
    from lightning_ffpa._compat import transformers as hf_compat
    from lightning_ffpa.callbacks.throughput import train_flops_per_batch
    from lightning_ffpa.module import build_adamw

    model, cfg, device, _ = peft_model_on_meta(spec)
    # ours_lora's strategy options, so the rows differ in the model path only
    strategy = place_peft_model(model, strategy_init_args(spec), device)
    cuda = device.type == "cuda"
    opt = build_adamw(model, lr=1e-5)
    trainable = [p for p in model.parameters() if p.requires_grad]
    ids = torch.randint(0, cfg.vocab_size, (1, spec["seq"]), device=device, generator=torch.Generator(device).manual_seed(0))
    losses, times, dynamo = [], [], torch_compat.dynamo_counters()
    dynamo.clear()

    def step() -> None:
        loss = loss_fn(dict(loss="chunked"), model, ids)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())  # syncs

    clocks = ClockSampler(device, interval_s=0.2)  # over the timed steps: did the GPU slow down in this row?
    for i in range(spec["warmup"] + spec["steps"]):
        if i == spec["warmup"]:
            graphs_after_warmup = dynamo["stats"]["unique_graphs"]
            attention.reset_dispatch_counts()
            sync(device)
            if cuda:
                torch.cuda.reset_peak_memory_stats(device)
            clocks.start()
        t0 = time.perf_counter()
        step()
        sync(device)
        if i >= spec["warmup"]:
            times.append(time.perf_counter() - t0)
    clocks.stop()
    hf = model.get_base_model()
    row = dict(built_by="transformers.Gemma4ForCausalLM + peft.get_peft_model + lightning_ffpa.parallel.parallelize",
               attn_implementation=hf_compat.config_attn_implementation(hf.config), dispatch=attention.dispatch_counts(),
               strategy_settings=strategy_settings(strategy, model), graph_breaks=sum(dynamo["graph_break"].values()),
               recompiles_timed=dynamo["stats"]["unique_graphs"] - graphs_after_warmup, losses=losses,
               static_memory=static_memory(model), gpu_clocks=clocks.summary())
    row.update(step_stats(times, spec["seq"], train_flops_per_batch(hf, 1, spec["seq"]), device))
    if spec.get("profile"):
        row["profile"] = profile_step(device, step)  # an extra step, after the counts and peaks are read
    torch.distributed.destroy_process_group()
    return row


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    """One (row, seq) in this process: the row's measurement, or an `error` saying why it has none."""
    if spec["row"] in UNSLOTH_ROWS:
        from benchmarks.unsloth_row import measure_unsloth

        return measure_unsloth(spec)
    row = (measure_ours if spec["row"].startswith("ours_") else measure_hf_peft)(spec)
    if not all(v == v and abs(v) < 1e4 for v in row["losses"]):
        row["error"] = f"non-finite loss {row['losses']}"
    return row


# ----------------------------------------------------------------------------- driver
def summarize(rows: list[dict]) -> tuple[dict, dict]:
    """The summary keys, and for each null one the reason."""
    summary, missing = {}, {}
    short = {"ours_lora": "ours", "ours_lora_offload": "ours_offload",
             "ours_lora_offload_replicated": "ours_offload_replicated", "hf_peft_sdpa_recipe": "sdpa_recipe",
             "unsloth_lora": "unsloth"}
    pairs = (("ours_lora", "hf_peft_sdpa_recipe"), ("ours_lora", "unsloth_lora"), ("ours_lora_offload", "unsloth_lora"),
             ("ours_lora_offload_replicated", "unsloth_lora"))
    for seq, tag in _SEQ_TAGS.items():
        found = {name: row_at(rows, name, seq) for name in short if name not in UNSLOTH_ROWS}
        found["unsloth_lora"] = fastest_row(rows, UNSLOTH_ROWS, seq, "tokens_per_s")  # its ratio and peak are the faster row's
        baseline, why = found["unsloth_lora"]
        summary[f"full_depth_lora_unsloth_baseline_{tag}"] = baseline["row"] if baseline else None
        missing.update({f"full_depth_lora_unsloth_baseline_{tag}": why} if baseline is None else {})
        for mine, peer in pairs:
            (ours, why_ours), (other, why_other) = found[mine], found[peer]
            key = f"full_depth_lora_{short[mine]}_vs_{short[peer]}_tps_{tag}"
            summary[key] = ours["tokens_per_s"] / other["tokens_per_s"] if ours and other else None
            missing.update({key: "; ".join(filter(None, (why_ours, why_other)))} if summary[key] is None else {})
        for name, (row, why) in found.items():
            key = f"full_depth_lora_peak_mem_gb_{short[name]}_{tag}"
            summary[key] = row.get("peak_mem_allocated_gb") if row else None
            missing.update({key: why or f"row {name} recorded no device memory"} if summary[key] is None else {})
        # ours as the recipe ships it for one-GPU LoRA against Unsloth (its peak beside the ratio's, in MEMORY_BARS)
        (shipped, why_shipped), (peer, why_peer) = found[SHIPPED_LORA_ROW], found["unsloth_lora"]
        key = f"ours_vs_unsloth_shipped_recipe_tps_{tag}"
        summary[key] = shipped["tokens_per_s"] / peer["tokens_per_s"] if shipped and peer else None
        missing.update({key: "; ".join(filter(None, (why_shipped, why_peer)))} if summary[key] is None else {})
        # the float8 base against ours in bf16 (issue 43): tokens/s and peak allocated memory, float8 / bf16
        (fp8, why_fp8), (bf16, why_bf16) = row_at(rows, "ours_lora_fp8base", seq), found["ours_lora"]
        why = "; ".join(filter(None, (why_fp8, why_bf16)))
        for key, metric in ((f"fp8_base_lora_vs_bf16_tps_{tag}", "tokens_per_s"),
                            (f"fp8_base_lora_peak_mem_ratio_{tag}", "peak_mem_allocated_gb")):
            mine, theirs = (r.get(metric) if r else None for r in (fp8, bf16))
            summary[key] = mine / theirs if mine is not None and theirs else None
            missing.update({key: why or f"ours_lora_fp8base or ours_lora at seq {seq} recorded no {metric}"}
                           if summary[key] is None else {})
    return summary, missing


def load_resume(args) -> tuple[list[dict], list[dict]]:
    """Finished rows and call records of an earlier result (`--resume`), same commit and shape."""
    return results_io.load_resume(args.resume, {k: getattr(args, k) for k in _SHAPE_KEYS})


def drive(args) -> None:
    kept, calls = load_resume(args)  # before any row runs: a bad --resume costs nothing
    done = {(r["row"], r["seq"]) for r in kept}
    dtype = "float32" if args.smoke else "bfloat16"
    specs = [dict(row=name, name=f"{name}_{seq}", seq=seq, preset=args.preset, layers=args.layers, dtype=dtype,
                  warmup=args.warmup, steps=args.steps, smoke=args.smoke, lora=lora_of(name), label=ROWS[name],
                  profile=name in args.profile)
             for seq in args.seqs for name in args.rows if (name, seq) not in done]
    run_resumed_rows(Path(__file__).resolve(), "full_depth_lora", specs, Path(args.out), (kept, calls), summarize,
                     args.row_timeout_s, args.budget_s, **{k: getattr(args, k) for k in _SHAPE_KEYS})


def main(argv: list[str] | None = None) -> None:
    driver_main(argv, "full_depth_lora.py", measure, parse_args, summarize, drive)


if __name__ == "__main__":
    from lightning_ffpa.errors import console_entry

    sys.exit(console_entry(main, hold=False))  # a bad option: exit 2 with one line, before any row runs
