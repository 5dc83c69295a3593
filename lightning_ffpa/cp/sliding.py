"""Sliding-window attention under head-tail context parallelism: a neighbour halo, then one local masked call.

Owns: fetching the K/V a window needs from neighbouring chunks (and returning their gradients), the per-batch
mask (same document, causal, ``0 <= q - k < window``; HF Gemma4's sliding rule), and the local attention call:
``flex_attention`` on CUDA, masked fp32 math on CPU (torch's Flex has no CPU backward), or a registry kernel's
windowed varlen attention ("fa4") over the chunk's documents, each with the window's keys before the chunk.
Does not own: the full-attention ring (``ring.py``), sharding (``sharding.py``) or the process group (``group.py``).

Halo (h = window - 1 keys before a chunk are all a query can see outside it; chunk length C):
- h <= C: rank r's head chunk r needs the tail of chunk r-1 (rank r-1's head chunk); its tail chunk 2cp-1-r
  needs the tail of chunk 2cp-2-r (rank r+1's tail chunk, or its own head chunk on the last rank). One P2P
  message each way between ring neighbours, forward and backward.
- h > C (window longer than a chunk): every rank all-gathers K/V (autograd all_gather, reduce-scatter of the
  gradient), costing cp x K/V memory; counted as ``sliding_allgather`` in the ring stats.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_ffpa.attention import registry
from lightning_ffpa.attention.flex import flex_forward
from lightning_ffpa.attention.masks import build_block_mask
from lightning_ffpa.cp.group import RingGroup
from lightning_ffpa.cp.layout import RingLayout
from lightning_ffpa.cp.stats import RingStats

# Local-call backends: masked ("flex" on CUDA, "sdpa": fp32 masked math, for CPU), or a registry kernel's windowed
# varlen attention over the chunk's documents ("fa4": flash-attn-4, whose backward is flash-style).
VARLEN_BACKENDS = ("fa4",)
BACKENDS = ("flex", "sdpa", *VARLEN_BACKENDS, "auto")  # "auto": FA4 where a call can take it, else masked


def _swap_with_neighbours(ring, to_next: Tensor, from_next: Tensor, to_prev: Tensor, from_prev: Tensor) -> None:
    """Exchange with ring ranks r+1 and r-1 (where they exist) in one batched P2P round."""
    r, cp = ring.rank, ring.size
    ops = []
    if r < cp - 1:
        ops += [dist.P2POp(dist.isend, to_next, ring.global_rank(r + 1), ring.group),
                dist.P2POp(dist.irecv, from_next, ring.global_rank(r + 1), ring.group)]
    if r > 0:
        ops += [dist.P2POp(dist.isend, to_prev, ring.global_rank(r - 1), ring.group),
                dist.P2POp(dist.irecv, from_prev, ring.global_rank(r - 1), ring.group)]
    for w in dist.batch_isend_irecv(ops) if ops else []:
        w.wait()


class _Halo(torch.autograd.Function):
    """Exchange the last h keys/values of each local chunk with ring neighbours (see module docstring)."""

    @staticmethod
    def forward(ctx, head_tail: Tensor, tail_tail: Tensor, ring: RingGroup):
        r, cp = ring.rank, ring.size
        head_tail, tail_tail = head_tail.contiguous(), tail_tail.contiguous()
        halo_head = torch.zeros_like(head_tail)  # rank 0 has nothing before chunk 0 (masked by position)
        halo_tail = head_tail.clone() if r == cp - 1 else torch.empty_like(tail_tail)
        _swap_with_neighbours(ring, head_tail, halo_tail, tail_tail, halo_head)
        ctx.ring = ring
        return halo_head, halo_tail

    @staticmethod
    def backward(ctx, g_head: Tensor, g_tail: Tensor):
        ring = ctx.ring
        r, cp = ring.rank, ring.size
        g_head, g_tail = g_head.contiguous(), g_tail.contiguous()
        d_head_tail = g_tail.clone() if r == cp - 1 else torch.empty_like(g_tail)
        d_tail_tail = torch.zeros_like(g_head)
        # my halo_tail came from r+1's tail chunk; r+1 used my head chunk's tail
        _swap_with_neighbours(ring, g_tail, d_head_tail, g_head, d_tail_tail)
        return d_head_tail, d_tail_tail, None


def _key_positions(layout: RingLayout, h: int) -> Tensor:
    """Global positions of [halo_head | chunk a | halo_tail | chunk b] (negative = nothing there)."""
    c = layout.chunk_len
    a, b = layout.chunk_ids()
    ar = torch.arange(c)
    halo = torch.arange(-h, 0)
    return torch.cat([a * c + halo, a * c + ar, b * c + halo, b * c + ar])


def _docs_at(layout: RingLayout, pos: Tensor) -> Tensor:
    docs = layout.document_ids[:, pos.clamp_min(0)]
    return torch.where(pos[None, :] >= 0, docs, -1)


def _mask_tensors(layout: RingLayout, h: int, allgather: bool, device: torch.device) -> dict[str, Tensor]:
    """Per-batch mask inputs on `device`: positions and chunk segments [L], documents [B, L], for q and k."""

    def build():
        c = layout.chunk_len
        q_pos = layout.positions()
        if allgather:
            k_pos = torch.cat([layout.positions(r) for r in range(layout.cp_size)])
            k_seg = torch.full_like(k_pos, -1)  # every position appears once: any query may read it
        else:
            k_pos = _key_positions(layout, h)
            # On the last rank the tail chunk's halo repeats keys of the head chunk; each query reads only its
            # own chunk's [halo | chunk] segment so no key counts twice.
            k_seg = torch.arange(k_pos.numel()) // (h + c)
        t = dict(q_pos=q_pos, q_seg=torch.arange(2 * c) // c, k_pos=k_pos, k_seg=k_seg,
                 q_doc=_docs_at(layout, q_pos), k_doc=_docs_at(layout, k_pos))
        return {n: x.to(device) for n, x in t.items()}

    return layout.cached(("sliding_mask", h, allgather, str(device)), build)


def _masked_math(q: Tensor, k: Tensor, v: Tensor, allowed: Tensor, scale: float) -> Tensor:
    """fp32 masked attention; rows with no allowed key give 0. q [B,Lq,Hq,D], allowed [B,Lq,Lk]."""
    groups = q.shape[2] // k.shape[2]
    qf = q.float().transpose(1, 2)  # (B, Hq, Lq, D)
    kf = k.float().transpose(1, 2).repeat_interleave(groups, dim=1)
    vf = v.float().transpose(1, 2).repeat_interleave(groups, dim=1)
    s = torch.matmul(qf, kf.transpose(-1, -2)) * scale
    s = s.masked_fill(~allowed[:, None], float("-inf"))
    m = s.amax(-1, keepdim=True).detach()
    p = torch.exp(s - torch.where(torch.isinf(m), torch.zeros_like(m), m))
    o = torch.matmul(p, vf) / p.sum(-1, keepdim=True).clamp_min(1e-30)
    return o.transpose(1, 2).to(q.dtype)  # (B, Lq, Hq, D)


def window_mask_mod(m: dict[str, Tensor], window: int):
    """Flex mask_mod over local indices: same document, own chunk segment, causal, within the window."""
    q_pos, q_seg, k_pos, k_seg, q_doc, k_doc = (m[n] for n in ("q_pos", "q_seg", "k_pos", "k_seg", "q_doc", "k_doc"))

    def sliding_document_causal(b, h, qi, ki):
        gap = q_pos[qi] - k_pos[ki]
        same_doc = (q_doc[b, qi] == k_doc[b, ki]) & (q_doc[b, qi] >= 0)
        own_segment = (k_seg[ki] < 0) | (k_seg[ki] == q_seg[qi])
        return same_doc & own_segment & (gap >= 0) & (gap < window)

    sliding_document_causal.__name__ = f"sliding_document_causal_{window}"
    return sliding_document_causal


def _varlen_index(layout: RingLayout, h: int, k_pos: Tensor, allgather: bool) -> dict[str, Tensor | int]:
    """The local call as packed documents: per batch row, chunk and document, the keys a query of that chunk may
    see ([the window's h positions before the chunk | the chunk], within the document) as one varlen sequence.

    `k_idx` indexes the flattened (B * L) gathered keys; `q_idx` the flattened (B * 2C) queries, -1 where the
    sequence holds a key before the chunk (its query row is a zero and its output is dropped: the kernel takes one
    `cu_seqlens` for queries and keys). Documents are contiguous spans, so every sequence is a run of positions
    and a varlen kernel's causal window by index is the window by position."""
    c, b_rows = layout.chunk_len, layout.document_ids.shape[0]
    width = k_pos.numel()
    where = {int(p): i for i, p in enumerate(k_pos.tolist()) if p >= 0} if allgather else None
    k_idx, q_idx, lens = [], [], []
    for s, cid in enumerate(layout.chunk_ids()):
        start = cid * c
        pos = torch.arange(max(start - h, 0), start + c)
        if where is None:  # [halo | chunk] segment s of the gathered keys; the halo before position 0 is empty
            keys = s * (h + c) + h + (pos - start)
        else:
            keys = torch.tensor([where[int(p)] for p in pos])
        for b in range(b_rows):
            docs = layout.document_ids[b, pos]
            keep = docs >= 0
            kept_docs = docs[keep]
            if not kept_docs.numel():
                continue
            k_idx.append(b * width + keys[keep])
            q_idx.append(torch.where(pos[keep] >= start, b * 2 * c + s * c + pos[keep] - start, -1))
            lens.append(torch.unique_consecutive(kept_docs, return_counts=True)[1])
    if not lens:
        return {"k_idx": torch.zeros(0, dtype=torch.long), "q_idx": torch.zeros(0, dtype=torch.long),
                "cu": torch.zeros(1, dtype=torch.int32), "max_len": 0}
    lens_all = torch.cat(lens)
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lens_all.cumsum(0)]).to(torch.int32)
    return {"k_idx": torch.cat(k_idx), "q_idx": torch.cat(q_idx), "cu": cu, "max_len": int(lens_all.max())}


