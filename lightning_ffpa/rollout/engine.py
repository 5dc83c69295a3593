"""Rollout engine: packed prefill and paged decode over an HF decoder, with one CUDA graph per batch bucket.

Owns the generation loop (scheduler -> prefill/decode -> sampler -> scheduler) and the decode graphs.
It knows nothing about tokenizers, rewards or training; weights arrive from outside (`lora_sync.py`)
by in-place copies, so captured graphs stay valid across refreshes.

On CPU everything runs eagerly (flex's eager path). On CUDA, flex is compiled and every decode bucket
(1, 2, 4, ..., max_batch_size) is captured once on first use.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.attention.flex_attention import flex_attention

from lightning_ffpa.rollout import compat
from lightning_ffpa.rollout.attention import StepContext, dense_reference
from lightning_ffpa.rollout.kv_cache import PagedKVCache
from lightning_ffpa.rollout.masks import (
    PREFILL_BLOCK,
    decode_block_mask,
    logical_block_mask,
    prefill_block_mask,
)
from lightning_ffpa.rollout.page_table import PageTable
from lightning_ffpa.rollout.sampler import SamplingParams, sample
from lightning_ffpa.rollout.scheduler import Scheduler, Sequence
from lightning_ffpa.rollout.walker import DecoderWalker


@dataclass
class EngineConfig:
    """Sizes of the paged cache and batch."""

    page_size: int = 128
    """Tokens per KV page (= the KV block of every mask)."""
    num_pages: int = 1024
    """Physical pages per layer, page 0 reserved."""
    max_batch_size: int = 64
    """Most sequences decoded together (slot 0 is extra, reserved)."""
    max_seq_len: int = 2048
    """Longest prompt + completion; a multiple of page_size."""
    max_prefill_tokens: int = 8192
    """Token budget of one packed prefill."""
    cuda_graphs: bool = True
    """Capture decode per batch bucket (CUDA only)."""
    compile_flex: bool = True
    """torch.compile flex_attention (CUDA only; CPU uses the eager path)."""
    attention: str = "flex"
    """"flex", or "dense" (SDPA over the same mask mods: a CPU reference path for fast tiny runs)."""

    def __post_init__(self) -> None:
        if self.max_seq_len % self.page_size:
            raise ValueError(f"`max_seq_len={self.max_seq_len}` must be a multiple of `page_size={self.page_size}`")
        if self.num_pages < 2:
            raise ValueError(f"`num_pages={self.num_pages}` must be >= 2")
        if self.attention not in ("flex", "dense"):
            raise ValueError(f"`attention={self.attention!r}` must be 'flex' or 'dense'")


def _buckets(max_batch: int) -> list[int]:
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b *= 2
    return [*out, max_batch]


class RolloutEngine:
    """Generates completions for token prompts with an HF causal LM it treats as read-only."""

    def __init__(self, model: nn.Module, config: EngineConfig | None = None,
                 eos_token_ids: set[int] | None = None) -> None:
        self.model = model.eval()
        self.config = cfg = config or EngineConfig()
        self.walker = DecoderWalker(model)
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.on_cuda = self.device.type == "cuda"
        if self.on_cuda and cfg.page_size % 16:
            raise ValueError(f"`page_size={cfg.page_size}` must be a multiple of 16 on CUDA (flex decode tiles)")
        self.eos_token_ids = set(eos_token_ids or ())
        self.page_table = PageTable(cfg.num_pages, cfg.page_size, cfg.max_batch_size + 1,
                                    cfg.max_seq_len // cfg.page_size, self.device)
        self.cache = PagedKVCache(self.walker.specs, cfg.num_pages, cfg.page_size, self.dtype, self.device)
        self.logical = {w: logical_block_mask(cfg.max_seq_len, cfg.page_size, w, self.device)
                        for w in self.walker.windows}
        self.flex, self.attention_path = flex_attention, "flex_eager"
        if cfg.attention == "dense":
            self.flex, self.attention_path = dense_reference, "dense_reference"
        elif self.on_cuda and cfg.compile_flex:
            compat.raise_recompile_limit()
            self.flex, self.attention_path = torch.compile(flex_attention, dynamic=False), "flex_compiled"
        self.buckets = _buckets(cfg.max_batch_size)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, dict[str, torch.Tensor]]] = {}
        self._graph_pool = None
        self._sampling: SamplingParams | None = None
        self.stats = {"prefill_steps": 0, "decode_steps": 0, "graph_replays": 0, "eager_decodes": 0,
                      "preemptions": 0, "prefill_tokens": 0, "decode_tokens": 0}

    # ---- public -------------------------------------------------------------------------------
    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], max_new_tokens: int, sampling: SamplingParams | None = None,
                 generator: torch.Generator | None = None) -> list[Sequence]:
        """Generate for every prompt; returns finished `Sequence`s in prompt order."""
        sampling = sampling or SamplingParams(temperature=0.0)
        if sampling != self._sampling:
            self._graphs.clear()  # the sampler is baked into each captured graph
            self._sampling = sampling
        if generator is not None and self.on_cuda and self.config.cuda_graphs:
            raise ValueError("a custom `generator` cannot drive captured CUDA graphs; seed torch.cuda instead")
        cfg = self.config
        sched = Scheduler(self.page_table, cfg.max_batch_size, cfg.max_prefill_tokens, self.eos_token_ids)
        for i, p in enumerate(prompts):
            sched.add(Sequence(i, list(p), max_new_tokens))
        while sched.has_work:
            kind, seqs = sched.schedule()
            if kind == "prefill":
                tokens, logprobs = self._prefill(seqs, sampling, generator)
            else:
                tokens, logprobs = self._decode(seqs, sampling, generator)
            # one device->host copy per step: the scheduler must see EOS before the next step
            sched.postprocess(seqs, tokens.tolist(), logprobs.tolist())
        self.stats["preemptions"] += sched.num_preemptions
        return sorted(sched.finished, key=lambda s: s.seq_id)

    # ---- prefill ------------------------------------------------------------------------------
    def _prefill(self, seqs: list[Sequence], sampling: SamplingParams, generator):
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
        ids, pos, doc, slots, last = (t.to(self.device, non_blocking=True) for t in (ids, pos, doc, slots, last))
        self.page_table.flush()
        self.cache.begin(self.page_table.physical_index(slots, pos), decode=False)
        ctx = StepContext({w: prefill_block_mask(doc, pos, w) for w in self.walker.windows}, decode=False,
                          flex=self.flex)
        logits = self.walker.forward(ids[None], pos[None], ctx, self.cache, logits_index=last)
        self.stats["prefill_steps"] += 1
        self.stats["prefill_tokens"] += total
        return sample(logits, sampling, generator)

    # ---- decode -------------------------------------------------------------------------------
    def _decode_step(self, ids: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor, sampling, generator):
        """One token per row: write its K/V, attend over the row's pages, sample. Graph-capturable."""
        pt = self.page_table
        self.cache.begin(pt.physical_index(slots, pos), decode=True)
        masks = {w: decode_block_mask(self.logical[w], pt.table, pt.owner, slots, pos, pt.page_size, w)
                 for w in self.walker.windows}
        ctx = StepContext(masks, decode=True, flex=self.flex)
        logits = self.walker.forward(ids[:, None], pos[:, None], ctx, self.cache)  # (B, V)
        return sample(logits, sampling, generator)

    def _decode(self, seqs: list[Sequence], sampling: SamplingParams, generator):
        n = len(seqs)
        bucket = next(b for b in self.buckets if b >= n)
        host = torch.zeros(3, bucket, dtype=torch.long)  # ids, positions, slots; padded rows use slot 0
        host[0, :n] = torch.tensor([s.tokens[-1] for s in seqs])
        host[1, :n] = torch.tensor([s.num_tokens - 1 for s in seqs])
        host[2, :n] = torch.tensor([s.slot for s in seqs])
        self.page_table.flush()
        self.stats["decode_steps"] += 1
        self.stats["decode_tokens"] += n
        if self.on_cuda and self.config.cuda_graphs:
            graph, static = self._graph(bucket, sampling)
            static["inputs"].copy_(host, non_blocking=True)
            graph.replay()
            self.stats["graph_replays"] += 1
            return static["tokens"][:n], static["logprobs"][:n]
        self.stats["eager_decodes"] += 1
        dev = host.to(self.device)
        tokens, logprobs = self._decode_step(dev[0], dev[1], dev[2], sampling, generator)
        return tokens[:n], logprobs[:n]

    def _graph(self, bucket: int, sampling: SamplingParams):
        if bucket in self._graphs:
            return self._graphs[bucket]
        inputs = torch.zeros(3, bucket, dtype=torch.long, device=self.device)  # all rows padding (slot 0)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm up (compiles flex) off the capture
            for _ in range(2):
                self._decode_step(inputs[0], inputs[1], inputs[2], sampling, None)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        if self._graph_pool is None:
            self._graph_pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self._graph_pool):
            tokens, logprobs = self._decode_step(inputs[0], inputs[1], inputs[2], sampling, None)
        self._graphs[bucket] = (graph, {"inputs": inputs, "tokens": tokens, "logprobs": logprobs})
        return self._graphs[bucket]

    def capture_all(self, sampling: SamplingParams) -> None:
        """Capture every bucket up front (benchmarks keep capture out of timed runs)."""
        if self.on_cuda and self.config.cuda_graphs:
            if sampling != self._sampling:
                self._graphs.clear()
                self._sampling = sampling
            for b in self.buckets:
                self._graph(b, sampling)
