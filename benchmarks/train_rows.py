"""The rows of the training-throughput benchmark, and one measurement of one row at one sequence length.

Owns what each row is (attention, activation checkpointing, compile, loss, optimizer, patches), how its model,
optimizer and loss are built, and how one (row, seq) is timed in the calling process. Does not own processes,
budgets, result files or the summary: `benchmarks/train_throughput.py` runs every (row, seq) here in a
process of its own and collects the rows.

Slice: real Gemma4-31B dims (hidden 5376, 32 heads, 16/4 kv heads, k_eq_v, window 1024, vocab 262144,
softcap 30), `--layers` deep with the last layer full attention, random weights initialised for real. Every
row runs FSDP2 (`parallelize`, the strategy's recipe) on a (dp, 1) mesh, bf16 params / fp32 reduce, batch 1. The
FP8 rows pass the strategy's `Float8Training` to the same call (torchao float8 emulated only on CPU, where nothing is
timed) and record what was converted; their FLOPs are counted as the bf16 rows' (bf16-equivalent MFU).
"""

from __future__ import annotations

import inspect
import os
import statistics
import time
import traceback
from functools import partial

import torch
import torch.nn.functional as F

from benchmarks.gpu_clocks import ClockSampler
from benchmarks.step_probe import phase_memory, profile_step
from lightning_ffpa._compat import torch as torch_compat
from lightning_ffpa._compat import transformers as hf_compat
from lightning_ffpa.attention import masks
from lightning_ffpa.callbacks.throughput import peak_bf16_flops, train_flops_per_batch
from lightning_ffpa.flex_options import LARGE_HEAD_DIM_CANDIDATES, flex_kernel_options
from lightning_ffpa.loss import linear_cross_entropy
from lightning_ffpa.module import build_adamw
from lightning_ffpa.parallel import Float8Training, FSDP2Strategy, causal_lm_hidden_states, parallelize
from lightning_ffpa.parallel.strategy import materialize
from lightning_ffpa.presets import build_text_config

__all__ = ["DEFAULT_ROWS", "FFPA_BACKEND_ATTN", "FP8_ROWS", "PRODUCT_SAVE_MM", "ROWS", "fp8_layout", "measure_row",
           "row_fp8", "sliding_kernel", "sliding_path_error"]

