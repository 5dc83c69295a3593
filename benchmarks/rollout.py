"""Rollout benchmark on one GPU: paged flex engine vs HF generate (static cache) and HF continuous batching.

Model: Gemma4-31B shapes (hidden 5376, 32 heads, 16/4 kv heads, head_dim 256/512, k_eq_v, vocab 262k) at
reduced depth (`--layers`, default 12 = 10 sliding + 2 full), random weights initialised with normal_(0.02).
Prompts: random 256-token prompts; greedy; `--new-tokens` (default 512) without EOS.
Roofline: per decode step, bytes read = all weights (lm_head included, embedding rows excluded) + the
KV each row attends to, over the copy bandwidth measured in this run.

    python benchmarks/rollout.py --out $OUT/rollout.json
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.results_io import write_result  # noqa: E402
from lightning_ffpa.presets import build_text_config  # noqa: E402

DEVICE = "cuda"


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _peak_gb() -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if DEVICE == "cuda" else float("nan")


def _reset_peak() -> None:
    if DEVICE == "cuda":
        _reset_peak()


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


def run_ours(model, cfg, prompts, new, bw, wbytes, page=128):
    from lightning_ffpa.rollout.engine import EngineConfig, RolloutEngine
    from lightning_ffpa.rollout.sampler import SamplingParams

    bs, plen = len(prompts), len(prompts[0])
    max_len = -(-(plen + new) // page) * page
    ecfg = EngineConfig(page_size=page, num_pages=bs * (max_len // page) + 2, max_batch_size=bs,
                        max_seq_len=max_len, max_prefill_tokens=16384)
    eng = RolloutEngine(model, ecfg)
    greedy = SamplingParams(temperature=0.0)
    _, t_warm = timed(lambda: eng.generate(prompts, 4, greedy))  # compiles flex, captures the bucket
    _, t_prefill = timed(lambda: eng.generate(prompts, 1, greedy))
    _reset_peak()
    seqs, t_total = timed(lambda: eng.generate(prompts, new, greedy))
    t_decode = max(t_total - t_prefill, 1e-9)
    ctx = plen + new / 2  # mean attended length over decode
    kv_per_row = sum(eng.cache.layer_bytes_per_token(i) * min(ctx, s.window or ctx)
                     for i, s in enumerate(eng.walker.specs))
    step_bytes = wbytes + bs * kv_per_row
    ideal_tps = bs / (step_bytes / bw)
    decode_tps = bs * (new - 1) / t_decode
    return {"tokens_per_s": bs * new / t_total, "decode_tokens_per_s": decode_tps,
            "roofline_fraction": decode_tps / ideal_tps, "step_bytes": step_bytes,
            "total_s": t_total, "prefill_s": t_prefill, "warmup_s": t_warm,
            "peak_mem_gb": _peak_gb(), "graph_replays": eng.stats["graph_replays"],
            "eager_decodes": eng.stats["eager_decodes"],
            "tokens_generated": sum(len(s.output) for s in seqs)}, eng


def run_hf_static(model, prompts, new):
    ids = torch.tensor(prompts, device=DEVICE)
    kw = dict(do_sample=False, cache_implementation="static", pad_token_id=0, disable_compile=True)
    timed(lambda: model.generate(ids, max_new_tokens=4, **kw))
    _reset_peak()
    out, t = timed(lambda: model.generate(ids, max_new_tokens=new, min_new_tokens=new, **kw))
    return {"tokens_per_s": ids.shape[0] * new / t, "total_s": t,
            "peak_mem_gb": _peak_gb()}, out[:, ids.shape[1]:]


def run_hf_cb(model, prompts, new):
    from transformers import GenerationConfig

    saved = model.config._attn_implementation
    errors = []
    for impl in ("sdpa_paged", "paged|sdpa"):  # transformers 5.17 name, then the newer spelling
        try:
            model.set_attn_implementation(impl)
            break
        except ValueError as err:
            errors.append(str(err)[:120])
    else:
        raise ValueError(f"no paged SDPA implementation: {errors}")
    try:
        gc_ = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0)
        model.generate_batch(inputs=prompts[:2], generation_config=GenerationConfig(
            max_new_tokens=4, do_sample=False, eos_token_id=None, pad_token_id=0))
        _reset_peak()
        out, t = timed(lambda: model.generate_batch(inputs=prompts, generation_config=gc_))
        return {"tokens_per_s": len(prompts) * new / t, "total_s": t, "attn_implementation": impl,
                "tokens_generated": _count_cb_tokens(out), "peak_mem_gb": _peak_gb()}
    finally:
        model.set_attn_implementation(saved)


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--batches", default="8,64,128")
    ap.add_argument("--hf-batches", default="8,64")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=512)
    ap.add_argument("--out", default=None)
    ap.add_argument("--preset", default="gemma4-31b", help="model shape (tiny: CPU smoke test of this script)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--page-size", type=int, default=128)
    ap.add_argument("--bandwidth-gb", type=float, default=4.0)
    args = ap.parse_args()
    global DEVICE
    DEVICE = args.device
    rows, summary = [], {}
    bw = copy_bandwidth(args.bandwidth_gb)
    rows.append({"name": "copy_bandwidth", "bytes_per_s": bw})
    model, cfg = build_model(args.layers, args.preset)
    wbytes = weight_bytes(model)
    g = torch.Generator().manual_seed(0)
    ours_tps, hf_tps, rollout_s = {}, {}, {}
    batches = [int(b) for b in args.batches.split(",")]
    hf_batches = [int(b) for b in args.hf_batches.split(",")]
    for bs in batches:
        prompts = torch.randint(2, cfg.vocab_size, (bs, args.prompt_len), generator=g).tolist()
        row = {"name": "ours_paged_flex", "batch": bs, "layers": args.layers, "new_tokens": args.new_tokens}
        eng = None
        try:
            res, eng = run_ours(model, cfg, prompts, args.new_tokens, bw, wbytes, args.page_size)
            row.update(res)
            ours_tps[bs], rollout_s[bs] = res["tokens_per_s"], res["total_s"]
            if bs == 64 or bs == batches[-1]:
                row["lora_refresh_s"] = lora_refresh_s(model, eng.model)
                summary.setdefault("_refresh", {})[bs] = row["lora_refresh_s"]
        except Exception as err:  # noqa: BLE001 - one failing row is recorded, never kills the run
            row["error"] = f"{type(err).__name__}: {err}"
            traceback.print_exc()
        rows.append(row)
        del eng
        _free()
        if bs in hf_batches:
            for name, fn in (("hf_generate_static", run_hf_static), ("hf_continuous_batching", run_hf_cb)):
                row = {"name": name, "batch": bs, "layers": args.layers, "new_tokens": args.new_tokens}
                try:
                    res = fn(model, prompts, args.new_tokens)
                    res = res[0] if isinstance(res, tuple) else res
                    row.update(res)
                    if name == "hf_generate_static":
                        hf_tps[bs] = res["tokens_per_s"]
                except Exception as err:  # noqa: BLE001
                    row["error"] = f"{type(err).__name__}: {err}"
                    traceback.print_exc()
                rows.append(row)
                _free()
    ours64 = next((r for r in rows if r.get("name") == "ours_paged_flex" and r.get("batch") == 64), {})
    refresh = summary.pop("_refresh", {})
    summary["roofline_fraction_bs64"] = ours64.get("roofline_fraction")
    summary["vs_hf_generate_bs64"] = ours_tps[64] / hf_tps[64] if 64 in ours_tps and 64 in hf_tps else None
    summary["lora_refresh_fraction"] = refresh[64] / rollout_s[64] if 64 in refresh and 64 in rollout_s else None
    summary["depth_note"] = f"{args.layers} of 60 layers, {args.prompt_len}-token prompts, {args.new_tokens} new tokens"
    write_result("rollout", rows, summary, out=args.out)
    print(f"{'name':24} {'bs':>4} {'tok/s':>10} {'roofline':>9} {'peak GB':>8}  error")
    for r in rows:
        if "batch" in r:
            print(f"{r['name']:24} {r['batch']:>4} {r.get('tokens_per_s', float('nan')):>10.1f} "
                  f"{r.get('roofline_fraction', float('nan')):>9.3f} {r.get('peak_mem_gb', float('nan')):>8.1f}  "
                  f"{r.get('error', '')[:80]}")


if __name__ == "__main__":
    main()
