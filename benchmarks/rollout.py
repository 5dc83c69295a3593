"""Rollout benchmark on one GPU: paged flex engine vs HF generate (static cache) and HF continuous batching.

Model: Gemma4-31B shapes (hidden 5376, 32 heads, 16/4 kv heads, head_dim 256/512, k_eq_v, vocab 262k) at
reduced depth (`--layers`, default 12 = 10 sliding + 2 full), random weights initialised with normal_(0.02).
Prompts: random 256-token prompts; greedy; `--new-tokens` (default 512) without EOS.
HF baselines: `generate` with a static cache, eager (`hf_generate_static`) and with the decoding forward
compiled, HF's own default for static caches on CUDA (`hf_generate_static_compiled`); `vs_hf_generate_*`
divides by the faster of the two measured. Continuous batching (`generate_batch`) is tried and its error
recorded when it fails.
Roofline: per decode step, bytes read = all weights (lm_head included, embedding rows excluded) + the
K and V each row needs (its positions so far, capped at the window on sliding layers; Gemma4's
k_eq_v layers still store V = v_norm(k) apart from K = rope(k_norm(k)), so both count), averaged
exactly over the decode positions, over the copy bandwidth (read + write) measured in this run.
That is the bytes a step must read, not what flex happens to read: whole pages are read, so
`kv_bytes_read_paged` (page-granular) is also reported, and it does not enter the fraction.
Decode mostly reads, so the fraction against a measured read bandwidth (a bf16 sum,
`roofline_fraction_read_bw`) is reported too; the target uses the copy bandwidth.

Rows `ours_paged_flex` run the engine's defaults: on CUDA the whole decode step is compiled before
capture (`EngineConfig.compile_decode=None`), fusing the small ops. Rows `ours_paged_flex_eager_step`
(`--eager-step-batches`, default 64) rerun a batch with `compile_decode=False`, the graphed eager step.

`--profile` records a few decode steps of the largest batch with torch.profiler: the top CUDA
kernels and GPU-busy vs wall time per step go into that row's `profile`.

    python benchmarks/rollout.py --batches 8,64 --hf-batches 8,64 --out $OUT/rollout.json
    python benchmarks/rollout.py --batches 8,64,256 --hf-batches 8,64 --profile --out $OUT/rollout.json

`--kernel-options PATH` installs flex kernel-option overrides first (`load_kernel_options`: a JSON list, or
the result of `benchmarks/rollout_attention.py`, whose summary holds the fastest valid decode options);
the overrides in force are recorded in the summary.
"""

from __future__ import annotations

import argparse
import gc
import logging
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.results_io import write_result  # noqa: E402
from lightning_ffpa._compat import transformers as hf_compat  # noqa: E402
from lightning_ffpa.presets import build_text_config  # noqa: E402

DEVICE = "cuda"


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _peak_gb() -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if DEVICE == "cuda" else float("nan")


def _reset_peak() -> None:
    if DEVICE == "cuda":
        torch.cuda.reset_peak_memory_stats()


def _free() -> None:
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


def copy_bandwidth(gb: float = 4.0) -> float:
    """Device copy bandwidth in bytes/s (read + write), best of 10."""
    n = int(gb * 2**30) // 2
    a = torch.empty(n, dtype=torch.bfloat16, device=DEVICE)
    b = torch.empty_like(a)
    best = float("inf")
    for _ in range(10):
        _sync()
        t = time.perf_counter()
        b.copy_(a)
        _sync()
        best = min(best, time.perf_counter() - t)
    del a, b
    return 2 * n * 2 / best