# "ours" and the recipe rows take the product's defaults, so the benchmark follows them when they change.
PRODUCT_SAVE_MM = inspect.signature(FSDP2Strategy).parameters["sac_save_mm"].default
_DEFAULTS = dict(attn="sdpa", ac="full", compile=False, loss="plain", optim="adamw_default")
_RECIPE = dict(ac="selective", compile=True, loss="chunked", save_mm=PRODUCT_SAVE_MM, optim="product")
# Each label says what differs from the row it is compared with.
ROWS: dict[str, dict] = {
    "sdpa_defaults": dict(_DEFAULTS, label="HF SDPA, full AC, no compile, HF loss (full logits), foreach AdamW: "
                                           "what a default Lightning + HF user gets"),
    "sdpa_recipe": dict(attn="sdpa", **_RECIPE, label="sdpa_defaults with ours' recipe: selective AC, per-layer "
                                                      "compile, chunked linear CE, fused AdamW"),
    "flex_recipe": dict(attn="flex", flex_options="sweep", **_RECIPE,
                        label="sdpa_recipe with Flex for all layers (D=512 options: the fastest of an op-level sweep "
                              "at this seq in the row's own process, recorded as flex_sweep)"),
    "liger_recipe": dict(attn="sdpa", **dict(_RECIPE, loss="liger"), patches="liger",
                         label="sdpa_recipe with liger-kernel's Gemma4 patches (RMSNorm, GEGLU MLP, fused linear CE "
                               "with softcap) in place of our chunked loss"),
    "ours": dict(attn="ffpa", **_RECIPE, label="sdpa_recipe with the ffpa backend: FFPA for the D=512 layers, "
                                               "block-sparse Flex for the sliding layers (FFPAAttention's sliding: flex)"),
    # Splits ours' gain over sdpa_recipe by kernel: against ours, FFPA's share; against sdpa_recipe, the sliding path's.
    "ours_sdpa_d512": dict(attn="sdpa_d512_ours_sliding", **_RECIPE,
                           label="ours with SDPA in place of FFPA on the D=512 layers, called as sdpa_recipe calls "
                                 "it; the sliding layers keep the product's block-sparse Flex path"),
    "liger_recipe_nocompile": dict(attn="sdpa", **dict(_RECIPE, loss="liger", compile=False), patches="liger",
                                   label="liger_recipe without per-layer compile (inductor cannot look into "
                                         "liger's Triton kernels)"),
    # Ablations (opt-in through --rows).
    "ffpa_defaults": dict(_DEFAULTS, attn="ffpa", label="sdpa_defaults with the ffpa backend only"),
    "flex_defaults": dict(_DEFAULTS, attn="flex", flex_options="sweep",
                          label="sdpa_defaults with Flex for all layers (the sweep's best D=512 options)"),
    "seed_gqa": dict(_DEFAULTS, attn="sdpa_gqa", label="sdpa_defaults with D=512 layers on SDPA enable_gqa (MATH)"),
    "ours_nocompile": dict(attn="ffpa", **dict(_RECIPE, compile=False), label="ours without per-layer compile"),
    "ours_every_other": dict(attn="ffpa", **dict(_RECIPE, compile=False, save_mm="every_other"),
                             label="ours_nocompile with SAC's every_other matmul rule"),
    "ours_all_mm": dict(attn="ffpa", **dict(_RECIPE, compile=False, save_mm="all"),
                        label="ours_nocompile with SAC saving every matmul"),
    "ours_sac_all_mm": dict(attn="ffpa", **dict(_RECIPE, save_mm="all"), label="ours with SAC saving every matmul"),
    "ours_foreach": dict(attn="ffpa", **dict(_RECIPE, compile=False, optim="adamw_default"),
                         label="ours_nocompile with foreach AdamW"),
    "ours_fa4_sliding": dict(attn="ffpa", sliding="fa4", **_RECIPE,
                             label="ours with the sliding layers on FA4 in place of block-sparse Flex (the ffpa "
                                   "backend's sliding='fa4', as FFPAAttention's `sliding: fa4` sets it); the D=512 "
                                   "layers keep FFPA"),
    # FP8 full fine-tuning: ours with only the strategy's `fp8` option changed (torchao float8 via Float8Training)
    "ours_fp8_rowwise": dict(attn="ffpa", **_RECIPE, fp8="rowwise",
                             label="ours with FSDP2Strategy(fp8='rowwise'): the decoder layers' linear layers in "
                                   "torchao float8 with rowwise scales; the lm_head and embeddings stay bf16"),
    "ours_fp8_tensorwise": dict(attn="ffpa", **_RECIPE, fp8="tensorwise",
                                label="ours with FSDP2Strategy(fp8='tensorwise'): the decoder layers' linear layers in "
                                      "torchao float8 with tensorwise scales, all-gathered in float8; the lm_head and "
                                      "embeddings stay bf16"),
}
FP8_ROWS = ("ours_fp8_rowwise", "ours_fp8_tensorwise")  # the faster one is compared with ours
DEFAULT_ROWS = ["ours", "ours_sdpa_d512", "sdpa_recipe", "sdpa_defaults", "liger_recipe", "liger_recipe_nocompile",
                "flex_recipe"]
# Rows whose attention is the ffpa backend's on some layers: the backend is registered as the product does.
FFPA_BACKEND_ATTN = ("ffpa", "sdpa_d512_ours_sliding")


