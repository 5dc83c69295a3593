"""Ring context parallelism for Gemma4 attention: FFPA blocks for full layers, a halo + Flex for sliding ones.

Owns: the ``"ffpa_ring"`` Hugging Face attention function, the ring autograd Function (K/V chunks travel around
the CP group with P2P, partial results merge by log-sum-exp, dK/dV travel back to their owners in backward),
and ``install_ring``. Does not own: batch sharding / loss (``sharding.py``, ``loss.py``), the process group
(``group.py``), the per-step block plan (``plan.py``), the sliding-window halo (``sliding.py``), or the kernels
(``lightning_ffpa.attention.kernels``).

Interface::

    ring = install_ring(model, cp_mesh_or_group)   # called by the attention Callback when CP > 1
    shard = shard_batch(batch, cp_rank, cp_size)   # see cp/sharding.py
    model(input_ids=shard["input_ids"], position_ids=shard["position_ids"], ring_layout=shard["ring_layout"])
    ring.stats                                     # counts of blocks, K/V shifts, sliding paths (cp/stats.py)

The ``ring_layout`` kwarg reaches the attention function because HF passes model-forward kwargs down through
the decoder layers to ``attention_interface(**kwargs)``; a call without it raises (no silent plain-causal mask,
which would let packed documents attend to each other). Every collective is issued by every CP rank in the
same order whatever its data (an all-padding shard runs the same ring and returns zeros).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_ffpa import saved_ops
from lightning_ffpa._compat import transformers as hf_compat
from lightning_ffpa.attention import backend, kernels, registry
from lightning_ffpa.cp.group import RingGroup, cp_group_info
from lightning_ffpa.cp.layout import RingLayout
from lightning_ffpa.cp.plan import Block, ring_plan
from lightning_ffpa.cp.sliding import BACKENDS, sliding_attention
from lightning_ffpa.cp.stats import RingStats

ATTN_NAME = "ffpa_ring"


def _wait(works: list) -> None:
    for w in works:
        w.wait()


def _pack(*ts: Tensor) -> Tensor:
    return torch.cat([t.reshape(-1) for t in ts])


def _unpack(buf: Tensor, like: Tensor, n: int) -> list[Tensor]:
    return list(buf.view(n, *like.shape).unbind(0))


class BlockOps:
    """Per-block attention calls on [B, L, H, D] tensors through a registry kernel's op contract."""

    def __init__(self, contract: registry.Contract = kernels.CONTRACT):
        """`contract`: the kernel's dense/varlen forward and merged-lse backward (default: FFPA, reference on CPU)."""
        self.contract = contract

    def fwd(self, blk: Block, q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor]:
        """(o [B,Lq,Hq,D], lse [B,Hq,Lq]) of one block."""
        if blk.kind == "dense":
            return self.contract.dense_fwd(q, k, v, scale, blk.causal)
        b, lq, hq, d = q.shape
        qf, kf, vf = self._flat(blk, q, k, v)
        o, lse = self.contract.varlen_fwd(qf, kf, vf, blk.cu_q, blk.cu_k, blk.max_q, blk.max_k, scale, blk.causal)
        return o.view(b, lq, hq, -1), lse.view(hq, b, lq).transpose(0, 1)

    def bwd(self, blk: Block, do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor,
            scale: float) -> tuple[Tensor, Tensor, Tensor]:
        """(dq, dk, dv) of one block from the merged (global) o and lse."""
        if blk.kind == "dense":
            return self.contract.dense_bwd(do, q, k, v, o, lse, scale, blk.causal)
        b, lq, hq, d = q.shape
        qf, kf, vf = self._flat(blk, q, k, v)
        lse_f = lse.transpose(0, 1).reshape(hq, b * lq).contiguous()
        dq, dk, dv = self.contract.varlen_bwd(do.reshape(b * lq, hq, -1), qf, kf, vf, o.reshape(b * lq, hq, -1),
                                              lse_f, blk.cu_q, blk.cu_k, blk.max_q, blk.max_k, scale, blk.causal)
        dq = dq.view(b, lq, hq, d)
        if blk.k_index is not None:  # scatter gathered key rows back to their places
            full = lambda g: torch.zeros(k.shape[0] * k.shape[1], *g.shape[1:], dtype=g.dtype,  # noqa: E731
                                         device=g.device).index_add_(0, blk.k_index, g)
            dk, dv = full(dk), full(dv)
        return dq, dk.view(k.shape), dv.view(v.shape)

    @staticmethod
    def _flat(blk: Block, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        qf = q.reshape(-1, *q.shape[2:])
        kf, vf = k.reshape(-1, *k.shape[2:]), v.reshape(-1, *v.shape[2:])
        if blk.k_index is not None:
            kf, vf = kf.index_select(0, blk.k_index), vf.index_select(0, blk.k_index)
        return qf, kf, vf


def ring_block_ops(kernel: registry.Kernel) -> Any:
    """The ring's block ops for a registry entry, as its `block_ops` names them."""
    if kernel.block_ops == "flex":
        from lightning_ffpa.cp.flex_blocks import FlexBlockOps

        return FlexBlockOps()
    return BlockOps(kernel.contract)


def merge_lse(out: Tensor, lse: Tensor, o_blk: Tensor, lse_blk: Tensor, q0: int, q1: int) -> None:
    """Online-softmax merge of a block's (o, lse) into fp32 (out [B,L,H,D], lse [B,H,L]) rows [q0, q1)."""
    old = lse[:, :, q0:q1]
    new = torch.logaddexp(old, lse_blk)
    ref = torch.where(torch.isinf(new), torch.zeros_like(new), new)  # rows nobody sees stay 0 / -inf
    w_old = torch.exp(old - ref).transpose(1, 2).unsqueeze(-1)  # (B, Lq, H, 1)
    w_new = torch.exp(lse_blk - ref).transpose(1, 2).unsqueeze(-1)
    out[:, q0:q1] = out[:, q0:q1] * w_old + o_blk.float() * w_new
    lse[:, :, q0:q1] = new


class _RingAttention(torch.autograd.Function):
    """Full-attention ring over the CP group: q, k, v are this rank's [B, 2C, H, D] shards."""

    @staticmethod
    def forward(ctx, q, k, v, ring: RingGroup, plan: list[list[Block]], scale: float, ops: BlockOps):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        b, length, hq, d = q.shape
        out = torch.zeros(b, length, hq, v.shape[-1], dtype=torch.float32, device=q.device)
        lse = torch.full((b, hq, length), float("-inf"), dtype=torch.float32, device=q.device)
        buf = _pack(k, v)
        touched = torch.zeros(length, dtype=torch.bool)  # host-side: rows some block already wrote
        for step in range(ring.size):
            works = []
            if step < ring.size - 1:  # prefetch the next K/V while this step computes
                nxt, works = ring.shift(buf, tag=step)
            k_i, v_i = _unpack(buf, k, 2)
            for blk in plan[step]:
                if blk.kind == "empty":
                    continue
                o_b, lse_b = ops.fwd(blk, q[:, blk.q0:blk.q1], k_i[:, blk.k0:blk.k1], v_i[:, blk.k0:blk.k1], scale)
                if touched[blk.q0:blk.q1].any():
                    merge_lse(out, lse, o_b, lse_b, blk.q0, blk.q1)
                else:  # first block for these rows: nothing to merge with
                    out[:, blk.q0:blk.q1], lse[:, :, blk.q0:blk.q1] = o_b, lse_b
                    touched[blk.q0:blk.q1] = True
            if works:
                _wait(works)
                buf = nxt
        o = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.ring, ctx.plan, ctx.scale, ctx.ops = ring, plan, scale, ops
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        ring, plan, scale, ops = ctx.ring, ctx.plan, ctx.scale, ctx.ops
        do = do.contiguous()
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        # dK/dV accumulators travel with the K/V they belong to; after `size` hops they are home.
        dkv = torch.zeros((2, *k.shape), dtype=torch.float32, device=k.device)
        buf = _pack(k, v)
        for step in range(ring.size):
            works = []
            if step < ring.size - 1:
                nxt, works = ring.shift(buf, tag=step)
            k_i, v_i = _unpack(buf, k, 2)
            for blk in plan[step]:
                if blk.kind == "empty":
                    continue
                sl = slice(blk.q0, blk.q1)
                g = ops.bwd(blk, do[:, sl], q[:, sl], k_i[:, blk.k0:blk.k1], v_i[:, blk.k0:blk.k1], o[:, sl],
                            lse[:, :, sl].contiguous(), scale)
                dq[:, sl] += g[0].float()
                dkv[0][:, blk.k0:blk.k1] += g[1].float()
                dkv[1][:, blk.k0:blk.k1] += g[2].float()
            dkv_next, dworks = ring.shift(dkv, tag=ring.size + step)
            _wait(dworks)
            dkv = dkv_next
            if works:
                _wait(works)
                buf = nxt
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None


class RingAttention:
    """The installed ring: process group, block ops and counters (what ran, per block kind and path)."""

    def __init__(self, group: dist.ProcessGroup | None, block_ops: str = "ffpa",
                 sliding_backend: str | None = None):
        """`block_ops`: a registry kernel with ring block ops: "ffpa" (CuTeDSL on GPU, reference on CPU), "flex"
        (the baseline, CUDA) or "reference"."""
        self.ring = RingGroup(group)
        self.block_ops = block_ops
        self.ops = ring_block_ops(registry.get(block_ops, "block_ops", option="block_ops"))
        if sliding_backend is not None and sliding_backend not in BACKENDS:
            raise ValueError(f"`sliding_backend={sliding_backend!r}`: expected None or one of {list(BACKENDS)}")
        self.sliding_backend = sliding_backend  # None: "flex" on CUDA, "sdpa" (masked math) on CPU
        self.stats = RingStats()  # forward counts; a checkpoint recompute's exchanges as `recompute_<key>`

    def full(self, q: Tensor, k: Tensor, v: Tensor, layout: RingLayout, scale: float) -> Tensor:
        """Causal full attention over the ring; q/k/v [B, 2C, H, D] local shards -> o [B, 2C, Hq, D]."""
        self._check(layout, q)
        if self.block_ops == "ffpa":  # counted and warned once where its blocks leave CuTeDSL, as at CP = 1
            backend.note_ring_fallback(q)
        plan = ring_plan(layout, q.device)
        for steps in plan:
            for blk in steps:
                self.stats.ran(f"block_{blk.kind}")
        self.stats.exchanged("shift", self.ring.size - 1)  # K/V hops of this forward (or of its recompute)
        return _RingAttention.apply(q, k, v, self.ring, plan, float(scale), self.ops)

    def sliding(self, q: Tensor, k: Tensor, v: Tensor, layout: RingLayout, scale: float, window: int) -> Tensor:
        """Causal sliding-window attention (q - k < window) over the shards, via neighbour halos."""
        self._check(layout, q)
        return sliding_attention(q, k, v, layout, self.ring, scale, window, self.sliding_backend, self.stats)

    def _check(self, layout: RingLayout, q: Tensor) -> None:
        if (layout.cp_rank, layout.cp_size) != (self.ring.rank, self.ring.size):
            raise ValueError(f"ring_layout is for cp rank {layout.cp_rank}/{layout.cp_size} but this process is "
                             f"rank {self.ring.rank}/{self.ring.size} of the ring's group")
        if q.shape[1] != 2 * layout.chunk_len or q.shape[0] != layout.document_ids.shape[0]:
            raise ValueError(f"local q of shape {tuple(q.shape)} does not match ring_layout "
                             f"(B={layout.document_ids.shape[0]}, 2C={2 * layout.chunk_len})")


def ring_attention_forward(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor,
                           attention_mask: Tensor | None, scaling: float | None = None,
                           sliding_window: int | None = None, ring_layout: RingLayout | None = None,
                           **kwargs: Any) -> tuple[Tensor, None]:
    """HF attention function "ffpa_ring": q/k/v [B, H, S_local, D] -> ([B, S_local, Hq, D], None)."""
    ring: RingAttention | None = getattr(module, "_ffpa_ring", None)
    if ring is None:
        raise RuntimeError(f"attn_implementation={ATTN_NAME!r} but this module has no ring; call install_ring(model, group)")
    if ring_layout is None:
        raise ValueError("ring attention needs `ring_layout=` in the model forward (from shard_batch); without it "
                         "packed documents and padding cannot be masked across shards")
    if attention_mask is not None:
        raise ValueError("ring attention takes padding and documents from ring_layout; pass no attention_mask")
    if not getattr(module, "is_causal", True):
        raise NotImplementedError("ring attention supports causal layers only")
    if kwargs.get("dropout", 0.0):
        raise NotImplementedError(f"ring attention has no attention dropout (got dropout={kwargs['dropout']})")
    scale = module.scaling if scaling is None else scaling
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # (B, S, H, D)
    if sliding_window:
        out = ring.sliding(q, k, v, ring_layout, scale, int(sliding_window))
    else:
        out = ring.full(q, k, v, ring_layout, scale)
    return out, None


def no_hf_mask(*args: Any, **kwargs: Any) -> None:
    """HF mask function for "ffpa_ring": no mask (the ring masks from ring_layout)."""
    return None


def _attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if hasattr(m, "is_causal") and hasattr(m, "layer_idx")
            and hasattr(m, "scaling") and hasattr(m, "head_dim")]


