"""One row of the rollout benchmark, measured in the process that `benchmarks/rollout.py` started for it.

Owns: building the preset's Gemma4-shaped model (31B by default) with random weights, the bandwidths a roofline divides by
(measured copy and read bandwidth, and the datasheet figure), the engine row (`ours_paged_flex`: timing,
roofline bytes, an optional profile and LoRA refresh, and the check against HF from `rollout_hf.py`), and the
HF rows. Does not own which rows run, processes, budgets or the summary (`rollout.py`, `row_process.py`).

Roofline: per decode step, bytes read = all weights (lm_head included, embedding rows excluded) + the K and V each
row needs (its positions so far, capped at the window on sliding layers; Gemma4's k_eq_v layers still store
V = v_norm(k) apart from K = rope(k_norm(k)), so both count), averaged exactly over the decode positions. The
primary fraction, `roofline_fraction_datasheet`, divides the ideal step time at the datasheet HBM figure by the
measured step; `roofline_fraction` uses the measured copy bandwidth (read + write bytes / s, this process) instead,
`roofline_fraction_read_bw` a measured read bandwidth (a bf16 sum). Flex reads whole KV blocks: `kv_bytes_read_paged` is reported, not counted.
MoE models (`--preset gemma4-26b-a4b`): a decode step's grouped expert GEMMs read only the experts some row routed
to, so the engine row also counts, per MoE layer, the union of experts each decode step's rows routed to
(`EngineConfig.count_routed_experts`) in one more rollout of the same prompts and sampling, untimed, with an eager
decode step (so the timed path stays the one users run; `moe_routing.token_match` is how many of its tokens equal
the timed rollout's). `routed_roofline_fraction_datasheet` (the primary MoE number) and `routed_roofline_fraction`
(copy bandwidth) count non-expert weights + per layer (mean union) x (bytes of one expert) + K/V; the all-weights
fractions stay beside them, and `routed_expert_fraction` is the share of all expert bytes a step read.
An engine row times TIMED_SAMPLES rollouts after its warm-up (each a prefill alone, then the whole rollout); its
throughput, decode step and roofline fractions are their median, with `_min` and `_max` beside (`timed_samples`).
"""

from __future__ import annotations

import gc
import sys
import traceback
from pathlib import Path
from statistics import median
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.rollout_hf import peaks, reference_check, run_hf_cb, run_hf_static, timed  # noqa: E402
from benchmarks.row_process import row_main  # noqa: E402
from lightning_ffpa.presets import build_text_config  # noqa: E402
from lightning_ffpa.rollout.routing import moe_layers  # noqa: E402

TIMED_SAMPLES = 3  # timed rollouts per engine row, after the warm-up; the row records their median, min and max

# HBM bandwidth from the vendors' datasheets, bytes/s, by a substring of the device name
DATASHEET_BYTES_PER_S = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12}




def bandwidths(device: str, gb: float) -> dict[str, Any]:
    """Copy (read + write) and read bandwidth in bytes/s, best of 10 each, and the datasheet figure."""
    n = int(gb * 2**30) // 2
    src = torch.ones(n, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    copy = min(timed(lambda: dst.copy_(src), device)[1] for _ in range(10))
    read = min(timed(lambda: src.sum(dtype=torch.float32), device)[1] for _ in range(10))
    src = dst = None  # freed before the model is built
    name = torch.cuda.get_device_name(0) if device == "cuda" else "cpu"
    sheet = next((v for k, v in DATASHEET_BYTES_PER_S.items() if k in name), None)
    return {"copy_bytes_per_s": 2 * n * 2 / copy, "read_bytes_per_s": n * 2 / read,
            "datasheet_bytes_per_s": sheet, "device_name": name}


def build_model(layers: int, preset: str, device: str, dtype: str | None = None):
    from transformers import Gemma4ForCausalLM

    cfg = build_text_config(preset, num_hidden_layers=layers)
    saved = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, dtype) if dtype else torch.bfloat16 if device == "cuda" else torch.float32)
    try:
        with torch.device(device):
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


def prompts_for(batch: int, prompt_len: int, vocab: int) -> list[list[int]]:
    """The prompts of a batch size: the same in every process, so HF and engine rows see the same ids."""
    g = torch.Generator().manual_seed(batch)
    return torch.randint(2, vocab, (batch, prompt_len), generator=g).tolist()