# ----------------------------------------------------------------------------- attentions and patches
def d512_flex_options(index: int) -> dict:
    """The training kernel options of the flex rows' D=512 layers: LARGE_HEAD_DIM_CANDIDATES[index]."""
    return {**flex_kernel_options(256, "train"), **LARGE_HEAD_DIM_CANDIDATES[index]}


def sweep_flex_options(seq: int, device, preset: str, warmup: int = 2, iters: int = 5) -> tuple[int, list[dict]]:
    """Time every LARGE_HEAD_DIM_CANDIDATES set on the preset's full-attention op (causal, GQA, bf16), forward +
    backward, as the flex rows call it; (index of the fastest, one record per set). CPU: forward only.

    The sets only change the D=512 layers' kernels, so the op is where they differ; timing it costs seconds,
    where a training row per set costs minutes of compile.
    """
    from lightning_ffpa.attention.flex import flex_forward
    from lightning_ffpa.presets import PRESETS

    shape = PRESETS[preset]
    hq, hkv, d = shape["num_attention_heads"], shape["num_global_key_value_heads"], shape["global_head_dim"]
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    mask = masks.build_block_mask(masks.generate_causal(), 1, seq, seq, device)
    records = []
    for i, candidate in enumerate(LARGE_HEAD_DIM_CANDIDATES):
        options = d512_flex_options(i) if cuda else None  # eager on CPU
        record, q, k, v = dict(index=i, options=candidate), None, None, None
        try:
            q = torch.randn(1, hq, seq, d, device=device, dtype=dtype, requires_grad=cuda)
            k, v = (torch.randn(1, hkv, seq, d, device=device, dtype=dtype, requires_grad=cuda) for _ in range(2))
            times = []
            for n in range(warmup + iters):
                t0 = time.perf_counter()
                out = flex_forward(q, k, v, mask, 1.0, options=options)
                if cuda:  # eager Flex has no backward on CPU: the smoke run times the forward
                    out.sum().backward()
                    torch.cuda.synchronize(device)
                if n >= warmup:
                    times.append(time.perf_counter() - t0)
            record.update(mode="fwd+bwd" if cuda else "fwd", ms=statistics.median(times) * 1e3)
        except Exception as e:  # noqa: BLE001 - a set that fails (e.g. out of shared memory) is recorded, not used
            record["error"] = f"{type(e).__name__}: {e}"[:500]
        records.append(record)
        del q, k, v
        if cuda:
            torch.cuda.empty_cache()
    timed = [r for r in records if "ms" in r]
    if not timed:
        raise RuntimeError(f"no Flex option set ran at seq {seq}: {[r['error'] for r in records]}")
    return min(timed, key=lambda r: r["ms"])["index"], records