def install_ring(model: torch.nn.Module, cp_mesh_or_group: Any, block_ops: str = "ffpa",
                 sliding_backend: str | None = None) -> RingAttention:
    """Route every attention layer of `model` through the ring over the CP group (a 1-D DeviceMesh or a group).

    `block_ops` picks the full-layer block kernel ("ffpa", or "flex" as a baseline); `sliding_backend` the
    sliding-layer path ("flex"/"sdpa"/"fa4"/"auto"; None: by device). Returns the handle whose `stats` count what
    ran.
    """
    group = cp_group_info(cp_mesh_or_group)[0]
    modules = _attention_modules(model)
    if not modules:
        raise ValueError(f"install_ring found no attention modules in {type(model).__name__}")
    for m in modules:
        if not m.is_causal:
            raise NotImplementedError(f"ring attention supports causal layers only (layer {m.layer_idx} is not)")
    handle = RingAttention(group, block_ops=block_ops, sliding_backend=sliding_backend)
    saved_ops.register(kernels.forward_ops())  # for layers wrapped by SAC after this call
    if sliding_backend in ("fa4", "auto"):
        saved_ops.register(registry.get("fa4").forward_ops())  # FA4's forward is must-save as FFPA's is
    hf_compat.register_attention(ATTN_NAME, ring_attention_forward)
    # The mask function returns None for every layer on purpose: the ring builds document/causal/window masks
    # from ring_layout itself, and HF builds no (sequence-local, hence wrong) masks.
    hf_compat.register_mask(ATTN_NAME, no_hf_mask)
    for m in modules:
        m._ffpa_ring = handle  # plain attribute: the handle is not a submodule and holds no parameters
    # Attention layers read their own `config` (the text config); the model's config may be a wrapper around
    # it (multimodal) or absent (a LightningModule was passed): set every distinct one.
    configs = {id(c): c for c in [getattr(model, "config", None), *(getattr(m, "config", None) for m in modules)]
               if c is not None}
    for cfg in configs.values():
        hf_compat.set_config_attn_implementation(cfg, ATTN_NAME)
    return handle
