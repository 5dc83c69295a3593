"""Rollout engine: packed prefill and paged decode over an HF decoder, with one CUDA graph per batch bucket.

Owns the generation loop (scheduler -> prefill/decode -> sampler -> scheduler) and the decode graphs.
It knows nothing about tokenizers, rewards or training; its model's weights are the policy's own tensors or a
merged copy (`shared_weights.py`), refreshed from outside by in-place writes, so captured graphs stay valid.

On CPU everything runs eagerly (flex's eager path). On CUDA, flex is compiled and every decode bucket
(1, 2, 4, ..., max_batch_size) is captured once on first use.

Every entry point (`generate`, `capture_all`, and the graph warm-up inside them) runs under
`torch.inference_mode()`: the inference copy's parameters may require grad (a training model, or a
LoRA target), and a compiled flex traced with grad enabled is traced for backward, which the decode
masks (built without q-blocks) cannot support. Inference mode rather than `no_grad` because it also
skips version counters; the cost is that tensors created inside it (graph inputs/outputs) may only be
changed inside it, which holds since only the engine touches them. The KV pools, page tables and
`last_token` are created in `__init__` as normal tensors, so in-place LoRA refreshes and
`PageTable.flush` work from either mode.

Decode overlaps host and device (`EngineConfig.pipeline`): a step's input token is read on the device
from `last_token[slot]`, where the previous step (or the prefill) left it, and positions follow from
how many steps were issued, so the host queues step i+1 before it reads step i's tokens. Readback is a
non-blocking copy into pinned memory, waited on one step late; a sequence that hits EOS therefore
runs one extra step whose token is discarded (max-token stops are exact: the host never issues past
them). Admission and preemption need exact host state, so the scheduler asks for a sync first.

`EngineConfig.compile_decode` compiles the whole decode step (layers, masks, sampler) before capture.
A graph replay removes launch overhead but not the cost of each small kernel (HF layers run dozens per
layer in eager: norms in fp32, RoPE, residuals); compiling fuses them. The step traces as one graph
(`test_engine_pipeline.py` checks that on CPU with dynamo's eager backend). The KV writes are written so
inductor keeps them in place, fused into the kernels making K and V, instead of copying every pool each layer
(`kv_cache.py`), and the RoPE tables go through a custom op so they are computed once per step (`walker.py`);
`tests/rollout/test_compiled_decode_step.py` checks the generated code. On by default on CUDA; its gain
over the graphed eager step is in `benchmarks/results/rollout.json` (a file that predates the current code). The price is one compile
per batch bucket at capture, logged with its time and counted in `stats["capture_s"]`.

`EngineConfig.fuse_projections` (on by default, CPU too) runs the projections that read one input (q/k/v,
gate/up) as one GEMM per group (`fused_linear.py`): a skinny decode GEMM streams its weights faster when larger.

`EngineConfig.count_routed_experts` (off by default) counts, per decode step and MoE layer, the experts the batch's
rows routed to, on the device inside the same step (`routing.py`), for the MoE decode roofline.

Sliding-window layers keep only their window. They have their own page pool and table
(`EngineConfig.num_sliding_pages`), under the same slots as the full layers' one (`page_pools.py`): each
step releases the pages that left every sliding layer's window, and other sequences reuse them, so a
sequence holds at most `window_pages` pages there (`page_table.py`) however long it grows. The decode step
builds the sliding layers' masks and write indices from that table, with the same functions and shapes as
the full layers' ones, so it stays one captured graph; tables change in place at `flush`. A prefill writes a
prompt's tokens that are already out of the window to page 0, which nothing reads (its attention reads the
packed K/V, not the pool). It saves memory, not bytes read: the decode masks listed only in-window pages
before too. Full layers are unchanged: their table keeps every page of a sequence.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from contextlib import nullcontext
from dataclasses import dataclass, replace

import torch
from torch import nn

from lightning_ffpa import compile_fallbacks
from lightning_ffpa.attention import registry
from lightning_ffpa.errors import ConfigError
from lightning_ffpa.rollout.attention import StepContext, kernel_options
from lightning_ffpa.rollout.capture import check_capture
from lightning_ffpa.rollout.kv_cache import LayerSpec, PagedKVCache, pool_bytes
from lightning_ffpa.rollout.masks import (
    PREFILL_BLOCK,
    decode_block_mask,
    logical_block_mask,
    prefill_block_mask,
)
from lightning_ffpa.rollout.page_pools import PagePools
from lightning_ffpa.rollout.page_table import PageTable, window_pages
from lightning_ffpa.rollout.routing import RoutedExperts, moe_layers
from lightning_ffpa.rollout.sampler import SamplingParams, sample
from lightning_ffpa.rollout.scheduler import Scheduler, Sequence
from lightning_ffpa.rollout.walker import DecoderWalker

log = logging.getLogger(__name__)
GIB = 1 << 30
DEFAULT_KV_BLOCK = 64  # decode mask block: half the default page, so a last page is read half as far past its end
COMPILE_MODES = (None, "default", "max-autotune-no-cudagraphs")
# `EngineConfig.attention` -> the registry kernel whose flex-contract callable serves the paged layers.
ENGINE_KERNELS = {"flex": "flex", "dense": "reference"}


@dataclass
class EngineConfig:
    """Sizes of the paged cache and batch. Plain data: `RolloutEngine` (or the Callback, under its own
    option names) calls `check` before anything is allocated."""

    page_size: int = 128
    """Tokens per KV page: the unit the page table hands out and `num_pages` counts."""
    kv_block_size: int | None = None
    """Tokens per KV block of the decode masks: it divides `page_size`, and flex reads a row's last page only up to
    the block holding its newest token. None: the largest divisor of `page_size` up to 64. Gain:
    `benchmarks/results/rollout_kv_block.json` (row `ours_paged_flex_block128` is one block per page)."""
    num_pages: int = 1024
    """Physical pages per layer (sliding-window layers have their own pool, `num_sliding_pages`), page 0 reserved.
    The pools must fit the device's free memory when the engine is built (else one ConfigError naming this
    option, with how many pages would fit)."""
    num_sliding_pages: int | None = None
    """Physical pages of the sliding-window layers' own pool, page 0 reserved: they keep only the pages their
    window reads (about window / page_size + 1 per sequence) and reuse the ones behind it. None: enough for
    `max_batch_size` windows, at most `num_pages`; 0: no own pool (they keep every page, as full layers do).
    Fewer than one sequence's window needs is one ConfigError naming this option. No effect without sliding
    layers."""
    max_batch_size: int = 64
    """Most sequences decoded together (slot 0 is extra, reserved)."""
    max_seq_len: int = 2048
    """Longest prompt + completion; a multiple of page_size."""
    max_prefill_tokens: int = 8192
    """Token budget of one packed prefill."""
    cuda_graphs: bool = True
    """Capture decode per batch bucket (CUDA only)."""
    decode_buckets: list[int] | None = None
    """Batch sizes the decode step runs at: n sequences decode padded to the smallest bucket >= n. Each bucket is
    captured (and, with `compile_decode`, compiled) on first use, which takes tens of seconds at real depth (logged,
    and counted in `stats["capture_s"]`). None: powers of two below `max_batch_size`, and `max_batch_size`, which is
    always a bucket. Fewer buckets start sooner; a dense model's decode reads every weight whatever the batch, so
    a padded tail costs little (a MoE model's padding rows route to experts too: docs/rollout.md)."""
    compile_flex: bool = True
    """torch.compile flex_attention (CUDA only; CPU uses the eager path)."""
    attention: str = "flex"
    """"flex", or "dense" (SDPA over the same mask mods: a CPU reference path for fast tiny runs)."""
    compile_decode: bool | None = None
    """torch.compile the whole decode step (layers, masks, sampler) before capture, fusing the small ops.
    None: on for CUDA, off on CPU (which runs eagerly). Measured gain: `benchmarks/results/rollout.json` (12 layers;
    the file predates the current code: the README's History)."""
    compile_mode: str | None = None
    """torch.compile mode of the decode step, with `compile_decode`: None (inductor's default) or
    "max-autotune-no-cudagraphs" (inductor tunes the step's matmuls and fused kernels; a longer first
    compile). Modes that add inductor's own CUDA graphs are refused: the engine captures its own."""
    pipeline: bool = True
    """Queue each decode step before reading back the previous one (stops are seen one step late)."""
    fuse_projections: bool = True
    """Run the projections that read one input (q/k/v, gate/up) as one GEMM over their weights, moved into one
    buffer per group (the Parameters stay, as views of it). Groups that cannot fuse (adapter layers, sharded
    weights) stay separate and `projection_path` says why. Gain: `benchmarks/results/rollout_full_depth_aee53bf.json`
    (row `ours_paged_flex_unfused` is this off)."""
    fuse_kv_write: bool = True
    """In the compiled decode step, write K/V into the pools with a scatter inductor fuses into the kernel that
    makes them; off: one `index_copy_` kernel per pool. No effect eagerly. Gain:
    `benchmarks/results/rollout_full_depth.json` (row `ours_paged_flex_kvwrite_op` is this off)."""
    count_routed_experts: bool = False
    """Count, per decode step and MoE layer, the experts the batch's rows routed to (`routing.py`: on-device
    counts, read after `generate` from `engine.routing`), for the MoE decode roofline. Off: no hook, the decode
    step unchanged. A model without MoE layers is a ConfigError naming this option."""

    def check(self, option: str = "engine") -> None:
        """Raise ConfigError naming `<option>.<field>` for the first value out of range or inconsistent."""
        for name, minimum in (("page_size", 1), ("num_pages", 2), ("max_batch_size", 1), ("max_seq_len", 1),
                              ("max_prefill_tokens", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or value < minimum:
                why = "page 0 is reserved" if name == "num_pages" else "a count"
                raise ConfigError(f"{option}.{name}", value, f"must be an int >= {minimum} ({why})")
        if self.num_sliding_pages is not None and (isinstance(self.num_sliding_pages, bool)
                                                   or not isinstance(self.num_sliding_pages, int)
                                                   or self.num_sliding_pages < 0 or self.num_sliding_pages == 1):
            raise ConfigError(f"{option}.num_sliding_pages", self.num_sliding_pages,
                              "must be None (derived), 0 (no sliding pool) or an int >= 2 (page 0 is reserved)")
        if self.kv_block_size is not None and (isinstance(self.kv_block_size, bool)
                                               or not isinstance(self.kv_block_size, int) or self.kv_block_size < 1
                                               or self.page_size % self.kv_block_size):
            raise ConfigError(f"{option}.kv_block_size", self.kv_block_size,
                              f"must be None or an int >= 1 that divides `{option}.page_size={self.page_size}`")
        if self.max_seq_len % self.page_size:
            raise ConfigError(f"{option}.max_seq_len", self.max_seq_len,
                              f"must be a multiple of `{option}.page_size={self.page_size}`")
        if self.attention not in ENGINE_KERNELS:
            raise ConfigError(f"{option}.attention", self.attention, f"must be one of {list(ENGINE_KERNELS)}")
        if self.compile_mode not in COMPILE_MODES:
            raise ConfigError(f"{option}.compile_mode", self.compile_mode,
                              f"must be one of {list(COMPILE_MODES)} (the engine captures its own CUDA graphs)")
        buckets = self.decode_buckets
        if buckets is not None and (not isinstance(buckets, (list, tuple)) or any(
                isinstance(b, bool) or not isinstance(b, int) or not 1 <= b <= self.max_batch_size for b in buckets)):
            raise ConfigError(f"{option}.decode_buckets", buckets, "must be None or a list of ints from 1 to "
                              f"`{option}.max_batch_size={self.max_batch_size}`")
        for name in ("fuse_projections", "fuse_kv_write", "count_routed_experts"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{option}.{name}", getattr(self, name), "must be a bool")
        if self.compile_mode is not None and self.compile_decode is False:
            raise ConfigError(f"{option}.compile_mode", self.compile_mode,
                              f"needs `{option}.compile_decode` on (it is the mode of the compiled decode step)")

    def check_fits(self, prompt_len: int, max_new_tokens: int, option: str = "engine", where: str = "") -> None:
        """Raise unless a prompt of `prompt_len` tokens plus `max_new_tokens` fits `max_seq_len` (else the
        completion would be cut short) and the page pool (else the scheduler could never place it)."""
        need = prompt_len + max_new_tokens
        if need > self.max_seq_len:
            raise ConfigError(f"{option}.max_seq_len", self.max_seq_len,
                              f"must be >= prompt length + `max_new_tokens` = {prompt_len} + {max_new_tokens} = "
                              f"{need}{where}")
        pages = -(-need // self.page_size)
        if pages > self.num_pages - 1:  # page 0 is reserved for padding
            raise ConfigError(f"{option}.num_pages", self.num_pages,
                              f"must be >= {pages + 1}: {need} tokens take {pages} pages of {self.page_size}, "
                              f"plus the reserved page 0{where}")

    def check_device(self, device: torch.device, option: str = "engine") -> bool:
        """The checks that depend on where the engine runs (the Callback's pre-flight runs them before a model
        exists); returns whether the decode step compiles there."""
        cuda = device.type == "cuda"
        if cuda and self.page_size % 16:
            raise ConfigError(f"{option}.page_size", self.page_size,
                              "must be a multiple of 16 on CUDA (flex decode tiles)")
        if cuda and self.decode_block % 16:
            raise ConfigError(f"{option}.kv_block_size", self.kv_block_size,
                              "must be a multiple of 16 on CUDA (flex decode tiles)")
        if self.compile_decode and not cuda:
            raise ConfigError(f"{option}.compile_decode", True, "needs CUDA (the CPU path runs eagerly)")
        compile_step = cuda if self.compile_decode is None else self.compile_decode
        if self.compile_mode is not None and not compile_step:
            raise ConfigError(f"{option}.compile_mode", self.compile_mode,
                              f"has no effect: the decode step runs eagerly here (`{option}.compile_decode` "
                              "off, or not on CUDA)")
        return compile_step

    @property
    def decode_block(self) -> int:
        """The decode masks' KV block in tokens (`kv_block_size`, or its default)."""
        return self.kv_block_size or math.gcd(self.page_size, DEFAULT_KV_BLOCK)

    def sliding_window(self, specs: list[LayerSpec]) -> int | None:
        """The window the sliding pool keeps (the widest sliding layer's), None when no layer has one."""
        return max((s.window for s in specs if s.window is not None), default=None)

    def sliding_pages(self, specs: list[LayerSpec], option: str = "engine") -> int:
        """Pages of the sliding layers' pool for a model of these layers: 0 when it has none (no sliding layer,
        or `num_sliding_pages=0`). Raise ConfigError naming `num_sliding_pages` when it cannot hold one
        sequence's window."""
        window = self.sliding_window(specs)
        if window is None or self.num_sliding_pages == 0:
            return 0
        per_seq = min(window_pages(window, self.page_size, self.decode_block), self.max_seq_len // self.page_size)
        if self.num_sliding_pages is None:  # every slot's window; more than the full pool could never be used
            return min(self.num_pages, self.max_batch_size * per_seq + 1)
        if self.num_sliding_pages < per_seq + 1:
            raise ConfigError(f"{option}.num_sliding_pages", self.num_sliding_pages,
                              f"must be >= {per_seq + 1}, or 0 (no sliding pool): one sequence's {window}-token "
                              f"window spans up to {per_seq} pages of {self.page_size} tokens, plus the reserved "
                              "page 0")
        return self.num_sliding_pages

    def pool_bytes(self, specs: list[LayerSpec], dtype: torch.dtype | int, num_pages: int | None = None) -> int:
        """Bytes of every KV pool (full and sliding) for these layers in `dtype` (or that many bytes per element),
        at `num_pages` (None: this config's)."""
        cfg = self if num_pages is None else replace(self, num_pages=num_pages)
        return pool_bytes(specs, cfg.num_pages, cfg.page_size, dtype, cfg.sliding_pages(specs))

    def pages_that_fit(self, specs: list[LayerSpec], dtype: torch.dtype, room: int) -> int:
        """The largest `num_pages` (at most this config's) whose pools fit in `room` bytes; 0 if none does."""
        lo, hi = 0, self.num_pages
        while lo < hi:  # pool bytes grow with num_pages (the derived sliding pool too)
            mid = (lo + hi + 1) // 2
            if mid >= 2 and self.pool_bytes(specs, dtype, mid) <= room:
                lo = mid
            else:
                hi = mid - 1
        return lo


def free_device_bytes(device: torch.device) -> int | None:
    """Bytes the allocator can still get on `device` (None off CUDA, where nothing is checked)."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def check_pool_fits(cfg: EngineConfig, specs: list[LayerSpec], dtype: torch.dtype, free: int | None,
                    device: torch.device, option: str) -> None:
    """Raise ConfigError naming `<option>.num_pages` when the KV pools alone exceed the free device memory:
    one clear error before anything is allocated, in place of an out-of-memory error halfway through."""
    need = cfg.pool_bytes(specs, dtype)
    if free is None or need <= free:
        return
    fit = cfg.pages_that_fit(specs, dtype, free)
    raise ConfigError(f"{option}.num_pages", cfg.num_pages,
                      f"the KV pools need {need / GIB:.1f} GiB and {free / GIB:.1f} GiB is free on {device}; "
                      f"at most {fit} pages fit (fewer, to leave room for activations): lower it, "
                      "`max_batch_size` or `max_seq_len`")


def _buckets(max_batch: int, chosen: list[int] | None = None) -> list[int]:
    """The decode batch buckets, ascending: `chosen` (default: the powers of two below `max_batch`) and `max_batch`."""
    if chosen is None:
        chosen = [2**i for i in range(max_batch.bit_length()) if 2**i < max_batch]
    return sorted({*chosen, max_batch})


class RolloutEngine:
    """Generates completions for token prompts with an HF causal LM it treats as read-only."""

    def __init__(self, model: nn.Module, config: EngineConfig | None = None,
                 eos_token_ids: set[int] | None = None, option: str = "engine") -> None:
        """`option` is how errors name the config (the Callback passes `RolloutCallback.engine`)."""
        self.model = model.eval()
        self.config = cfg = config or EngineConfig()
        cfg.check(option)
        self.walker = DecoderWalker(model)
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.on_cuda = self.device.type == "cuda"
        compile_step = cfg.check_device(self.device, option)
        check_capture(model, self.device, cfg.cuda_graphs, option)
        self.eos_token_ids = set(eos_token_ids or ())
        if cfg.count_routed_experts and not moe_layers(model):
            raise ConfigError(f"{option}.count_routed_experts", True, "the model has no MoE layers to count")
        # registered before any compile or capture: the hooks are part of the traced and captured decode step
        self.routing = RoutedExperts(model, cfg.max_batch_size, self.device) if cfg.count_routed_experts else None
        if cfg.fuse_projections:  # after the config checks (it moves the weights), before the pool's room check
            self.walker.fuse()
            if self.on_cuda:
                torch.cuda.empty_cache()  # the weights' old blocks: cached, they would hold a second copy's worth
        self.num_sliding_pages = cfg.sliding_pages(self.walker.specs, option)  # 0: no sliding pool
        self.page_table = PageTable(cfg.num_pages, cfg.page_size, cfg.max_batch_size + 1,
                                    cfg.max_seq_len // cfg.page_size, self.device)
        self.sliding_table = None  # the sliding layers' table; None: they use `page_table` like the full ones
        if self.num_sliding_pages:
            self.sliding_table = PageTable(self.num_sliding_pages, cfg.page_size, cfg.max_batch_size + 1,
                                           cfg.max_seq_len // cfg.page_size, self.device,
                                           window=cfg.sliding_window(self.walker.specs), kv_block=cfg.decode_block)
        self.pages = PagePools(self.page_table, self.sliding_table)
        check_pool_fits(cfg, self.walker.specs, self.dtype, free_device_bytes(self.device), self.device, option)
        self.cache = PagedKVCache(self.walker.specs, cfg.num_pages, cfg.page_size, self.dtype, self.device,
                                  cfg.fuse_kv_write, self.num_sliding_pages)
        self.logical = {w: logical_block_mask(cfg.max_seq_len, cfg.decode_block, w, self.device)
                        for w in self.walker.windows}
        kernel = registry.get(ENGINE_KERNELS[cfg.attention], "masked")
        self.flex, self.attention_path = kernel.masked(self.on_cuda and cfg.compile_flex)
        for head_dim in {spec.head_dim for spec in self.walker.specs}:  # a bad override fails here, before compile
            kernel_options(head_dim, True, self.dtype, kv_block=cfg.decode_block)
        self._step, self.decode_path = self._decode_step, "eager"
        if compile_step:
            compile_fallbacks.prepare()
            self._step, self.decode_path = (torch.compile(self._decode_step, dynamic=False, mode=cfg.compile_mode),
                                            "compiled")
        self.buckets = _buckets(cfg.max_batch_size, cfg.decode_buckets)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, dict[str, torch.Tensor]]] = {}
        self._graph_pool = None
        self._sampling: SamplingParams | None = None
        # Each row's newest token, by slot: decode reads its input here on the device (slot 0: padding).
        self.last_token = torch.zeros(cfg.max_batch_size + 1, dtype=torch.long, device=self.device)
        self.stats = {"prefill_steps": 0, "decode_steps": 0, "graph_replays": 0, "eager_decodes": 0,
                      "preemptions": 0, "prefill_tokens": 0, "decode_tokens": 0, "syncs": 0, "capture_s": 0.0,
                      **self.pages.stats()}

    @property
    def kv_write_path(self) -> str:
        """How the decode step writes K/V into the pools: "index_copy" (eager), "fused_scatter" or "kv_write_op"."""
        if self.decode_path != "compiled":
            return "index_copy"
        return "fused_scatter" if self.config.fuse_kv_write else "kv_write_op"

    @property
    def projection_path(self) -> str:
        """What the projections run as (`DecoderWalker.projection_path`)."""
        return self.walker.projection_path

    # ---- public -------------------------------------------------------------------------------
    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], max_new_tokens: int | None = None,
                 sampling: SamplingParams | None = None,
                 generator: torch.Generator | None = None) -> list[Sequence]:
        """Generate for every prompt; returns finished `Sequence`s in prompt order.

        `max_new_tokens` defaults to `sampling.max_new_tokens`; `sampling` defaults to greedy.
        """
        sampling = sampling or SamplingParams(temperature=0.0)
        if max_new_tokens is not None:
            sampling = replace(sampling, max_new_tokens=max_new_tokens)
        sampling.check()
        if prompts:
            self.config.check_fits(max(map(len, prompts)), sampling.max_new_tokens, where=" (the longest prompt)")
        self._use_sampling(sampling)
        if generator is not None and self.on_cuda and self.config.cuda_graphs:
            raise ValueError("a custom `generator` cannot drive captured CUDA graphs; seed torch.cuda instead")
        cfg = self.config
        self.pages.restart()
        sched = Scheduler(self.pages, cfg.max_batch_size, cfg.max_prefill_tokens, self.eos_token_ids)
        for i, p in enumerate(prompts):
            sched.add(Sequence(i, list(p), sampling.max_new_tokens))
        with self.walker.paged_attention():
            self._run(sched, sampling, generator)
        self.stats["preemptions"] += sched.num_preemptions
        self.stats.update(self.pages.stats())
        return sorted(sched.finished, key=lambda s: s.seq_id)

    def _run(self, sched: Scheduler, sampling: SamplingParams, generator) -> None:
        lag = 1 if self.config.pipeline else 0
        inflight: deque[_Readback] = deque()
        while sched.has_work:
            kind, seqs = sched.schedule()
            if kind == "sync":
                if not inflight:
                    raise RuntimeError("scheduler asked for a sync with nothing in flight")
                self.stats["syncs"] += 1
                _drain(inflight, sched)
            elif kind == "prefill":
                _drain(inflight, sched)
                self._prefill(seqs, sampling, generator).apply(sched)
            else:
                inflight.append(self._decode(seqs, sampling, generator))
                # Read back one step late: the next step is already queued when the host waits here.
                while len(inflight) > lag:
                    inflight.popleft().apply(sched)
        _drain(inflight, sched)  # a step issued after the last EOS: its tokens are all discarded

    @torch.inference_mode()
    def capture_all(self, sampling: SamplingParams) -> None:
        """Capture every bucket up front (benchmarks keep capture out of timed runs)."""
        if self.on_cuda and self.config.cuda_graphs:
            self._use_sampling(sampling)
            with self.walker.paged_attention():
                for b in self.buckets:
                    self._graph(b, sampling)

    def _use_sampling(self, sampling: SamplingParams) -> None:
        if self._sampling is None or sampling.sampler_key != self._sampling.sampler_key:
            self._graphs.clear()  # the sampler is baked into each captured graph
            self._sampling = sampling

    # ---- prefill ------------------------------------------------------------------------------
    def _prefill(self, seqs: list[Sequence], sampling: SamplingParams, generator) -> _Readback:
        lens = [s.num_tokens for s in seqs]
        total = sum(lens)
        padded = -(-total // PREFILL_BLOCK) * PREFILL_BLOCK
        if self.on_cuda:  # power-of-two buckets bound the number of compiled prefill shapes
            padded = max(PREFILL_BLOCK, 1 << (padded - 1).bit_length())
        ids = torch.zeros(padded, dtype=torch.long)
        pos = torch.zeros(padded, dtype=torch.long)
        doc = torch.full((padded,), -1, dtype=torch.long)
        slots = torch.zeros(padded, dtype=torch.long)
        start = 0
        for d, (s, n) in enumerate(zip(seqs, lens)):
            ids[start:start + n] = torch.tensor(s.tokens)
            pos[start:start + n] = torch.arange(n)
            doc[start:start + n] = d
            slots[start:start + n] = s.slot
            start += n
        last = torch.tensor(lens).cumsum(0) - 1
        seq_slots = torch.tensor([s.slot for s in seqs])
        ids, pos, doc, slots, last, seq_slots = (self._to_device(t) for t in (ids, pos, doc, slots, last, seq_slots))
        self.pages.flush()
        index, sliding_index = self._write_index(slots, pos)
        self.cache.begin(index, decode=False, sliding_index=sliding_index)
        ctx = StepContext({w: prefill_block_mask(doc, pos, w) for w in self.walker.windows}, decode=False,
                          flex=self.flex)
        logits = self.walker.logits(ids[None], pos[None], ctx, self.cache, logits_index=last)
        self.stats["prefill_steps"] += 1
        self.stats["prefill_tokens"] += total
        tokens, logprobs = sample(logits, sampling, generator)
        self.last_token.index_copy_(0, seq_slots, tokens)  # the first decode step reads its input here
        return _Readback.start(seqs, tokens, logprobs)

    # ---- decode -------------------------------------------------------------------------------
    def _decode_step(self, pos: torch.Tensor, slots: torch.Tensor, sampling, generator):
        """One token per row: write its K/V, attend over the row's pages, sample. Graph-capturable.

        The input token comes from `last_token[slot]` and the sampled one goes back there, so the
        host never has to see a token before the next step can run.
        """
        ids = self.last_token[slots]  # (B,)
        if self.routing is not None:
            self.routing.mark_rows(slots)
        index, sliding_index = self._write_index(slots, pos)
        self.cache.begin(index, decode=True, sliding_index=sliding_index)
        block = self.config.decode_block
        masks = {}
        for w in self.walker.windows:
            pt = self._table_of(w)
            masks[w] = decode_block_mask(self.logical[w], pt.table, pt.owner, slots, pos, pt.page_size, block, w)
        ctx = StepContext(masks, decode=True, flex=self.flex, kv_block=block)
        logits = self.walker.logits(ids[:, None], pos[:, None], ctx, self.cache)  # (B, V)
        tokens, logprobs = sample(logits, sampling, generator)
        self.last_token.index_copy_(0, slots, tokens)  # padded rows all write slot 0, which nobody reads
        return tokens, logprobs

    def _table_of(self, window: int | None) -> PageTable:
        """The page table a layer of this window reads: the sliding one for windowed layers, when there is one."""
        return self.page_table if window is None or self.sliding_table is None else self.sliding_table

    def _write_index(self, slots: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Flat pool indices of (slot, position) in the full pools and in the sliding ones (None: no sliding pool).
        A token whose sliding page was released (out of the window already) is written to page 0."""
        sliding = None if self.sliding_table is None else self.sliding_table.physical_index(slots, pos)
        return self.page_table.physical_index(slots, pos), sliding

    def _decode(self, seqs: list[Sequence], sampling: SamplingParams, generator) -> _Readback:
        n = len(seqs)
        bucket = next(b for b in self.buckets if b >= n)
        host = torch.zeros(2, bucket, dtype=torch.long, pin_memory=self.on_cuda)  # positions, slots
        host[0, :n] = torch.tensor([s.num_issued_tokens - 1 for s in seqs])  # padded rows: slot 0, position 0
        host[1, :n] = torch.tensor([s.slot for s in seqs])
        for s in seqs:
            s.num_pending += 1
        self.pages.flush()
        self.stats["decode_steps"] += 1
        self.stats["decode_tokens"] += n
        if self.routing is not None:
            self.routing.steps += 1
        if self.on_cuda and self.config.cuda_graphs:
            graph, static = self._graph(bucket, sampling)
            static["inputs"].copy_(host, non_blocking=True)  # stream-ordered after the previous replay
            graph.replay()
            self.stats["graph_replays"] += 1
            return _Readback.start(seqs, static["tokens"][:n], static["logprobs"][:n])
        self.stats["eager_decodes"] += 1
        dev = self._to_device(host)
        with self._counting():
            tokens, logprobs = self._step(dev[0], dev[1], sampling, generator)
        return _Readback.start(seqs, tokens[:n], logprobs[:n])

    def _counting(self):
        """Inside: the routers' calls are a decode step's, counted when `count_routed_experts` is on."""
        return self.routing.counting() if self.routing is not None else nullcontext()

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        if not self.on_cuda:
            return t
        return t.pin_memory().to(self.device, non_blocking=True)

    def _graph(self, bucket: int, sampling: SamplingParams):
        if bucket in self._graphs:
            return self._graphs[bucket]
        start = time.perf_counter()
        inputs = torch.zeros(2, bucket, dtype=torch.long, device=self.device)  # all rows padding (slot 0)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        # Warm up (compiles flex) off the capture. Counting is on as in the capture, so the step compiles once, with
        # the routers' hooks; its rows are all padding, so nothing is counted.
        with torch.cuda.stream(stream), self._counting():
            for _ in range(2):
                self._step(inputs[0], inputs[1], sampling, None)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        if self._graph_pool is None:
            self._graph_pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self._graph_pool), self._counting():
            tokens, logprobs = self._step(inputs[0], inputs[1], sampling, None)
        self._graphs[bucket] = (graph, {"inputs": inputs, "tokens": tokens, "logprobs": logprobs})
        took = time.perf_counter() - start
        self.stats["capture_s"] += took
        # A compiled step compiles once per bucket: tens of seconds each at real depth, so say so.
        log.info("rollout engine: captured decode bucket %d (%s step) in %.1f s", bucket, self.decode_path, took)
        return self._graphs[bucket]


def _drain(inflight: deque[_Readback], sched: Scheduler) -> None:
    """Read back every step still in flight, oldest first."""
    while inflight:
        inflight.popleft().apply(sched)


class _Readback:
    """One issued step's tokens on their way to the host: a non-blocking copy into pinned memory."""

    def __init__(self, seqs: list[Sequence], tokens: torch.Tensor, logprobs: torch.Tensor,
                 event: torch.cuda.Event | None) -> None:
        self.seqs, self.tokens, self.logprobs, self.event = seqs, tokens, logprobs, event

    @classmethod
    def start(cls, seqs: list[Sequence], tokens: torch.Tensor, logprobs: torch.Tensor) -> _Readback:
        """Queue the copy behind the step that produced `tokens` (graph outputs are overwritten next replay)."""
        if tokens.device.type != "cuda":
            return cls(seqs, tokens.clone(), logprobs.clone(), None)
        host_t = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host_l = torch.empty(logprobs.shape, dtype=logprobs.dtype, pin_memory=True)
        host_t.copy_(tokens, non_blocking=True)
        host_l.copy_(logprobs, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return cls(seqs, host_t, host_l, event)

    def apply(self, sched: Scheduler) -> None:
        """Wait for this step only (later steps keep running) and hand its tokens to the scheduler."""
        if self.event is not None:
            self.event.synchronize()
        sched.postprocess(self.seqs, self.tokens.tolist(), self.logprobs.tolist())
