"""The registry's "reference" kernel: CPU references of the FFPA op contract and of flex's contract.

- The FFPA op contract in fp32 math, registered as torch custom ops. Being custom ops
  (``torch.ops.lightning_ffpa.ref_*``), they show up in SAC policies and flop counters the same way the FFPA
  CuTeDSL ops do, so CPU tests run the exact dispatch code. The contract itself (layouts, bottom-right
  causality, lse, rows with no visible key) is documented in ``kernels.py``, which owns choosing between these
  and the GPU kernels.
- ``dense_reference``: flex_attention's contract through a dense mask and SDPA (the rollout engine's
  ``attention="dense"``, a fast path for tiny CPU runs).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

from lightning_ffpa.attention import registry


def _scores(q: Tensor, k: Tensor, scale: float, causal: bool, window: int | None = None) -> Tensor:
    """fp32 scores [B,Hq,Sq,Sk] with GQA broadcast and bottom-right causal masking (and, with `window`, a query
    sees only the `window` keys ending at its own position)."""
    groups = q.shape[2] // k.shape[2]
    qf = q.float().transpose(1, 2)  # (B, Hq, Sq, D)
    kf = k.float().transpose(1, 2).repeat_interleave(groups, dim=1)  # (B, Hq, Sk, D)
    s = torch.matmul(qf, kf.transpose(-1, -2)) * scale
    if causal:
        sq, sk = q.shape[1], k.shape[1]
        rows = torch.arange(sq, device=q.device)[:, None] + (sk - sq)
        cols = torch.arange(sk, device=q.device)[None, :]
        hidden = cols > rows
        if window is not None:
            hidden = hidden | (cols <= rows - window)
        s = s.masked_fill(hidden, float("-inf"))
    return s


def _probs(s: Tensor, lse: Tensor) -> Tensor:
    # A row with no visible key has lse = -inf; exp(-inf - 0) = 0 keeps it at zero instead of NaN.
    return torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])


def _ref_fwd_math(q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool,
                  window: int | None = None) -> tuple[Tensor, Tensor]:
    groups = q.shape[2] // k.shape[2]
    s = _scores(q, k, scale, causal, window)
    lse = torch.logsumexp(s, dim=-1)  # (B, Hq, Sq)
    vf = v.float().transpose(1, 2).repeat_interleave(groups, dim=1)
    o = torch.matmul(_probs(s, lse), vf).transpose(1, 2)  # (B, Sq, Hq, D)
    return o.to(q.dtype).contiguous(), lse.contiguous()


def _ref_bwd_math(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, scale: float,
                  causal: bool, window: int | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients from the given (possibly globally merged) o and lse, as the kernels compute them."""
    b, sk, hkv, d = k.shape
    groups = q.shape[2] // hkv
    p = _probs(_scores(q, k, scale, causal, window), lse.float())  # (B, Hq, Sq, Sk)
    dof = do.float().transpose(1, 2)  # (B, Hq, Sq, D)
    vf = v.float().transpose(1, 2).repeat_interleave(groups, dim=1)
    delta = (dof * o.float().transpose(1, 2)).sum(-1, keepdim=True)
    ds = p * (torch.matmul(dof, vf.transpose(-1, -2)) - delta)
    kf = k.float().transpose(1, 2).repeat_interleave(groups, dim=1)
    dq = torch.matmul(ds, kf) * scale
    dk = (torch.matmul(ds.transpose(-1, -2), q.float().transpose(1, 2)) * scale).view(b, hkv, groups, sk, d).sum(2)
    dv = torch.matmul(p.transpose(-1, -2), dof).view(b, hkv, groups, sk, -1).sum(2)
    return (dq.transpose(1, 2).to(q.dtype).contiguous(), dk.transpose(1, 2).to(k.dtype).contiguous(),
            dv.transpose(1, 2).to(v.dtype).contiguous())


def _segments(cu_q: Tensor, cu_k: Tensor) -> list[tuple[int, int, int, int]]:
    q, k = cu_q.tolist(), cu_k.tolist()
    return [(q[i], q[i + 1], k[i], k[i + 1]) for i in range(len(q) - 1)]


@torch.library.custom_op("lightning_ffpa::ref_dense_fwd", mutates_args=())
def ref_dense_fwd(q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool) -> tuple[Tensor, Tensor]:
    """Reference dense forward (fp32 math): (o [B,Sq,Hq,D], lse [B,Hq,Sq])."""
    return _ref_fwd_math(q, k, v, scale, causal)


@ref_dense_fwd.register_fake
def _(q, k, v, scale, causal):
    b, sq, hq, _ = q.shape
    return q.new_empty(b, sq, hq, v.shape[-1]), q.new_empty(b, hq, sq, dtype=torch.float32)


