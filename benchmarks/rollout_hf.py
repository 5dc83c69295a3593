"""The Hugging Face side of the rollout benchmark: `generate` baselines and the reference the engine is checked against.

Owns: HF `generate` with a static cache, eager or with HF's compiled decoding forward, greedy or sampling
(temperature 1.0, top-p 1.0, top-k off, as the engine samples); HF continuous batching (its error recorded when it
fails); and `reference_check`, which compares the engine's tokens with HF greedy `generate` for the same prompts
(match rate, first-divergence positions, HF's logit gap there) and the engine's logprobs with an HF forward
over the engine's own sequences. Does not own timing of the engine, rows or processes (`rollout_rows.py`,
`rollout.py`).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from lightning_ffpa._compat import transformers as hf_compat

GLOBAL_ACCESS = "allow_global_per_layer_attribute_access"


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn, device: str):
    """`fn()` and its wall seconds, synchronised on CUDA."""
    _sync(device)
    t = time.perf_counter()
    out = fn()
    _sync(device)
    return out, time.perf_counter() - t


def peaks(device: str) -> dict[str, float]:
    """Peak allocated and reserved memory since the last reset (GiB); nothing on CPU."""
    if device != "cuda":
        return {}
    return {"peak_mem_gb": torch.cuda.max_memory_allocated() / 2**30,
            "peak_reserved_gb": torch.cuda.max_memory_reserved() / 2**30}


def sampling_kwargs(mode: str) -> dict[str, Any]:
    """HF generate arguments for `mode`: greedy, or sampling at temperature 1.0 with top-p 1.0 and no top-k."""
    if mode == "greedy":
        return {"do_sample": False}
    return {"do_sample": True, "temperature": 1.0, "top_p": 1.0, "top_k": 0}


def run_hf_static(model, prompts: list[list[int]], new: int, mode: str, device: str,
                  compiled: bool = False) -> dict[str, Any]:
    """HF `generate` with a static cache; compiled=True is HF's own default for static caches on CUDA."""
    ids = torch.tensor(prompts, device=device)
    kw = dict(cache_implementation="static", pad_token_id=0, disable_compile=not compiled, **sampling_kwargs(mode))
    _, t_warm = timed(lambda: model.generate(ids, max_new_tokens=4, **kw), device)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    out, t = timed(lambda: model.generate(ids, max_new_tokens=new, min_new_tokens=new, **kw), device)
    made = out[:, ids.shape[1]:]
    return {"tokens_per_s": ids.shape[0] * new / t, "total_s": t, "warmup_s": t_warm,
            "tokens_generated": int(made.numel()), **peaks(device)}