def _varlen_attention(q: Tensor, k: Tensor, v: Tensor, index: dict[str, Tensor | int], window: int, scale: float,
                      kernel: str) -> Tensor:
    """The local call through a registry kernel's windowed varlen attention ([B, L, H, D] in and out)."""
    b, lq, hq, d = q.shape
    out = q.new_zeros(b * lq, hq, v.shape[-1])
    if not index["max_len"]:
        return out.view(b, lq, hq, -1)
    q_idx = index["q_idx"]
    q_rows = torch.cat([q.new_zeros(1, hq, d), q.reshape(b * lq, hq, d)])[q_idx + 1]  # -1: a zero row
    k_rows, v_rows = k.reshape(-1, *k.shape[2:])[index["k_idx"]], v.reshape(-1, *v.shape[2:])[index["k_idx"]]
    o = registry.get(kernel, "windowed").windowed.varlen(q_rows, k_rows, v_rows, index["cu"], index["max_len"],
                                                         scale, window)
    real = q_idx >= 0
    return out.index_copy(0, q_idx[real], o[real].to(out.dtype)).view(b, lq, hq, -1)


def local_attention(q: Tensor, k: Tensor, v: Tensor, masks: dict[str, Tensor], window: int, scale: float,
                    backend: str, layout: RingLayout) -> Tensor:
    """One masked attention call of the local queries over the gathered keys ([B, L, H, D] in and out)."""
    mod = window_mask_mod(masks, window)
    if backend == "sdpa":
        b, lq, lk = masks["q_doc"].shape[0], q.shape[1], k.shape[1]
        qi = torch.arange(lq, device=q.device)[:, None]
        ki = torch.arange(lk, device=q.device)[None, :]
        bi = torch.arange(b, device=q.device)[:, None, None]
        return _masked_math(q, k, v, mod(bi, None, qi[None], ki[None]), scale)
    bm = layout.cached(("flex_block_mask", window, k.shape[1], str(q.device)), lambda: build_block_mask(
        mod, masks["q_doc"].shape[0], q.shape[1], k.shape[1], q.device))
    o = flex_forward(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), bm, scale)
    return o.transpose(1, 2)