@torch.library.custom_op("lightning_ffpa::ref_dense_bwd", mutates_args=())
def ref_dense_bwd(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, scale: float,
                  causal: bool) -> tuple[Tensor, Tensor, Tensor]:
    """Reference dense backward (fp32 math): (dq, dk, dv), dk/dv with Hkv heads."""
    return _ref_bwd_math(do, q, k, v, o, lse, scale, causal)


@ref_dense_bwd.register_fake
def _(do, q, k, v, o, lse, scale, causal):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


@torch.library.custom_op("lightning_ffpa::ref_varlen_fwd", mutates_args=())
def ref_varlen_fwd(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
                   max_seqlen_k: int, scale: float, causal: bool) -> tuple[Tensor, Tensor]:
    """Reference varlen forward (fp32 math, one segment at a time): (o [Tq,Hq,D], lse [Hq,Tq])."""
    o = q.new_zeros(q.shape[0], q.shape[1], v.shape[-1])
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float32, device=q.device)
    for q0, q1, k0, k1 in _segments(cu_seqlens_q, cu_seqlens_k):
        if q1 > q0 and k1 > k0:
            o_i, lse_i = _ref_fwd_math(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], scale, causal)
            o[q0:q1], lse[:, q0:q1] = o_i[0], lse_i[0]
    return o, lse


@ref_varlen_fwd.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, causal):
    return q.new_empty(q.shape[0], q.shape[1], v.shape[-1]), q.new_empty(q.shape[1], q.shape[0], dtype=torch.float32)


@torch.library.custom_op("lightning_ffpa::ref_varlen_bwd", mutates_args=())
def ref_varlen_bwd(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, cu_seqlens_q: Tensor,
                   cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int, scale: float,
                   causal: bool) -> tuple[Tensor, Tensor, Tensor]:
    """Reference varlen backward (fp32 math): (dq, dk, dv) in THD layout."""
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for q0, q1, k0, k1 in _segments(cu_seqlens_q, cu_seqlens_k):
        if q1 > q0 and k1 > k0:
            g = _ref_bwd_math(do[None, q0:q1], q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], o[None, q0:q1],
                              lse[None, :, q0:q1], scale, causal)
            dq[q0:q1], dk[k0:k1], dv[k0:k1] = g[0][0], g[1][0], g[2][0]
    return dq, dk, dv


@ref_varlen_bwd.register_fake
def _(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, causal):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def dense_reference(query: Tensor, key: Tensor, value: Tensor, score_mod=None, block_mask: BlockMask | None = None,
                    scale: float | None = None, enable_gqa: bool = False, kernel_options: dict | None = None) -> Tensor:
    """Same contract as `flex_attention` via a dense mask from `block_mask.mask_mod` and SDPA.

    A CPU reference path (selected by `EngineConfig.attention="dense"`): it skips flex's vmapped eager
    path, which dominates tiny CPU runs. Fully masked rows return zeros, like flex.
    """
    if score_mod is not None:
        raise NotImplementedError("dense_reference has no score_mod; use attention='flex'")
    B, _, Q, _ = query.shape
    KV = key.shape[-2]
    dev = query.device
    b = torch.arange(B, device=dev).view(B, 1, 1, 1)
    h = torch.zeros(1, 1, 1, 1, dtype=torch.long, device=dev)
    q = torch.arange(Q, device=dev).view(1, 1, Q, 1)
    kv = torch.arange(KV, device=dev).view(1, 1, 1, KV)
    mask = block_mask.mask_mod(b, h, q, kv).expand(B, 1, Q, KV)  # mask mods broadcast like flex's vmap
    key, value = key.expand(B, *key.shape[1:]), value.expand(B, *value.shape[1:])
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale,
                                                           enable_gqa=enable_gqa)
    return torch.where(mask.any(-1, keepdim=True), out, torch.zeros((), dtype=out.dtype, device=dev))


CONTRACT = registry.Contract(torch.ops.lightning_ffpa.ref_dense_fwd, torch.ops.lightning_ffpa.ref_dense_bwd,
                             torch.ops.lightning_ffpa.ref_varlen_fwd, torch.ops.lightning_ffpa.ref_varlen_bwd)

registry.register(registry.Kernel(
    name="reference", head_dims=(1, 2**16), features=frozenset({"causal", "gqa", "varlen", "lse",
                                                                "merged_lse_backward", "block_mask"}),
    contract=CONTRACT, block_ops="contract",
    forward_ops=lambda: (torch.ops.lightning_ffpa.ref_dense_fwd.default, torch.ops.lightning_ffpa.ref_varlen_fwd.default),
    masked=lambda compiled: (dense_reference, "dense_reference"),
    doc="fp32 math on any device: the CPU stand-in of each contract, for tests and tiny runs"))