def kv_bytes_per_step(eng, plen: int, new: int) -> tuple[float, float]:
    """Mean K+V bytes one row needs / flex reads per decode step, over positions plen..plen+new-2.

    Needed: positions 0..p, the last `window` of them on sliding layers. Read: every KV block the step's
    block-mask row lists (whole blocks, the union over the row's query block), i.e. what the kernel loads.
    """
    block = eng.config.decode_block
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
            paged += per_tok * listed[spec.window][p // block] * block
    n = max(len(positions), 1)
    return need / n, paged / n


def spread(key: str, values: list[float] | None) -> dict[str, float | None]:
    """`key` (the median of the timed samples' `values`), `key_min` and `key_max`; all None without values."""
    if not values:
        return {key: None, f"{key}_min": None, f"{key}_max": None}
    return {key: median(values), f"{key}_min": min(values), f"{key}_max": max(values)}


def run_ours(model, prompts, new: int, bw: dict, wbytes: int, spec: dict, device: str) -> tuple[dict, Any, list]:
    from lightning_ffpa.rollout.engine import EngineConfig, RolloutEngine
    from lightning_ffpa.rollout.sampler import SamplingParams

    bs, plen, page = len(prompts), len(prompts[0]), spec["page_size"]
    max_len = -(-(plen + new) // page) * page
    eager_step = spec["kind"].endswith("eager_step")
    ecfg = EngineConfig(page_size=page, num_pages=bs * (max_len // page) + 2, max_batch_size=bs,
                        max_seq_len=max_len, max_prefill_tokens=16384, pipeline=spec.get("pipeline", True),
                        compile_decode=False if eager_step else None,
                        compile_mode=None if eager_step else spec.get("compile_mode"),
                        fuse_projections=spec.get("fuse_projections", True),
                        kv_block_size=spec.get("kv_block_size"), fuse_kv_write=spec.get("fuse_kv_write", True),
                        cuda_graphs=spec.get("cuda_graphs", True))
    eng = RolloutEngine(model, ecfg)
    sampling = SamplingParams(temperature=0.0) if spec["mode"] == "greedy" else SamplingParams(temperature=1.0,
                                                                                               top_p=1.0, top_k=0)
    _, t_warm = timed(lambda: eng.generate(prompts, 4, sampling), device)  # compiles, captures this sampler's graphs
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t_prefill, t_total, t_decode = [], [], []
    for _ in range(TIMED_SAMPLES):  # each: a prefill alone, then the whole rollout; decode = their difference
        t_prefill.append(timed(lambda: eng.generate(prompts, 1, sampling), device)[1])
        seqs, t = timed(lambda: eng.generate(prompts, new, sampling), device)
        t_total.append(t)
        t_decode.append(max(t - t_prefill[-1], 1e-9))
    kv_need, kv_paged = kv_bytes_per_step(eng, plen, new)
    step_bytes = wbytes + bs * kv_need
    ideal_s = step_bytes / bw["copy_bytes_per_s"]
    sheet = bw["datasheet_bytes_per_s"]
    decode_step_s = [t / (new - 1) for t in t_decode]
    res = {"timed_samples": TIMED_SAMPLES,
           "tokens_per_s": bs * new / median(t_total),
           **spread("decode_tokens_per_s", [bs / s for s in decode_step_s]),
           **spread("roofline_fraction", [ideal_s / s for s in decode_step_s]),
           **spread("roofline_fraction_datasheet", [step_bytes / sheet / s for s in decode_step_s] if sheet else None),
           "roofline_fraction_read_bw": step_bytes / bw["read_bytes_per_s"] / median(decode_step_s),
           "step_bytes": step_bytes, "weight_bytes": wbytes,
           "kv_bytes_per_step": bs * kv_need, "kv_bytes_read_paged": bs * kv_paged,
           **spread("decode_step_ms", [s * 1e3 for s in decode_step_s]), "ideal_step_ms": ideal_s * 1e3,
           "total_s": median(t_total), "prefill_s": median(t_prefill), "warmup_s": t_warm, **peaks(device),
           "graph_replays": eng.stats["graph_replays"], "eager_decodes": eng.stats["eager_decodes"],
           "syncs": eng.stats["syncs"], "preemptions": eng.stats["preemptions"], "pipeline": ecfg.pipeline,
           "compile_mode": ecfg.compile_mode, "decode_path": eng.decode_path, "attention_path": eng.attention_path,
           "projection_path": eng.projection_path, "kv_write_path": eng.kv_write_path,
           "decode_kv_block": eng.config.decode_block,
           "tokens_generated": sum(len(s.output) for s in seqs)}
    return res, eng, seqs


def routed_roofline(row: dict, model, prompts, new: int, wbytes: int, spec: dict, seqs) -> dict:
    """The MoE fields of an engine row: the routed experts counted in an untimed eager rollout of the same prompts
    and sampling, and the roofline fractions over the routed bytes (the timed steps, scaled by bytes)."""
    from lightning_ffpa.rollout.engine import EngineConfig, RolloutEngine
    from lightning_ffpa.rollout.sampler import SamplingParams

    bs, plen, page = len(prompts), len(prompts[0]), spec["page_size"]
    max_len = -(-(plen + new) // page) * page
    eng = RolloutEngine(model, EngineConfig(page_size=page, num_pages=bs * (max_len // page) + 2, max_batch_size=bs,
                                            max_seq_len=max_len, max_prefill_tokens=16384, compile_decode=False,
                                            cuda_graphs=False, count_routed_experts=True))
    sampling = SamplingParams(temperature=0.0) if spec["mode"] == "greedy" else SamplingParams(temperature=1.0,
                                                                                               top_p=1.0, top_k=0)
    counted = eng.generate(prompts, new, sampling)
    moe = eng.routing.summary(wbytes)
    eng.routing.remove()
    pairs = [(a, b) for s, t in zip(counted, seqs) for a, b in zip(s.output, t.output)]
    moe.update(counted_in="an untimed rollout of the same prompts and sampling, eager decode step",
               token_match=sum(a == b for a, b in pairs) / max(len(pairs), 1))
    scale = (moe["routed_weight_bytes"] + row["kv_bytes_per_step"]) / row["step_bytes"]  # same steps, fewer bytes
    out = {"moe_routing": moe, "routed_step_bytes": moe["routed_weight_bytes"] + row["kv_bytes_per_step"],
           "routed_expert_fraction": moe["routed_expert_fraction"]}
    for key in ("roofline_fraction", "roofline_fraction_datasheet"):
        for end in ("", "_min", "_max"):
            v = row.get(key + end)
            out[f"routed_{key}{end}"] = None if v is None else v * scale
    return out


def lora_refresh_s(model, inference, reps: int = 3) -> float:
    import copy

    from peft import LoraConfig, get_peft_model

    from lightning_ffpa.rollout.lora_sync import LoraSync

    train = get_peft_model(copy.deepcopy(model), LoraConfig(
        r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    sync = LoraSync(train, inference)
    sync.refresh()
    return min(timed(sync.refresh, "cpu")[1] for _ in range(reps))


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    """Measure the row `spec` names (see `rollout.py` for its keys); returns the row's measured fields."""
    device = spec["device"]
    if spec.get("kernel_options"):  # before any engine exists: captured graphs keep the kernels they were built with
        from lightning_ffpa.rollout.attention import load_kernel_options

        load_kernel_options(spec["kernel_options"])
    bw = bandwidths(device, spec["bandwidth_gb"])
    model, cfg = build_model(spec["layers"], spec["preset"], device, spec.get("dtype"))
    prompts = prompts_for(spec["batch"], spec["prompt_len"], cfg.vocab_size)
    new, kind = spec["new_tokens"], spec["kind"]
    row: dict[str, Any] = {"bandwidth": bw, "num_params": sum(p.numel() for p in model.parameters())}
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    if kind.startswith("ours_paged_flex"):
        res, eng, seqs = run_ours(model, prompts, new, bw, weight_bytes(model), spec, device)
        row.update(res)
        if spec.get("do_profile"):
            from benchmarks.rollout_profile import profile_decode

            try:  # a profiler failure never loses the timed row
                # mid-run, as far as the engine's max_seq_len (prompt + new) leaves room for 6 steps + 2
                row["profile"] = profile_decode(eng, prompts, device, skip=max(0, min(new // 2, new - 8)))
            except Exception as err:  # noqa: BLE001
                row["profile"] = {"error": f"{type(err).__name__}: {err}"}
                traceback.print_exc()
        if spec.get("do_lora_refresh"):
            try:  # no room for the peft copy next to a full-depth model is recorded, the timings kept
                row["lora_refresh_s"] = lora_refresh_s(model, eng.model)
            except Exception as err:  # noqa: BLE001
                row["lora_refresh_error"] = f"{type(err).__name__}: {err}"[:300]
        del eng
        if device == "cuda":
            torch.cuda.empty_cache()
        if moe_layers(model):  # after the timed engine is gone: the counting engine's pools take its place
            gc.collect()  # the timed engine's graphs and pools, before the counting engine checks its room
            try:  # a failed count is recorded, the timed row kept
                row.update(routed_roofline(row, model, prompts, new, weight_bytes(model), spec, seqs))
            except Exception as err:  # noqa: BLE001
                row["moe_routing_error"] = f"{type(err).__name__}: {err}"[:300]
                traceback.print_exc()
            if device == "cuda":
                torch.cuda.empty_cache()
        k = spec.get("check_prompts", 0)
        if k:
            row["hf_check"] = reference_check(model, prompts[:k], [s.output for s in seqs[:k]],
                                              [s.logprobs for s in seqs[:k]], spec["check_tokens"], device,
                                              greedy=spec["mode"] == "greedy")
    elif kind.startswith("hf_generate_static"):
        row.update(run_hf_static(model, prompts, new, spec["mode"], device, compiled=kind.endswith("compiled")))
    elif kind == "hf_continuous_batching":
        row.update(run_hf_cb(model, prompts, new, spec["mode"], device))
    else:
        raise ValueError(f"unknown row kind {kind!r}")
    return row


if __name__ == "__main__":
    row_main(None, measure)