def register_baselines(flex_options: int | None) -> dict | None:
    """Register "sdpa_gqa", "flex" and "sdpa_d512_ours_sliding" with transformers; returns the D=512 flex options
    "flex" uses."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import sdpa_mask

    from lightning_ffpa.attention import counters
    from lightning_ffpa.attention.backend import ffpa_attention_forward, ffpa_mask
    from lightning_ffpa.attention.flex import flex_forward  # the product's compiled flex call

    def sdpa_gqa(module, query, key, value, attention_mask, scaling=None, **kwargs):
        """D=512 layers through SDPA enable_gqa (no mask, is_causal); others HF SDPA."""
        if module.head_dim != 512:
            return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling, enable_gqa=True)
        return out.transpose(1, 2).contiguous(), None  # (B, S, H, D)

    large = None if flex_options is None else d512_flex_options(flex_options)

    def flex(module, query, key, value, attention_mask, scaling=None, **kwargs):
        """Flex for both layer types (HF's own flex path fails at D=512); the swept options at D=512."""
        cuda = query.device.type == "cuda"
        opts = large if cuda and query.shape[-1] > 256 else None  # None: the shipped options (eager on CPU)
        out = flex_forward(query, key, value, attention_mask, scaling, options=opts)  # (B, H, S, D)
        return out.transpose(1, 2).contiguous(), None

    def flex_mask(*args, **kwargs):
        """The product's BlockMask for every layer type, causal ones included: built once per forward and
        layer type, before the compiled layers, as ours builds its sliding masks (built inside a compiled
        layer, Dynamo traces the mask construction into every layer's graph)."""
        return ffpa_mask(*args, **{**kwargs, "allow_is_causal_skip": False})

    def sdpa_d512_ours_sliding(module, query, key, value, attention_mask, scaling=None, **kwargs):
        """D=512 layers through HF's SDPA as sdpa_recipe calls them (the mask function gives them None: causal, as
        HF's sdpa mask does); the other layers through the ffpa backend, ours' sliding path."""
        if query.shape[-1] != 512:
            return ffpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
        counters.count("path", "sdpa", query)  # the row's dispatch shows where its D=512 calls went
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)

    hf_compat.register_attention("sdpa_gqa", sdpa_gqa)
    hf_compat.register_mask("sdpa_gqa", sdpa_mask)
    hf_compat.register_attention("flex", flex)
    hf_compat.register_mask("flex", flex_mask)
    hf_compat.register_attention("sdpa_d512_ours_sliding", sdpa_d512_ours_sliding)
    hf_compat.register_mask("sdpa_d512_ours_sliding", ffpa_mask)  # ours' masks: BlockMasks for the sliding layers
    return large


def apply_liger() -> dict:
    """liger-kernel's Gemma4 text patch, applied at class level before the model is built (this process only).

    The installed release must ship `apply_liger_kernel_to_gemma4_text`; its absence or an ImportError fails
    the row with the exact error (nothing is substituted).
    """
    import liger_kernel
    from liger_kernel.transformers import monkey_patch

    fn = getattr(monkey_patch, "apply_liger_kernel_to_gemma4_text", None)
    version = getattr(liger_kernel, "__version__", None)
    if version is None:
        from importlib.metadata import version as dist_version

        version = dist_version("liger-kernel")
    if fn is None:
        raise RuntimeError(f"liger-kernel {version} has no apply_liger_kernel_to_gemma4_text")
    fn(rope=False, cross_entropy=False, fused_linear_cross_entropy=True, rms_norm=True, geglu=True)
    return dict(liger_version=version, liger_patch="apply_liger_kernel_to_gemma4_text")


def liger_applied(model) -> dict:
    """Which Liger modules and forward the built model really runs (counted, not assumed)."""
    counts: dict[str, int] = {}
    for m in model.modules():
        name = type(m).__name__
        if name.startswith("Liger"):
            counts[name] = counts.get(name, 0) + 1
    forward = type(model).forward
    return dict(liger_modules=counts, liger_fused_linear_ce=getattr(forward, "__module__", "").startswith("liger_kernel"))


# ----------------------------------------------------------------------------- model, optimizer, loss
def measure_bf16_peak(device) -> float:
    """FLOP/s of an 8192^3 bf16 matmul on this device (the measured-peak MFU denominator)."""
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize(device)
    n, t0 = 20, time.perf_counter()
    for _ in range(n):
        a @ b
    torch.cuda.synchronize(device)
    return 2 * 8192**3 * n / (time.perf_counter() - t0)


def sliding_kernel(spec: dict, device, cfg) -> str:
    """The row's sliding-layer kernel, resolved as the FFPAAttention Callback resolves its `sliding` option: a row
    asking for FA4 where FA4 cannot run fails here (ConfigError with the reason) instead of timing Flex."""
    from lightning_ffpa.attention.plan import resolve_plan
    from lightning_ffpa.callbacks.attention import FFPAAttention

    # Gemma4 configs hold head_dim per layer (the global value raises where layers differ)
    head_dim = next(layer.head_dim for layer, kind in zip(cfg.per_layer_config, cfg.layer_types)
                    if kind == "sliding_attention")
    callback = FFPAAttention(attn_implementation="ffpa", sliding=spec.get("sliding", "flex"))
    return resolve_plan("ffpa", 1, callback, device, sliding_head_dim=head_dim).sliding_kernel


