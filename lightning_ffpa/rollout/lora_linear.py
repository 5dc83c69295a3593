"""Unmerged LoRA linears for the rollout engine: y = x·W0ᵀ + (x·Aᵀ)·(s·B)ᵀ over a W0 the engine does not own.

Owns `LoraGroup`: the linears that read one input (q/k/v, gate/up; or one linear alone) over one W0 tensor of their
stacked rows, with one GEMM for W0, one for their stacked A's (x·[A_q;A_k;A_v]ᵀ) and one for their scaled B's
laid out block-diagonally, added into the W0 product (`addmm`). And `LoraLinear`, the module each member becomes.
The adapter buffers are made once in W0's dtype and device and written in place (`set_adapter`), so captured CUDA
graphs stay valid across refreshes; a member without an adapter has rank 0 there. Inside
`fused_linear.serving(groups)` the first member called computes the group's output once and every member returns
its columns (the `ProjectionGroup` protocol, so `fuse_projections` and the walker serve these groups unchanged);
outside it each member computes its own rows. A float8 W0 (`model.lora.base_dtype: fp8`) comes with its rowwise
scales and is read through `fp8_base.base_linear` (the policy's matmul path, counted), the adapters then in the
engine's dtype. Does not know where W0 or the adapters come from (`shared_weights.py`), nor attention or caches.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lightning_ffpa.fp8_base import base_linear
from lightning_ffpa.rollout.fused_linear import ProjectionGroup


def _cumulative(sizes: list[int]) -> list[tuple[int, int]]:
    out, lo = [], 0
    for n in sizes:
        out.append((lo, lo + n))
        lo += n
    return out


class LoraGroup(ProjectionGroup):
    """Linears over the row blocks of one W0 (out_total, in), each with an optional LoRA adapter of rank r_i."""

    def __init__(self, name: str, weight: torch.Tensor, bias: torch.Tensor | None, out_features: list[int],
                 ranks: list[int], scale: torch.Tensor | None = None, dtype: torch.dtype | None = None) -> None:
        """`scale`: the rowwise scales of a float8 `weight` (out_total,); `dtype`: the adapters' (default W0's)."""
        # Not ProjectionGroup.__init__: the rows are given (the policy's, already one tensor), never concatenated here.
        self.name, self.weight, self.bias = name, weight, bias  # (out_total, in), (out_total,) or None
        self.scale = scale
        self.spans = _cumulative(out_features)
        self.rank_spans = _cumulative(ranks)
        total_r = sum(ranks)
        # (R, in) stacked A's and (out_total, R) block-diagonal s*B: zeros off the blocks, so one GEMM each.
        kw = dict(dtype=dtype or weight.dtype, device=weight.device)
        self.a = torch.zeros(total_r, weight.shape[1], **kw) if total_r else None
        self.b = torch.zeros(weight.shape[0], total_r, **kw) if total_r else None
        self.members: list[LoraLinear] = []
        self.active = False
        self._input = self._output = None
        self._pending = 0
        self.num_split_inputs = 0
        self._warned = False

    @property
    def adapter_bytes(self) -> int:
        """Bytes of the A and B buffers this group owns."""
        return sum(t.numel() * t.element_size() for t in (self.a, self.b) if t is not None)

    def intact(self) -> bool:
        """Whether every member still serves from this group (a new model has new members)."""
        return all(m.group is self for m in self.members)

    @torch.no_grad()
    def set_adapter(self, index: int, a: torch.Tensor, b: torch.Tensor, scale: float) -> None:
        """Write member `index`'s A (r, in) and s*B (out, r) into the buffers, in place (graphs stay valid)."""
        (lo, hi), (rlo, rhi) = self.spans[index], self.rank_spans[index]
        self.a[rlo:rhi].copy_(a)
        self.b[lo:hi, rlo:rhi].copy_(b * scale)  # scaled in B's own (training) dtype: one rounding

    def compute(self, x: torch.Tensor) -> torch.Tensor:
        """The whole group's output for `x`: (..., out_total)."""
        x2 = x.reshape(-1, x.shape[-1])  # (N, in)
        y = self._base(x2, self.weight, self.scale, self.bias)  # (N, out_total)
        if self.a is not None:
            y = torch.addmm(y, F.linear(x2, self.a), self.b.t())  # + (x·Aᵀ)·(sB)ᵀ, (N, R) @ (R, out_total)
        return y.view(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def _base(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None,
              bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, weight, bias) if scale is None else base_linear(x, weight, scale, bias)

    def compute_member(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Member `index`'s output for `x` alone (outside the engine: HF forward, tests)."""
        if len(self.spans) == 1:  # a linear alone (o_proj, down_proj): its addmm form
            return self.compute(x)
        (lo, hi), (rlo, rhi) = self.spans[index], self.rank_spans[index]
        y = self._base(x, self.weight[lo:hi], None if self.scale is None else self.scale[lo:hi],
                       None if self.bias is None else self.bias[lo:hi])
        if rhi > rlo:
            y = y + F.linear(F.linear(x, self.a[rlo:rhi]), self.b[lo:hi, rlo:rhi])
        return y


class LoraLinear(nn.Module):
    """One member of a `LoraGroup`: what a Linear of the engine's model becomes. It holds no tensors itself."""

    def __init__(self, group: LoraGroup, index: int, in_features: int) -> None:
        super().__init__()
        self.group, self.index = group, index
        lo, hi = group.spans[index]
        self.in_features, self.out_features = in_features, hi - lo
        group.members.append(self)

    @property
    def weight(self) -> torch.Tensor:
        """This member's W0 rows (a view of the group's W0: the policy's tensor when shared)."""
        lo, hi = self.group.spans[self.index]
        return self.group.weight[lo:hi]

    @property
    def rank(self) -> int:
        """The adapter's rank (0: no adapter, W0 alone)."""
        rlo, rhi = self.group.rank_spans[self.index]
        return rhi - rlo

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.group.active:
            return self.group.take(self.index, x)
        return self.group.compute_member(self.index, x)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, rank={self.rank}"
