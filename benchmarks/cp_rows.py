"""One row of the context-parallel benchmark, measured together by every rank of one torchrun launch.

Owns what each row is and how it runs: the Gemma4-31B-shaped slice (random weights initialised for real, the
same on every rank, per-layer activation checkpointing in every row), the batch, the attention set-ups over
the CP group, the timed steps and memory, and the parity measurement against the CP=1 reference. Does not own
processes, budgets, result files or the summary (`benchmarks/context_parallel.py`), nor the gradient
comparison (`benchmarks/cp_parity.py`).

A step is forward + backward of the global token-mean loss (the project's chunked linear cross-entropy with
Gemma4's softcap, reduced over the CP group by `cp_loss_reduce`); no optimizer. Every row shards the batch
head-tail (rank r holds chunks r and 2cp-1-r), which is also what torch's context_parallel does by default.
"""

from __future__ import annotations

import contextlib
import gc
import os
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from lightning_ffpa._compat import transformers as hf_compat
from lightning_ffpa.flex_options import LARGE_HEAD_DIM_CANDIDATES, flex_kernel_options

__all__ = ["ROWS", "measure"]

_SLIDING = "sliding layers: our halo + Flex (CPU: masked math), as in every row"
ROWS: dict[str, str] = {
    "ffpa_ring": f"full layers: our ring, FFPA blocks (dense / varlen by document); {_SLIDING} (the product path)",
    **{f"flex_ring_opt{i}": f"ffpa_ring with the full layers' ring blocks on compiled Flex, D=512 options "
                            f"LARGE_HEAD_DIM_CANDIDATES[{i}] (Flex has no backward taking the merged LSE: each block's "
                            "forward is recomputed in backward)" for i in range(len(LARGE_HEAD_DIM_CANDIDATES))},
    "torch_native_cp_sdpa": "ffpa_ring with the full layers on torch.distributed.tensor.experimental.context_parallel "
                            "over SDPA (is_causal, its head-tail load balancer, backends flash/efficient/cuDNN only, "
                            "never math; K/V heads repeated to the q heads, as its ring ops take no enable_gqa); "
                            f"{_SLIDING}, since torch's CP ring takes no attn_mask (no window, no documents)",
}
NATIVE_ATTN = "torch_native_cp_sdpa"


# ----------------------------------------------------------------------------- set-up
def _init(spec: dict) -> tuple[torch.device, int, int]:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if spec["smoke"]:
        torch.set_num_threads(1)
        dist.init_process_group("gloo")
        return torch.device("cpu"), rank, world
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    return device, rank, world


def build_model(spec: dict, device: torch.device, attn: str, ac: bool):
    """The slice with seeded N(0, 0.02) weights (norms 1, biases 0): identical for every call and rank."""
    from transformers import Gemma4ForCausalLM

    from lightning_ffpa.presets import build_text_config

    cfg = build_text_config(spec["preset"], num_hidden_layers=spec["layers"])
    hf_compat.set_config_attn_implementation(cfg, attn)
    with torch.device(device):
        model = Gemma4ForCausalLM(cfg).to(getattr(torch, spec["dtype"]))
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2:
                p.normal_(0.0, 0.02)
            else:
                p.fill_(1.0 if ("norm" in name or "scalar" in name) else 0.0)
    model.train()
    if ac:  # every row recomputes each decoder layer in backward, so 64k fits; the same for all rows
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model, cfg


def make_batch(seq: int, vocab: int, docs: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """One row: a single document, or packed documents of 512..4096 tokens with per-document positions."""
    g = torch.Generator().manual_seed(seed)
    lengths, total = [], 0
    while total < seq:
        n = seq - total if docs == "single" else min(int(torch.randint(512, 4097, (1,), generator=g)), seq - total)
        lengths.append(n)
        total += n
    return {"input_ids": torch.randint(0, vocab, (1, seq), generator=g),
            "document_ids": torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None],
            "position_ids": torch.cat([torch.arange(n) for n in lengths])[None]}


def _use_flex_options(index: int) -> dict:
    """Point the Flex ring blocks (head_dim > 256) at one candidate set; this process only."""
    from lightning_ffpa.cp import flex_blocks

    shipped = flex_blocks.kernel_options
    chosen = {**flex_kernel_options(512, "train"), **LARGE_HEAD_DIM_CANDIDATES[index]}
    flex_blocks.kernel_options = lambda d, dtype=torch.bfloat16: dict(chosen) if d > 256 else shipped(d, dtype)
    return chosen


def native_attention(module, query, key, value, attention_mask, scaling=None, sliding_window=None,
                     ring_layout=None, **kwargs):
    """HF attention: full layers through torch's CP-patched SDPA, sliding layers through our halo."""
    ring = module._ffpa_ring
    scale = module.scaling if scaling is None else scaling
    if sliding_window:
        q, k, v = (t.transpose(1, 2) for t in (query, key, value))
        return ring.sliding(q, k, v, ring_layout, scale, int(sliding_window)), None
    from torch.nn.attention import SDPBackend, sdpa_kernel

    groups = query.shape[1] // key.shape[1]
    key, value = (t.repeat_interleave(groups, dim=1) for t in (key, value))
    ring.stats["native_sdpa_full"] += 1
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]):
        # attribute lookup at call time: context_parallel patched torch.nn.functional
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scale)
    return out.transpose(1, 2), None