def sliding_path_error(spec: dict, dispatch: dict[str, int], fallbacks: dict[str, int]) -> str | None:
    """Why a row's timed steps did not run its sliding layers on the kernel its spec names (None: they did).
    The backend falls back to Flex per call, counted: a row labelled FA4 whose calls fell back is an error."""
    kernel = spec.get("sliding", "flex")
    if spec["attn"] != "ffpa" or kernel == "flex":
        return None
    fell_back = {k: v for k, v in fallbacks.items() if k.startswith(f"{kernel}_")}
    if fell_back or not dispatch.get(f"{kernel}-dense"):
        return (f"the sliding layers were to run {kernel} but the timed steps dispatched {dispatch} "
                f"(fallbacks {fallbacks})")
    return None


def row_fp8(spec: dict, device) -> Float8Training:
    """The row's FP8 choice, as `FSDP2Strategy(fp8=...)` holds it. Emulated only on CPU (the smoke run, which times
    nothing); a GPU row never emulates, so one below SM89 or without torchao fails as the strategy refuses."""
    recipe = spec.get("fp8", "none")
    return Float8Training(recipe, emulate=recipe != "none" and device.type == "cpu")


def fp8_layout(model, fp8: Float8Training) -> dict:
    """What an FP8 row converted: the strategy's record (`model.fp8_layout`) checked against the Float8Linear
    modules the built model holds. A row that converted nothing fails here: it would time a bf16 model."""
    if not fp8.enabled:
        return {}
    layout = getattr(model, "fp8_layout", None) or {"converted": [], "kept": []}
    held = sum(type(m).__name__ == "Float8Linear" for m in model.modules())
    if not layout["converted"] or held != len(layout["converted"]):
        raise RuntimeError(f"fp8={fp8.recipe}: parallelize recorded {len(layout['converted'])} converted modules "
                           f"and the model holds {held} Float8Linear: this row would not time FP8")
    return dict(fp8_converted=len(layout["converted"]), fp8_kept=layout["kept"], fp8_emulate=fp8.emulate,
                fp8_float8_all_gather=fp8.float8_all_gather, lm_head_type=type(model.lm_head).__name__)


def build_model(spec: dict, mesh, layers: int, device, preset: str):
    import transformers

    row_fp8(spec, device).check_device(device)  # the strategy's refusal (below SM89, no torchao), before any work
    types = ["sliding_attention"] * (layers - 1) + ["full_attention"]
    cfg = build_text_config(preset, num_hidden_layers=layers, layer_types=types)
    if spec["attn"] in FFPA_BACKEND_ATTN:
        from lightning_ffpa.attention import kernels, register_ffpa

        if spec["attn"] == "ffpa" and device.type == "cuda" and not kernels.ffpa_available():
            # An "ffpa" row timed on the sdpa fallback would be a silent mislabel: fail the row instead.
            raise RuntimeError(f"FFPA CuTeDSL unavailable: {kernels.ffpa_unavailable_reason()}")
        register_ffpa(sliding=sliding_kernel(spec, device, cfg))
    hf_compat.set_config_attn_implementation(cfg, "sdpa")
    with torch.device("meta"):
        model = transformers.Gemma4ForCausalLM(cfg)
    hf_compat.set_attn_implementation(model, spec["attn"])  # the FFPAAttention Callback's own setter
    fp8 = row_fp8(spec, device)
    strategy = FSDP2Strategy(activation_checkpointing=spec["ac"], compile=spec["compile"],  # product defaults
                             param_dtype="bf16" if device.type == "cuda" else "fp32", fp8=fp8.recipe,
                             fp8_emulate=fp8.emulate)
    parallelize(model, mesh, activation_checkpointing=spec["ac"], compile=spec["compile"],
                sac_save_mm=spec.get("save_mm", PRODUCT_SAVE_MM),
                mp_policy=strategy.mp_policy(), reshard_after_forward=True, fp8=strategy.fp8_training)
    materialize(model, device)  # the strategy's meta -> device init (HF _init_weights, real random values)
    bad = [n for n, p in model.named_parameters() if not torch.isfinite(p.to_local() if hasattr(p, "to_local") else p).all()]
    if bad:
        raise RuntimeError(f"non-finite weights after init: {bad[:3]}")
    model.train()
    return model


