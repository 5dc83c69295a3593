"""Fused projections for rollouts: the Linear layers that read one input (q/k/v, gate/up) run as one GEMM.

At decode batch 64 every projection is a skinny GEMM bound by its weight bytes, and the small ones (Gemma4's
sliding k and v) stream well below the bandwidth a larger one reaches; one GEMM over the concatenated
weights streams the same bytes faster and launches fewer kernels (docs/performance.md).

Owns: `fuse_projections`, which moves each group's weights into one buffer, and the `SlicedLinear` layers
that serve their rows of it. The Parameters keep their names and identities: their `.data` becomes a row
view of the buffer, so in-place writes (the LoRA refresh, an optimizer step) land in the fused weight and
captured CUDA graphs stay valid. Outside `serving(groups)` a `SlicedLinear` is a plain
`nn.Linear` (HF's own forward, training, `generate` run unchanged); inside it, the first member called on an
input computes the group's GEMM and every member returns its columns of that output. `lora_linear.LoraGroup`
serves the shared engine's groups (the policy's W0 plus unmerged adapters) through the same protocol, and
Parameters marked `SHARED_MARK` (the policy's own) are never moved into a buffer here. It does not know about
attention, caches or the decode step.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

SHARED_MARK = "_lightning_ffpa_shared"  # on Parameters the engine reads from the policy: never moved or copied here
# Groups looked for under each decoder layer: (submodule, Linear names that read the same input).
GROUPS = (("self_attn", ("q_proj", "k_proj", "v_proj")), ("mlp", ("gate_proj", "up_proj")))


class ProjectionGroup:
    """Linears that read the same input, stored as row blocks of one weight (out_total, in)."""

    def __init__(self, linears: list[nn.Linear], name: str = "") -> None:
        self.name, self.members = name, linears
        self.weight = torch.cat([lin.weight.detach() for lin in linears])  # (sum of out, in)
        has_bias = linears[0].bias is not None
        self.bias = torch.cat([lin.bias.detach() for lin in linears]) if has_bias else None
        self.spans: list[tuple[int, int]] = []
        lo = 0
        for i, lin in enumerate(linears):
            hi = lo + lin.out_features
            self.spans.append((lo, hi))
            with torch.no_grad():
                lin.weight.data = self.weight[lo:hi]  # same Parameter object, now a view of the buffer
                if has_bias:
                    lin.bias.data = self.bias[lo:hi]
            lin.__class__ = SlicedLinear  # same object, hooks and state-dict keys; only `forward` differs
            lin.group, lin.index = self, i
            lo = hi
        self.active = False
        self._input: torch.Tensor | None = None
        self._output: torch.Tensor | None = None
        self._pending = 0
        self.num_split_inputs = 0  # members called on different inputs: the GEMM ran more than once per forward
        self._warned = False

    @property
    def num_members(self) -> int:
        return len(self.spans)

    def intact(self) -> bool:
        """Whether every member's weight (and bias) is still its row block of the buffer: `.to()`, a deepcopy
        or `load_state_dict(assign=True)` after fusing give members new tensors the fused GEMM would not read."""
        for lin, (lo, _) in zip(self.members, self.spans):
            pairs = [(lin.weight, self.weight)] + ([(lin.bias, self.bias)] if self.bias is not None else [])
            for p, buf in pairs:
                row_block = buf.data_ptr() + lo * buf.stride(0) * buf.element_size()
                if p.dtype != buf.dtype or p.device != buf.device or p.data_ptr() != row_block:
                    return False
        return True

    def compute(self, x: torch.Tensor) -> torch.Tensor:
        """The whole group's output for `x`: (..., sum of out)."""
        return F.linear(x, self.weight, self.bias)

    def take(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Member `index`'s output for `x`: its columns of the group's GEMM, computed once per input."""
        if self._input is not x:
            if self._pending:
                self.num_split_inputs += 1
            self._input, self._output, self._pending = x, self.compute(x), self.num_members
        lo, hi = self.spans[index]
        out = self._output[..., lo:hi]
        self._pending -= 1
        if self._pending == 0:  # every member has its columns: drop the output now, not at the next input
            self.release()
        return out

    def release(self) -> None:
        """Forget the held input and output (a member that was never called would otherwise keep them)."""
        self._input = self._output = None
        self._pending = 0


class SlicedLinear(nn.Linear):
    """An `nn.Linear` whose weight is a row block of its group's buffer (made by class swap, never built)."""

    group: ProjectionGroup
    index: int

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.group.active:
            return self.group.take(self.index, x)
        return super().forward(x)


def _fusable(linears: list[nn.Module]) -> str | None:
    """Why these modules cannot share one GEMM, or None when they can."""
    if any(type(m) not in (nn.Linear, SlicedLinear) for m in linears):
        return "not plain nn.Linear (adapter layers: fuse the merged inference copy instead)"
    weights = [m.weight for m in linears]
    if any(getattr(w, SHARED_MARK, False) for w in weights):
        return "weights are the policy's own (shared_weights.py): fusing them here would copy them"
    if any(type(w.data) is not torch.Tensor for w in weights):
        return "weights are not plain tensors (sharded or subclassed)"
    if len({(w.dtype, w.device, w.shape[1]) for w in weights}) > 1:
        return "members differ in dtype, device or input width"
    if len({m.bias is None for m in linears}) > 1:
        return "some members have a bias and some do not"
    return None


def fuse_projections(layers: nn.ModuleList) -> tuple[list[ProjectionGroup], list[str]]:
    """Fuse every group in `GROUPS` under each layer; returns (groups, why any group was left separate).

    Idempotent: layers fused before keep their groups (a second engine on the same model reuses them).
    """
    groups: list[ProjectionGroup] = []
    skipped: list[str] = []
    for i, layer in enumerate(layers):
        for parent_name, names in GROUPS:
            parent = getattr(layer, parent_name, None)
            members = [getattr(parent, n, None) for n in names] if parent is not None else []
            members = [m for m in members if m is not None]
            if len(members) < 2:
                continue  # e.g. Gemma4's KV-shared layers have only q_proj
            group = getattr(members[0], "group", None)
            if group is not None and group.members == members and group.intact():
                groups.append(group)
                continue
            why = _fusable(members)
            if why is not None:
                skipped.append(f"layers.{i}.{parent_name}: {why}")
                continue
            groups.append(ProjectionGroup(members, f"layers.{i}.{parent_name}"))
    return groups, skipped


@contextmanager
def serving(groups: list[ProjectionGroup]) -> Iterator[None]:
    """Inside: every fused member returns its slice of its group's one GEMM."""
    broken = next((g for g in groups if not g.intact()), None)
    if broken is not None:
        raise RuntimeError(f"fused projections of {broken.name}: a member's weight is no longer its block of the "
                           "fused buffer (moved by `.to()`, copied, or loaded with `assign=True` after the engine "
                           "fused it); build the engine again on the model as it is now")
    for g in groups:
        g.active = True
    try:
        yield
    finally:
        for g in groups:
            g.active = False
            g.release()
            if g.num_split_inputs and not g._warned:
                g._warned = True
                log.warning("fused projections of %s: members were called on different inputs %d times, so the "
                            "group's GEMM ran more than once per forward (slower than unfused); set "
                            "`fuse_projections: false` for this model", g.name, g.num_split_inputs)