def sdpa_backends_at(head_dim: int, device: torch.device, dtype: torch.dtype) -> dict[str, str]:
    """Which fused SDPA backends run a small causal call at `head_dim` here (no CP): 'ok' or the error."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(1, 2, 256, head_dim, device=device, dtype=dtype, requires_grad=True)
    out = {}
    for b in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION):
        try:
            with sdpa_kernel([b]):
                torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()
            out[b.name] = "ok"
        except Exception as err:  # noqa: BLE001 - the failure is the fact recorded
            out[b.name] = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
    return out


@contextlib.contextmanager
def attention_setup(name: str, model, batch: dict, device: torch.device, rank: int, world: int, info: dict):
    """Install row `name`'s attention; yields (ids, position_ids, shift_labels, ring_layout), all local shards."""
    from lightning_ffpa._compat import transformers as hf_compat
    from lightning_ffpa.cp import shard_batch
    from lightning_ffpa.cp.ring import install_ring, no_hf_mask

    group = dist.group.WORLD
    shard = shard_batch(batch, rank, world)
    kind = "flex" if name.startswith("flex_ring") else "ffpa"
    if kind == "flex":
        info["flex_options"] = _use_flex_options(int(name.removeprefix("flex_ring_opt")))
    ring = install_ring(model, group, block_ops=kind)
    info["ring"] = ring
    local = tuple(shard[k].to(device) for k in ("input_ids", "position_ids", "shift_labels"))
    if name != NATIVE_ATTN:
        yield (*local, shard["ring_layout"])
        return
    if (batch["document_ids"] != 0).any():
        raise ValueError("torch's context_parallel SDPA takes no attn_mask, so packed documents cannot be "
                         "masked: run this row with --docs single")
    from torch.distributed.tensor.experimental import context_parallel

    from lightning_ffpa.parallel.dims import ParallelDims

    hf_compat.register_attention(NATIVE_ATTN, native_attention)
    hf_compat.register_mask(NATIVE_ATTN, no_hf_mask)
    configs = [model.config, *(getattr(m, "config", None) for m in model.modules() if hasattr(m, "_ffpa_ring"))]
    for cfg in {id(c): c for c in configs if c is not None}.values():
        hf_compat.set_config_attn_implementation(cfg, NATIVE_ATTN)  # where install_ring set "ffpa_ring"
    info["sdpa_backends_at_d512"] = sdpa_backends_at(512, device, next(model.parameters()).dtype)
    dims = ParallelDims(1, world)
    dims.build_mesh(device.type)
    mesh = dims.cp_mesh
    full = shard_batch(batch, 0, 1)  # the whole sequence in order; torch shards it in place below
    bufs = [full[k].to(device).clone() for k in ("input_ids", "position_ids", "shift_labels")]
    with context_parallel(mesh, buffers=bufs, buffer_seq_dims=[1, 1, 1], no_restore_buffers=set(bufs)):
        if not all(torch.equal(b, s) for b, s in zip(bufs, local)):
            raise RuntimeError("torch's context_parallel sharded the batch differently from the ring layout "
                               "(not head-tail): the sliding layers' halo would read wrong neighbours")
        yield (*bufs, shard["ring_layout"])


def loss_step(model, cfg, ids, pos, labels, layout) -> torch.Tensor:
    """Forward + backward of the global token mean over the CP group; returns the loss (detached)."""
    from lightning_ffpa.cp import IGNORE_INDEX, cp_loss_reduce
    from lightning_ffpa.loss import linear_cross_entropy
    from lightning_ffpa.parallel import causal_lm_hidden_states

    model.zero_grad(set_to_none=True)
    hidden = causal_lm_hidden_states(model, input_ids=ids, position_ids=pos, ring_layout=layout)
    flat = labels.flatten()
    n = (flat != IGNORE_INDEX).sum()
    mean = linear_cross_entropy(hidden.flatten(0, 1), model.lm_head.weight, flat,
                                softcap=cfg.final_logit_softcapping, chunk_size=4096)
    loss = cp_loss_reduce(mean * n, n, dist.group.WORLD)
    loss.backward()
    return loss.detach()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()