def build_optimizer(spec: dict, model):
    """The product's AdamW (`build_adamw`: fused on CUDA), or a plain user's AdamW (foreach on CUDA)."""
    if spec["optim"] == "product":
        return build_adamw(model, lr=1e-5)
    return torch.optim.AdamW(model.parameters(), lr=1e-5)


def loss_fn(spec: dict, model, ids):
    if spec["loss"] in ("plain", "liger"):  # HF's forward (liger's patched forward for "liger")
        return model(input_ids=ids, labels=ids, use_cache=False).loss
    hidden = causal_lm_hidden_states(model, input_ids=ids)  # (B, S, H)
    return linear_cross_entropy(hidden[:, :-1].flatten(0, 1), model.lm_head.weight, ids[:, 1:].flatten(),
                                softcap=model.config.final_logit_softcapping, chunk_size=4096)


def _step(spec, model, opt, ids, fp8: Float8Training) -> float:
    loss = loss_fn(spec, model, ids)
    loss.backward()
    _opt_step(opt, model, fp8)
    return loss.item()


def _opt_step(opt, model, fp8: Float8Training) -> None:
    opt.step()
    opt.zero_grad(set_to_none=True)
    fp8.after_optimizer_step(model)  # as the strategy's optimizer_step: tensorwise precomputes the float8 scales