def reference_check(model, prompts: list[list[int]], outputs: list[list[int]], logprobs: list[list[float]],
                    tokens: int, device: str, greedy: bool) -> dict[str, Any]:
    """Engine vs HF on `prompts` (HF eager, dynamic cache).

    Greedy: HF greedy `generate` of all prompts at once for `tokens` new tokens; per prompt the first position
    where the two differ (None: all equal), the position-wise match rate over all tokens, and HF's logit gap
    between its token and the engine's at the first divergence (prefixes agree up to there, so a small gap is a
    near-tie that bf16 rounding can flip). Up to the first divergence included, the engine's logprobs against
    those of generate's own logits (HF's cached decode), and HF's two paths against each other (generate's
    logits vs the forward below: the spread HF's own numerics give, the floor for the engine's).
    Both modes: one HF forward over prompt + the engine's tokens (no cache, the whole sequence at once) gives the
    logprob of each engine token, compared with the logprob the engine recorded (temperature 1.0 in both modes).
    """
    n = min([tokens, *map(len, outputs)])
    first_div: list[int | None] = []
    gen_lps: list[torch.Tensor] = []  # HF generate's logprobs of the engine's tokens, per prompt
    gaps: list[float | None] = []
    equal = 0
    if greedy:  # one batched call: the prompts share a length, so no padding enters the reference
        gen = model.generate(torch.tensor(prompts, device=device), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
        for i, out in enumerate(outputs):
            ref = gen.sequences[i, len(prompts[i]):].tolist()
            same = [a == b for a, b in zip(ref, out[:n])]
            equal += sum(same)
            pos = next((j for j, s in enumerate(same) if not s), None)
            first_div.append(pos)
            step = gen.logits[pos][i].float() if pos is not None else None
            gaps.append(None if step is None else float(step[ref[pos]] - step[out[pos]]))
            # the engine's logprobs against HF generate's logits (its cached decode): prefixes agree up to `pos`
            upto = n if pos is None else pos + 1
            lg = torch.stack([gen.logits[j][i] for j in range(upto)]).float()
            ref_lp = torch.log_softmax(lg, -1).gather(1, torch.tensor(out[:upto], device=lg.device)[:, None])[:, 0]
            gen_lps.append(ref_lp.cpu())
        del gen
    lp_diff_max, lp_diff_sum = 0.0, 0.0
    hf_self: list[torch.Tensor] = []  # HF against itself: generate's cached decode vs the one-pass forward
    for i, (prompt, out, lps) in enumerate(zip(prompts, outputs, logprobs)):
        with torch.no_grad():  # one prompt at a time: a 262k-vocab fp32 logit row per token adds up
            full = torch.tensor([prompt + out[:n]], device=device)
            logits = model(input_ids=full, use_cache=False).logits[0, len(prompt) - 1:len(prompt) - 1 + n].float()
            hf_lp = torch.log_softmax(logits, -1).gather(1, full[0, len(prompt):, None])[:, 0].cpu()
        diff = (hf_lp - torch.tensor(lps[:n])).abs()
        lp_diff_max = max(lp_diff_max, float(diff.max()))
        lp_diff_sum += float(diff.sum())
        if gen_lps:
            hf_self.append((hf_lp[:len(gen_lps[i])] - gen_lps[i]).abs())
        del logits, full
    total = n * len(prompts)
    res: dict[str, Any] = {"prompts": len(prompts), "tokens": n,
                           "logprob_max_abs_diff": lp_diff_max, "logprob_mean_abs_diff": lp_diff_sum / max(total, 1)}
    if greedy:
        gen_diff = torch.cat([(g - torch.tensor(logprobs[i][:len(g)])).abs() for i, g in enumerate(gen_lps)])
        res.update({"logprob_vs_generate_max_abs_diff": float(gen_diff.max()),
                    "logprob_vs_generate_mean_abs_diff": float(gen_diff.mean()),
                    # the same tokens' logprobs from HF's two paths: the floor its own numerics set
                    "hf_generate_vs_forward_logprob_mean_abs_diff": float(torch.cat(hf_self).mean()),
                    "hf_generate_vs_forward_logprob_max_abs_diff": float(torch.cat(hf_self).max()),
                    "token_match_rate": equal / max(total, 1),
                    "exact_prompts": sum(d is None for d in first_div),
                    "first_divergence": first_div, "divergence_logit_gap": gaps})
    return res


def run_hf_cb(model, prompts: list[list[int]], new: int, mode: str, device: str) -> dict[str, Any]:
    """HF continuous batching (`generate_batch`) with paged SDPA; raises when it generated fewer tokens."""
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
        kw = dict(do_sample=mode != "greedy", eos_token_id=None, pad_token_id=0)
        if mode != "greedy":
            kw.update(temperature=1.0, top_p=1.0, top_k=0)
        model.generate_batch(inputs=prompts[:2], generation_config=GenerationConfig(max_new_tokens=4, **kw))
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        with CBErrors() as cb_errors:
            out, t = timed(lambda: model.generate_batch(
                inputs=prompts, generation_config=GenerationConfig(max_new_tokens=new, **kw)), device)
        made = _count_cb_tokens(out)
        if made is not None and made != len(prompts) * new:  # CB logs failed requests instead of raising
            raise RuntimeError(f"continuous batching generated {made} of {len(prompts) * new} tokens: "
                               f"{cb_errors.first or 'no error logged'}")
        return {"tokens_per_s": len(prompts) * new / t, "total_s": t, "attn_implementation": impl,
                GLOBAL_ACCESS: old_flag is not None, "tokens_generated": made, **peaks(device)}
    finally:
        model.set_attn_implementation(saved)
        if old_flag is not None:
            setattr(model.config, GLOBAL_ACCESS, old_flag)


class CBErrors(logging.Handler):
    """Collects the first exception transformers' continuous batching logs (it does not raise)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.first: str | None = None

    def emit(self, record: logging.LogRecord) -> None:
        if self.first is None and record.exc_info and record.exc_info[1] is not None:
            err = record.exc_info[1]
            self.first = f"{type(err).__name__}: {str(err)[:300]}"

    def __enter__(self) -> CBErrors:
        logging.getLogger("ContinuousBatchingLogger").addHandler(self)
        return self

    def __exit__(self, *exc) -> None:
        logging.getLogger("ContinuousBatchingLogger").removeHandler(self)


def _count_cb_tokens(out) -> int | None:
    try:
        return sum(len(r.generated_tokens) for r in out.values())
    except Exception:  # noqa: BLE001 - the result type moved across transformers versions
        return None