def _max_over_ranks(values: list[float], device: torch.device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


# ----------------------------------------------------------------------------- rows
def timed_row(spec: dict, device: torch.device, rank: int, world: int) -> dict[str, Any]:
    """`spec["steps"]` timed steps after `spec["warmup"]`: median/min/max ms, tokens/s, peak memory."""
    from lightning_ffpa.attention import kernels

    model, cfg = build_model(spec, device, "sdpa", ac=spec["ac"])
    batch = make_batch(spec["seq"], cfg.vocab_size, spec["docs"])
    info: dict[str, Any] = {}
    kernels.reset_kernel_counts()
    if device.type == "cuda":  # the peak is the steps' (weights, grads, activations), not the fp32 construction
        torch.cuda.reset_peak_memory_stats(device)
    with attention_setup(spec["row"], model, batch, device, rank, world, info) as (ids, pos, labels, layout):
        losses = [float(loss_step(model, cfg, ids, pos, labels, layout)) for _ in range(spec["warmup"])]
        times = []
        for _ in range(spec["steps"]):
            _sync(device)
            t0 = time.perf_counter()
            losses.append(float(loss_step(model, cfg, ids, pos, labels, layout)))
            _sync(device)
            times.append(time.perf_counter() - t0)
    # every rank's step ends at the barrier, so rank 0's times are the group's; memory is each rank's own
    cuda = device.type == "cuda"
    peak = [torch.cuda.max_memory_allocated(device) / 2**30, torch.cuda.max_memory_reserved(device) / 2**30] if cuda \
        else [0.0, 0.0]
    peak = _max_over_ranks(peak, device)
    med = statistics.median(times)
    return {"label": ROWS[spec["row"]], "step_ms_median": med * 1e3, "step_ms_min": min(times) * 1e3,
            "step_ms_max": max(times) * 1e3, "step_ms_all": [t * 1e3 for t in times],
            "tokens_per_s": spec["seq"] / med, "tokens_per_s_per_gpu": spec["seq"] / med / world,
            "losses": losses, "peak_mem_allocated_gb_max_rank": peak[0] if cuda else None,
            "peak_mem_reserved_gb_max_rank": peak[1] if cuda else None, "cp": world,
            "ring_stats": dict(info["ring"].stats), "kernel_counts": kernels.kernel_counts(),
            **{k: v for k, v in info.items() if k != "ring"}}


def reference_grads(spec: dict, device: torch.device, batch: dict, attn: str) -> tuple[float, dict]:
    """CP=1 on this rank alone: HF's own attention `attn`, masks and loss over the whole sequence."""
    model, _ = build_model(spec, device, attn, ac=False)
    ids, pos = batch["input_ids"].to(device), batch["position_ids"].to(device)
    # HF builds the causal / sliding / packed-document masks from position_ids and shifts the labels itself.
    loss = model(input_ids=ids, position_ids=pos, labels=ids, use_cache=False).loss
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return float(loss.detach()), grads


def parity_row(spec: dict, device: torch.device, rank: int, world: int) -> dict[str, Any]:
    """One CP=`world` variant's loss and all-reduced gradients against the CP=1 reference made on rank 0."""
    from benchmarks.cp_parity import grad_parity, parity_failures

    name = spec["variant"]
    batch = make_batch(spec["seq"], _vocab(spec), spec["docs"])
    ref = noise = None
    if rank == 0:
        ref = reference_grads(spec, device, batch, spec["reference_attn"])
        if spec.get("noise_attn"):
            other = reference_grads(spec, device, batch, spec["noise_attn"])
            noise = {"attn": spec["noise_attn"], "loss_abs_diff": abs(other[0] - ref[0]),
                     "grads": grad_parity(ref[1], other[1])}
            del other
            gc.collect()
    dist.barrier()
    model, cfg = build_model(spec, device, "sdpa", ac=spec["ac"])
    info: dict[str, Any] = {}
    with attention_setup(name, model, batch, device, rank, world, info) as (ids, pos, labels, layout):
        loss = float(loss_step(model, cfg, ids, pos, labels, layout))
    grads = {}
    for n, p in model.named_parameters():  # replicated parameters: the group's gradient is the ranks' mean
        dist.all_reduce(p.grad)
        grads[n] = p.grad.div_(world)
    out: dict[str, Any] = {"label": f"{name} at CP={world} vs the CP=1 reference: the whole sequence on one rank, "
                                    f"HF attn_implementation={spec['reference_attn']!r} with HF's own masks and "
                                    "loss, no ring code", "variant": name, "variant_label": ROWS[name],
                           "ring_stats": dict(info["ring"].stats), "loss": loss}
    if rank == 0:
        gp = grad_parity(ref[1], grads)
        diff = abs(loss - ref[0])
        out.update(reference_loss=ref[0], loss_abs_diff=diff, grads=gp, noise_floor=noise,
                   failures=parity_failures(diff, gp, spec["loss_tol"], spec["grad_rel_tol"]),
                   loss_tol=spec["loss_tol"], grad_rel_tol=spec["grad_rel_tol"])
    return out


def _vocab(spec: dict) -> int:
    from lightning_ffpa.presets import build_text_config

    return build_text_config(spec["preset"]).vocab_size


def measure(spec: dict) -> dict[str, Any]:
    """Child entry (every rank): run `spec` (a timed row or the parity row) and return rank 0's record."""
    device, rank, world = _init(spec)
    try:
        fn = parity_row if spec["row"].startswith("parity_") else timed_row
        return {**fn(spec, device, rank, world), "pid": os.getpid(), "world": world}
    finally:
        dist.destroy_process_group()