# ----------------------------------------------------------------------------- one (row, seq)
def _progress(msg: str) -> None:
    """One line in the row's log (the driver keeps it), so a row killed by its timeout shows where it was."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def measure_row(name: str, seq: int, args, mesh, device, rank: int) -> dict:
    """Build row `name`, train `args.warmup` + `args.steps` steps at `seq`, and return its record."""
    spec = {k: v for k, v in ROWS[name].items()}
    row = dict(row=name, seq=seq, pid=os.getpid(), **spec)
    cuda = device.type == "cuda"
    try:
        if spec.get("flex_options") == "sweep":
            _progress(f"{name} seq={seq}: sweeping the D=512 Flex option sets")
            row["flex_options"], row["flex_sweep"] = sweep_flex_options(seq, device, args.preset)
            row["flex_d512_kernel_options"] = register_baselines(row["flex_options"])
        else:
            register_baselines(None)
        if spec.get("patches") == "liger":
            row.update(apply_liger())
        measured_peak = measure_bf16_peak(device) if cuda else None
        if cuda:
            torch.cuda.empty_cache()  # the matmul's blocks must not count in this row's reserved peak
        row["allocated_before_row_gb"] = torch.cuda.memory_allocated(device) / 2**30 if cuda else None
        if cuda:  # free device memory as the row starts: what other processes (the driver included) hold
            free, total = torch.cuda.mem_get_info(device)
            row.update(device_free_gb_at_start=free / 2**30, device_total_gb=total / 2**30)
        t_build = time.perf_counter()
        model = build_model(spec, mesh, args.layers, device, args.preset)
        row["build_s"] = time.perf_counter() - t_build
        _progress(f"{name} seq={seq}: model built in {row['build_s']:.1f} s")
        if spec.get("patches") == "liger":
            row.update(liger_applied(model))
        fp8 = row_fp8(spec, device)
        row.update(fp8_layout(model, fp8))
        opt = build_optimizer(spec, model)
        gen = torch.Generator(device=device).manual_seed(rank)
        ids = torch.randint(0, model.config.vocab_size, (1, seq), device=device, generator=gen)
        from lightning_ffpa import attention

        dynamo = torch_compat.dynamo_counters()
        dynamo.clear()
        losses, row["warmup_step_s"] = [], []
        for i in range(args.warmup):  # compiles here: each step's time says where a slow or killed row stood
            t0 = time.perf_counter()
            losses.append(_step(spec, model, opt, ids, fp8))
            row["warmup_step_s"].append(time.perf_counter() - t0)
            _progress(f"{name} seq={seq}: warm-up step {i + 1}/{args.warmup} took {row['warmup_step_s'][-1]:.1f} s")
        graphs_after_warmup = dynamo["stats"]["unique_graphs"]
        attention.reset_dispatch_counts()
        if cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        times = []
        with ClockSampler(device, interval_s=0.2) as clocks:  # did the GPU slow down in this row?
            for _ in range(args.steps):
                t0 = time.perf_counter()
                losses.append(_step(spec, model, opt, ids, fp8))  # .item() syncs
                times.append(time.perf_counter() - t0)
        row["gpu_clocks"] = clocks.summary()
        median = statistics.median(times)
        _progress(f"{name} seq={seq}: {args.steps} timed steps, median {median * 1e3:.1f} ms")
        flops = train_flops_per_batch(model, 1, seq)
        spec_peak = peak_bf16_flops(device)
        row.update(
            step_ms_median=median * 1e3, step_ms_min=min(times) * 1e3, step_ms_max=max(times) * 1e3,
            tokens_per_s_per_gpu=seq / median,
            peak_mem_allocated_gb=torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None,
            peak_mem_reserved_gb=torch.cuda.max_memory_reserved(device) / 2**30 if cuda else None,
            model_tflops_per_step=flops / 1e12,
            lm_head_flops_share=6 * model.lm_head.weight.numel() * seq / flops,
            # what FP8 linear layers can speed up: the decoder layers' 2-D weights (a full fine-tune: 3x forward)
            decoder_linear_flops_share=6 * seq * sum(p.numel() for p in model.model.layers.parameters()
                                                     if p.dim() == 2) / flops,
            spec_bf16_peak_tflops=spec_peak and spec_peak / 1e12,
            measured_bf16_peak_tflops=measured_peak and measured_peak / 1e12,
            mfu_spec=flops / median / spec_peak if spec_peak else None,  # of the datasheet bf16 peak
            mfu_measured_peak=flops / median / measured_peak if measured_peak else None,  # of the 8192^3 matmul
            first_loss=losses[0], last_loss=losses[-1], dispatch=attention.dispatch_counts(),
            fallbacks=attention.fallback_counts(),  # the backend's counted fallbacks, with their reasons
            # compile health: graph breaks, and graphs compiled during the timed steps (recompiles in timing)
            graph_breaks=sum(dynamo["graph_break"].values()),
            compiled_graphs=dynamo["stats"]["unique_graphs"],
            recompiles_timed=dynamo["stats"]["unique_graphs"] - graphs_after_warmup)
        # Untimed extra steps: where the memory goes, and (opt-in) where the time goes.
        row["memory_phases"] = phase_memory(device, partial(loss_fn, spec, model, ids), torch.Tensor.backward,
                                            partial(_opt_step, opt, model, fp8))
        if args.profile is not None:  # the driver passes a bare --profile to the rows it profiles
            row["profile"] = profile_step(device, partial(_step, spec, model, opt, ids, fp8))
        if not all(v == v and abs(v) < 1e4 for v in losses):
            row["error"] = f"non-finite loss {losses}"
        mislabelled = sliding_path_error(spec, row["dispatch"], row["fallbacks"])
        if mislabelled:
            row["error"] = mislabelled
    except Exception as e:  # noqa: BLE001 - the row records its error; the driver goes on with the next row
        traceback.print_exc()
        row["error"] = f"{type(e).__name__}: {e}"[:1500]
    return row