def read_bandwidth(gb: float = 4.0) -> float:
    """Device read bandwidth in bytes/s (a sum over `gb` of bf16), best of 10: decode mostly reads."""
    a = torch.ones(int(gb * 2**30) // 2, dtype=torch.bfloat16, device=DEVICE)
    best = float("inf")
    for _ in range(10):
        _sync()
        t = time.perf_counter()
        a.sum(dtype=torch.float32)
        _sync()
        best = min(best, time.perf_counter() - t)
    n = a.numel() * a.element_size()
    del a
    return n / best


def build_model(layers: int, preset: str = "gemma4-31b"):
    from transformers import Gemma4ForCausalLM

    cfg = build_text_config(preset, num_hidden_layers=layers)
    saved = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(DEVICE):
            model = Gemma4ForCausalLM(cfg)
    finally:
        torch.set_default_dtype(saved)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2:
                p.normal_(0.0, 0.02)  # real init: uninitialised memory distorts timing and sampling
            elif "norm" in name:
                p.fill_(1.0)
    model.generation_config.eos_token_id = None
    return model.eval(), cfg


def weight_bytes(model) -> int:
    emb = model.model.embed_tokens.weight
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    tied = model.lm_head.weight.data_ptr() == emb.data_ptr()
    # the head reads the whole vocab matrix each step; the embedding lookup reads a few rows
    return total if tied else total - emb.numel() * emb.element_size()


def timed(fn):
    _sync()
    t = time.perf_counter()
    out = fn()
    _sync()
    return out, time.perf_counter() - t


def kv_bytes_per_step(eng, plen: int, new: int) -> tuple[float, float]:
    """Mean K+V bytes one row needs / flex reads per decode step, over positions plen..plen+new-2.

    Needed: positions 0..p, the last `window` of them on sliding layers. Read: every page the step's
    block-mask row lists (whole pages, the union over the row's query block), i.e. what the kernel loads.
    """
    page = eng.config.page_size
    need = paged = 0.0
    positions = range(plen, plen + new - 1)  # decode step k writes position plen + k and attends 0..itself
    listed = {}
    for w, mask in eng.logical.items():
        full = mask.full_kv_num_blocks
        listed[w] = (mask.kv_num_blocks[0, 0] + (full[0, 0] if full is not None else 0)).tolist()
    for i, spec in enumerate(eng.walker.specs):
        per_tok = eng.cache.layer_bytes_per_token(i)
        for p in positions:
            lo = 0 if spec.window is None else max(0, p - spec.window + 1)
            need += per_tok * (p + 1 - lo)
            paged += per_tok * listed[spec.window][p // page] * page
    n = max(len(positions), 1)
    return need / n, paged / n


def profile_decode(eng, prompts, sampling, steps: int = 6, skip: int = 4, top: int = 20) -> dict:
    """Profile decode steps skip+1..skip+steps of one rollout: top CUDA kernels and GPU busy vs wall per step."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    # device events only on CUDA: less host overhead inside the timed window (CPU smoke runs record CPU ops)
    prof = profile(activities=[ProfilerActivity.CUDA if DEVICE == "cuda" else ProfilerActivity.CPU])
    decode, count, marks = eng._decode, [0], {}

    def counted(*args, **kwargs):  # starts/stops the profiler around whole decode steps only
        count[0] += 1
        if count[0] == skip + 1:
            _sync()
            prof.start()
            marks["t0"] = time.perf_counter()
        out = decode(*args, **kwargs)
        if count[0] == skip + steps:
            _sync()
            marks["t1"] = time.perf_counter()
            prof.stop()
        return out

    eng._decode = counted  # instance attribute shadows the method for this one rollout
    try:
        eng.generate(prompts, skip + steps + 2, sampling)
    finally:
        del eng._decode
    kernels: dict[str, list[float]] = {}
    spans = []
    for evt in prof.events():
        if evt.device_type != DeviceType.CUDA:
            continue
        start, end = evt.time_range.start, evt.time_range.end
        spans.append((start, end))
        k = kernels.setdefault(evt.name[:100], [0, 0.0])
        k[0] += 1
        k[1] += (end - start) / 1e3
    busy_us, last = 0.0, float("-inf")
    for start, end in sorted(spans):  # union of intervals: overlapping kernels count once
        if end > last:
            busy_us += end - max(start, last)
            last = end
    wall_ms = (marks["t1"] - marks["t0"]) * 1e3 if "t1" in marks else float("nan")
    rows = sorted(kernels.items(), key=lambda kv: -kv[1][1])[:top]
    return {"steps": steps, "wall_ms_per_step": wall_ms / steps, "gpu_busy_ms_per_step": busy_us / 1e3 / steps,
            "num_device_events": len(spans),
            "top_kernels": [{"name": n, "calls": c, "total_ms": round(t, 4)} for n, (c, t) in rows]}


def run_ours(model, cfg, prompts, new, bw, wbytes, page=128, profile=False, pipeline=True, compile_decode=None,
             read_bw=None):
    from lightning_ffpa.rollout.engine import EngineConfig, RolloutEngine
    from lightning_ffpa.rollout.sampler import SamplingParams

    bs, plen = len(prompts), len(prompts[0])
    max_len = -(-(plen + new) // page) * page
    ecfg = EngineConfig(page_size=page, num_pages=bs * (max_len // page) + 2, max_batch_size=bs,
                        max_seq_len=max_len, max_prefill_tokens=16384, pipeline=pipeline,
                        compile_decode=compile_decode)
    eng = RolloutEngine(model, ecfg)
    greedy = SamplingParams(temperature=0.0)
    _, t_warm = timed(lambda: eng.generate(prompts, 4, greedy))  # compiles flex, captures the bucket
    _, t_prefill = timed(lambda: eng.generate(prompts, 1, greedy))
    _reset_peak()
    seqs, t_total = timed(lambda: eng.generate(prompts, new, greedy))
    t_decode = max(t_total - t_prefill, 1e-9)
    kv_need, kv_paged = kv_bytes_per_step(eng, plen, new)
    step_bytes = wbytes + bs * kv_need
    ideal_tps = bs / (step_bytes / bw)
    decode_tps = bs * (new - 1) / t_decode
    res = {"tokens_per_s": bs * new / t_total, "decode_tokens_per_s": decode_tps,
           "roofline_fraction": decode_tps / ideal_tps,
           "roofline_fraction_read_bw": decode_tps / ideal_tps * bw / read_bw if read_bw else None,
           "step_bytes": step_bytes, "weight_bytes": wbytes,
           "kv_bytes_per_step": bs * kv_need, "kv_bytes_read_paged": bs * kv_paged,
           "decode_step_ms": t_decode / (new - 1) * 1e3, "ideal_step_ms": step_bytes / bw * 1e3,
           "total_s": t_total, "prefill_s": t_prefill, "warmup_s": t_warm,
           "peak_mem_gb": _peak_gb(), "graph_replays": eng.stats["graph_replays"],
           "eager_decodes": eng.stats["eager_decodes"], "syncs": eng.stats["syncs"],
           "pipeline": ecfg.pipeline, "decode_path": eng.decode_path, "attention_path": eng.attention_path,
           "tokens_generated": sum(len(s.output) for s in seqs)}
    if profile:
        try:
            res["profile"] = profile_decode(eng, prompts, greedy)
        except Exception as err:  # noqa: BLE001 - a profiler failure never loses the timed row
            res["profile"] = {"error": f"{type(err).__name__}: {err}"}
            traceback.print_exc()
    return res, eng


def run_hf_static(model, prompts, new, compiled=False):
    """HF `generate` with a static cache. compiled=True is HF's own default for static caches on CUDA (it
    compiles the decoding forward); False keeps HF eager."""
    ids = torch.tensor(prompts, device=DEVICE)
    kw = dict(do_sample=False, cache_implementation="static", pad_token_id=0, disable_compile=not compiled)
    timed(lambda: model.generate(ids, max_new_tokens=4, **kw))
    _reset_peak()
    out, t = timed(lambda: model.generate(ids, max_new_tokens=new, min_new_tokens=new, **kw))
    return {"tokens_per_s": ids.shape[0] * new / t, "total_s": t,
            "peak_mem_gb": _peak_gb()}, out[:, ids.shape[1]:]


GLOBAL_ACCESS = "allow_global_per_layer_attribute_access"


def run_hf_cb(model, prompts, new):
    from transformers import GenerationConfig

    saved = hf_compat.config_attn_implementation(model.config)
    # transformers' CB cache reads global kv-head counts, which Gemma4's heterogeneous config refuses
    # (AmbiguousGlobalPerLayerAttributeError) unless this flag is set; set for this baseline only.
    old_flag = getattr(model.config, GLOBAL_ACCESS, None)  # None: this transformers has no such guard
    if old_flag is not None:
        setattr(model.config, GLOBAL_ACCESS, True)
    try:
        errors = []
        for impl in ("sdpa_paged", "paged|sdpa"):  # transformers 5.17 name, then the newer spelling
            try:
                model.set_attn_implementation(impl)
                break
            except ValueError as err:
                errors.append(str(err)[:120])
        else:
            raise ValueError(f"no paged SDPA implementation: {errors}")
        gc_ = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0)
        model.generate_batch(inputs=prompts[:2], generation_config=GenerationConfig(
            max_new_tokens=4, do_sample=False, eos_token_id=None, pad_token_id=0))
        _reset_peak()
        with _CBErrors() as cb_errors:
            out, t = timed(lambda: model.generate_batch(inputs=prompts, generation_config=gc_))
        made = _count_cb_tokens(out)
        if made is not None and made != len(prompts) * new:  # CB logs failed requests instead of raising
            raise RuntimeError(f"continuous batching generated {made} of {len(prompts) * new} tokens: "
                               f"{cb_errors.first or 'no error logged'}")
        return {"tokens_per_s": len(prompts) * new / t, "total_s": t, "attn_implementation": impl,
                GLOBAL_ACCESS: old_flag is not None, "tokens_generated": made,
                "peak_mem_gb": _peak_gb()}
    finally:
        model.set_attn_implementation(saved)
        if old_flag is not None:
            setattr(model.config, GLOBAL_ACCESS, old_flag)


class _CBErrors(logging.Handler):
    """Collects the first exception transformers' continuous batching logs (it does not raise)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.first: str | None = None

    def emit(self, record: logging.LogRecord) -> None:
        if self.first is None and record.exc_info and record.exc_info[1] is not None:
            err = record.exc_info[1]
            self.first = f"{type(err).__name__}: {str(err)[:300]}"

    def __enter__(self) -> _CBErrors:
        logging.getLogger("ContinuousBatchingLogger").addHandler(self)
        return self

    def __exit__(self, *exc) -> None:
        logging.getLogger("ContinuousBatchingLogger").removeHandler(self)


def _count_cb_tokens(out) -> int | None:
    try:
        return sum(len(r.generated_tokens) for r in out.values())
    except Exception:  # noqa: BLE001 - the result type moved across transformers versions
        return None


def lora_refresh_s(model, inference, reps: int = 3) -> float:
    import copy

    from peft import LoraConfig, get_peft_model

    from lightning_ffpa.rollout.lora_sync import LoraSync

    train = get_peft_model(copy.deepcopy(model), LoraConfig(
        r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    sync = LoraSync(train, inference)
    sync.refresh()
    best = min(timed(sync.refresh)[1] for _ in range(reps))
    del train, sync
    return best


def summarize(rows: list[dict], bs: int = 64) -> dict:
    """Ratios at batch `bs` from the rows alone (so a run cut short can be summarised again, `--summarize`).

    `vs_hf_generate_bs64` divides by the faster HF static-cache variant measured; `hf_ceiling_bs64` is the
    most any engine could reach over that HF row: decode at 100% of the HBM roofline, prefill free.
    """
    def row(name):
        return next((r for r in rows if r.get("name") == name and r.get("batch") == bs and "tokens_per_s" in r), {})

    ours, eager = row("ours_paged_flex"), row("ours_paged_flex_eager_step")
    hf = {k: row(f"hf_generate_static{k}").get("tokens_per_s") for k in ("", "_compiled")}
    hf_best = max((v for v in hf.values() if v), default=None)
    out = {"roofline_fraction_bs64": ours.get("roofline_fraction")}
    if eager:
        out["roofline_fraction_bs64_eager_step"] = eager["roofline_fraction"]
        out["vs_hf_generate_bs64_eager_step"] = eager["tokens_per_s"] / hf_best if hf_best else None
    if ours and hf_best:
        out["vs_hf_generate_bs64"] = ours["tokens_per_s"] / hf_best
        for k, v in hf.items():
            if v:
                out[f"vs_hf_generate_static{k or '_eager'}_bs64"] = ours["tokens_per_s"] / v
        out["hf_ceiling_bs64"] = bs / (ours["ideal_step_ms"] / 1e3) / hf_best
    if ours.get("lora_refresh_s") is not None:
        out["lora_refresh_fraction"] = ours["lora_refresh_s"] / ours["total_s"]
    prof = next((r["profile"] for r in rows if "profile" in r and "error" not in r["profile"]), None)
    if prof:
        out["profile_gpu_busy_fraction"] = prof["gpu_busy_ms_per_step"] / prof["wall_ms_per_step"]
    return out


def resummarize(path: str) -> None:
    """Recompute the summary of a result file in place (rows untouched; marks a partial run)."""
    import json

    record = json.loads(Path(path).read_text())
    partial = record["summary"].get("partial", False)
    record["summary"] = {**{k: v for k, v in record["summary"].items() if k != "partial"}, **summarize(record["rows"])}
    if partial:
        record["summary"]["partial_run"] = "cut short by its time limit; summary recomputed from the saved rows"
    Path(path).write_text(json.dumps(record, indent=2) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--batches", default="8,64", help="8,64,256 also fits one H200 (not default: time)")
    ap.add_argument("--hf-batches", default="8,64")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=512)
    ap.add_argument("--out", default=None)
    ap.add_argument("--preset", default="gemma4-31b", help="model shape (tiny: CPU smoke test of this script)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--page-size", type=int, default=128)
    ap.add_argument("--bandwidth-gb", type=float, default=4.0)
    ap.add_argument("--profile", action="store_true", help="profile a few decode steps at the largest batch")
    ap.add_argument("--eager-step-batches", default="64",
                    help="also run these batches with EngineConfig.compile_decode=False (the graphed eager step)")
    ap.add_argument("--no-hf-compiled", dest="hf_compiled", action="store_false",
                    help="skip HF generate with its compiled static-cache forward (HF's CUDA default; slow to compile)")
    ap.add_argument("--no-pipeline", action="store_true", help="read every decode step back before the next")
    ap.add_argument("--kernel-options", default=None,
                    help="JSON of flex kernel-option overrides (e.g. a benchmarks/rollout_attention.py result)")
    ap.add_argument("--summarize", default=None, metavar="PATH",
                    help="only recompute the summary of an existing result file (e.g. a run cut short)")
    args = ap.parse_args()
    if args.summarize:
        return resummarize(args.summarize)
    from lightning_ffpa.rollout.attention import kernel_option_overrides, load_kernel_options

    if args.kernel_options:  # before any engine exists: captured graphs keep the kernels they were built with
        load_kernel_options(args.kernel_options)
    global DEVICE
    DEVICE = args.device
    rows, summary = [], {}
    bw = copy_bandwidth(args.bandwidth_gb)
    read_bw = read_bandwidth(args.bandwidth_gb)
    rows.append({"name": "copy_bandwidth", "bytes_per_s": bw, "read_bytes_per_s": read_bw})
    model, cfg = build_model(args.layers, args.preset)
    wbytes = weight_bytes(model)
    g = torch.Generator().manual_seed(0)

    def save_partial() -> None:  # a run cut short by a time limit still leaves its finished rows
        if args.out:
            write_result("rollout", rows, {"partial": True}, out=args.out)

    batches = [int(b) for b in args.batches.split(",")]
    hf_batches = [int(b) for b in args.hf_batches.split(",") if b]
    eager_batches = [int(b) for b in args.eager_step_batches.split(",") if b]
    for bs in batches:
        prompts = torch.randint(2, cfg.vocab_size, (bs, args.prompt_len), generator=g).tolist()
        eager = [False] if bs in eager_batches else []
        for compile_decode in (None, *eager):
            ablation = compile_decode is False
            name = "ours_paged_flex_eager_step" if ablation else "ours_paged_flex"
            row = {"name": name, "batch": bs, "layers": args.layers, "new_tokens": args.new_tokens}
            eng = None
            try:
                res, eng = run_ours(model, cfg, prompts, args.new_tokens, bw, wbytes, args.page_size,
                                    profile=args.profile and bs == max(batches), pipeline=not args.no_pipeline,
                                    compile_decode=compile_decode, read_bw=read_bw)
                row.update(res)
                if not ablation and (bs == 64 or bs == batches[-1]):
                    try:  # a failure here (e.g. no room for the peft copy at full depth) keeps the timings
                        row["lora_refresh_s"] = lora_refresh_s(model, eng.model)
                    except Exception as err:  # noqa: BLE001
                        row["lora_refresh_error"] = f"{type(err).__name__}: {err}"[:300]
            except Exception as err:  # noqa: BLE001 - one failing row is recorded, never kills the run
                row["error"] = f"{type(err).__name__}: {err}"
                traceback.print_exc()
            rows.append(row)
            save_partial()
            del eng
            _free()
        if bs in hf_batches:
            hf_runs = [("hf_generate_static", run_hf_static)]
            if args.hf_compiled:
                hf_runs.append(("hf_generate_static_compiled", lambda *a: run_hf_static(*a, compiled=True)))
            for name, fn in (*hf_runs, ("hf_continuous_batching", run_hf_cb)):
                row = {"name": name, "batch": bs, "layers": args.layers, "new_tokens": args.new_tokens}
                try:
                    res = fn(model, prompts, args.new_tokens)
                    res = res[0] if isinstance(res, tuple) else res
                    row.update(res)
                except Exception as err:  # noqa: BLE001
                    row["error"] = f"{type(err).__name__}: {err}"
                    traceback.print_exc()
                rows.append(row)
                save_partial()
                _free()
    summary.update(summarize(rows))
    summary["kernel_option_overrides"] = kernel_option_overrides()
    summary["depth_note"] = f"{args.layers} of 60 layers, {args.prompt_len}-token prompts, {args.new_tokens} new tokens"
    write_result("rollout", rows, summary, out=args.out)
    print(f"{'name':30} {'bs':>4} {'tok/s':>10} {'roofline':>9} {'peak GB':>8}  error")
    for r in rows:
        if "batch" in r:
            print(f"{r['name']:30} {r['batch']:>4} {r.get('tokens_per_s', float('nan')):>10.1f} "
                  f"{r.get('roofline_fraction', float('nan')):>9.3f} {r.get('peak_mem_gb', float('nan')):>8.1f}  "
                  f"{r.get('error', '')[:80]}")
        if "profile" in r and "top_kernels" in r["profile"]:
            p = r["profile"]
            print(f"  profile bs{r['batch']}: wall {p['wall_ms_per_step']:.2f} ms/step, "
                  f"GPU busy {p['gpu_busy_ms_per_step']:.2f} ms/step")
            for k in p["top_kernels"][:10]:
                print(f"    {k['total_ms'] / p['steps']:8.3f} ms/step {k['calls'] // p['steps']:>5}x  {k['name'][:70]}")


if __name__ == "__main__":
    main()