def _resolve(backend: str | None, q: Tensor, stats: RingStats) -> str:
    """The local call's backend: None is the device's masked default; "auto" is FA4 where it takes this call, else
    that default, each fallback counted with its reason (as the CP=1 backend does)."""
    masked = "flex" if q.is_cuda else "sdpa"
    if backend != "auto":
        return backend or masked
    why = registry.get("fa4").why_not(q.shape[-1], q.dtype, q.device, needs=("causal", "sliding_window", "gqa", "varlen"))
    if not why:
        return "fa4"
    stats.ran(f"sliding_fa4_fallback_{why.split(':')[0]}")
    return masked


def sliding_attention(q: Tensor, k: Tensor, v: Tensor, layout: RingLayout, ring: RingGroup, scale: float,
                      window: int, backend: str | None, stats: RingStats) -> Tensor:
    """Sliding-window causal attention of this rank's [B, 2C, H, D] shard; returns [B, 2C, Hq, D]."""
    backend = _resolve(backend, q, stats)
    c, h = layout.chunk_len, window - 1
    allgather = h > c  # rank-uniform: window and chunk length are the same on every rank
    if allgather:
        from torch.distributed.nn.functional import all_gather

        kv = torch.stack([k, v])  # (2, B, 2C, H, D)
        k_ext, v_ext = torch.cat(all_gather(kv.contiguous(), group=ring.group), dim=2).unbind(0)
        stats.exchanged("sliding_allgather")
    elif h > 0:
        tails = torch.stack([k, v])  # (2, B, 2C, H, D)
        halo_head, halo_tail = _Halo.apply(tails[:, :, c - h:c], tails[:, :, 2 * c - h:], ring)
        k_ext = torch.cat([halo_head[0], k[:, :c], halo_tail[0], k[:, c:]], dim=1)
        v_ext = torch.cat([halo_head[1], v[:, :c], halo_tail[1], v[:, c:]], dim=1)
        stats.exchanged("sliding_halo")
    else:  # window 1: a token sees only itself, no halo
        k_ext, v_ext = k, v
    stats.ran(f"sliding_{backend}")
    masks = _mask_tensors(layout, h, allgather, q.device)
    if backend in VARLEN_BACKENDS:
        index = layout.cached(("sliding_varlen", h, allgather, str(q.device)), lambda: {
            n: x.to(q.device) if isinstance(x, Tensor) else x
            for n, x in _varlen_index(layout, h, masks["k_pos"].cpu(), allgather).items()})
        return _varlen_attention(q, k_ext, v_ext, index, window, scale, backend)
    return local_attention(q, k_ext, v_ext, masks, window, scale, backend, layout)
