"""Which MoE experts the decode steps read: per MoE layer, the union of expert ids a step's rows routed to.

Owns the opt-in counter behind `EngineConfig.count_routed_experts` and the MoE decode roofline's weight bytes.
A decode step's grouped expert GEMMs read only the experts some row of the batch routed to, so its ideal bytes are
the non-expert weights plus, per layer, (experts in that union) x (bytes of one expert), not every weight.

The counter is a forward hook on each MoE layer's router (HF's `router(hidden) -> (probs, top_k_weights,
top_k_index)`). It adds, on the device, each step's per-layer hit mask (an expert any real row picked) and per-expert
row counts into (layers, experts) tensors: no host sync, so it runs inside the compiled step and the captured CUDA
graphs. Padding rows of a bucket (slot 0) are left out through `rows`, which the decode step fills in place. It counts
only while the engine marks a decode step (`recording`); prefill passes through. Does not own the timing or the
KV bytes (the benchmarks), nor the routing itself (HF's router).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn


def moe_layers(model: nn.Module) -> list[tuple[int, nn.Module, nn.Module]]:
    """(layer index, router, experts) of every decoder layer with a MoE block (Gemma4's `router` + `experts`)."""
    base = getattr(model, "model", model)
    out = []
    for i, layer in enumerate(getattr(base, "layers", [])):
        router, experts = getattr(layer, "router", None), getattr(layer, "experts", None)
        if router is not None and experts is not None and getattr(layer, "enable_moe_block", True):
            out.append((i, router, experts))
    return out


def expert_bytes(experts: nn.Module) -> tuple[int, int]:
    """(number of experts, bytes of one expert's weights): the 3-D (expert, out, in) parameters, one slice each."""
    params = [p for p in experts.parameters() if p.dim() == 3]
    if not params:
        raise TypeError(f"{type(experts).__name__} keeps no 3-D (expert, out, in) weights")
    n = params[0].shape[0]
    return n, sum(p[0].numel() * p.element_size() for p in params)


@dataclass(frozen=True)
class RoutedBytes:
    """A MoE decode step's weight bytes: every weight once, and only the experts the step routed to."""

    all_weight_bytes: float
    """Every weight once (the all-weights roofline's count)."""
    all_expert_bytes: float
    """Every expert of every MoE layer."""
    routed_expert_bytes: float
    """Per layer, the mean union of routed experts per step x bytes of one expert, summed over layers."""

    @property
    def weight_bytes(self) -> float:
        """Non-expert weights + the routed experts: the MoE roofline's weight bytes per decode step."""
        return self.all_weight_bytes - self.all_expert_bytes + self.routed_expert_bytes

    @property
    def routed_fraction(self) -> float:
        """The fraction of all expert bytes a decode step read."""
        return self.routed_expert_bytes / self.all_expert_bytes


def routed_bytes(all_weight_bytes: float, experts: list[tuple[int, int]], mean_union: list[float]) -> RoutedBytes:
    """The routed weight bytes from every weight's bytes, (experts, bytes of one) per MoE layer, and each layer's
    mean union of routed experts per decode step."""
    if len(experts) != len(mean_union):
        raise ValueError(f"{len(experts)} MoE layers but {len(mean_union)} union counts")
    all_experts = sum(n * b for n, b in experts)
    routed = sum(u * b for (_, b), u in zip(experts, mean_union))
    return RoutedBytes(all_weight_bytes, all_experts, routed)


class RoutedExperts:
    """Per MoE layer: in how many decode steps each expert was routed to by a real row, and by how many rows."""

    def __init__(self, model: nn.Module, max_rows: int, device: torch.device) -> None:
        """`max_rows`: the largest decode bucket; `device`: where the counts accumulate (the model's)."""
        layers = moe_layers(model)
        if not layers:
            raise ValueError("the model has no MoE layers (router + experts) to count")
        self.layer_ids = [i for i, _, _ in layers]
        self.experts = [expert_bytes(e) for _, _, e in layers]  # (experts, bytes of one), per MoE layer
        self.num_experts = max(n for n, _ in self.experts)
        shape = (len(layers), self.num_experts)
        self.hits = torch.zeros(shape, dtype=torch.int64, device=device)  # steps in which a real row picked e
        self.rows_routed = torch.zeros(shape, dtype=torch.int64, device=device)  # real rows that picked e
        self.rows = torch.zeros(max_rows, dtype=torch.bool, device=device)  # this step's real rows; the step fills
        self.steps = 0  # decode steps counted (host-side: the engine counts its own issues)
        self.recording = False
        self._handles = [router.register_forward_hook(self._hook(j)) for j, (_, router, _) in enumerate(layers)]

    def _hook(self, j: int):
        def count_routed(module: nn.Module, args, output) -> None:
            if not self.recording:
                return
            index = output[2]  # (N, K) expert ids; N = the step's rows (one token each)
            n = index.shape[0]
            picked = torch.zeros(n, self.num_experts, dtype=torch.int64, device=index.device)
            picked = picked.scatter(1, index, 1) * self.rows[:n, None]  # (N, E), padding rows zeroed
            self.rows_routed[j] += picked.sum(0)
            self.hits[j] += picked.amax(0)
        return count_routed

    def mark_rows(self, slots: torch.Tensor) -> None:
        """Inside the decode step: which of its rows are real (slot 0 is the buckets' padding)."""
        self.rows[: slots.shape[0]].copy_(slots != 0)

    @contextmanager
    def counting(self):
        """Count the router calls made inside (the engine wraps its decode steps and their capture)."""
        self.recording = True
        try:
            yield
        finally:
            self.recording = False

    def reset(self) -> None:
        """Zero the counts (a benchmark resets after its warm-up)."""
        self.hits.zero_()
        self.rows_routed.zero_()
        self.steps = 0

    def mean_union(self) -> list[float]:
        """Per MoE layer, the mean over counted steps of how many distinct experts the step's rows routed to."""
        per_layer = self.hits.sum(1).tolist()  # a host read: call after generate
        return [u / self.steps if self.steps else 0.0 for u in per_layer]

    def routed_fraction(self) -> float:
        """The share of all expert bytes a counted decode step read, on average (a host read)."""
        return routed_bytes(0, self.experts, self.mean_union()).routed_fraction

    def summary(self, all_weight_bytes: float) -> dict:
        """The counts and the routed weight bytes per decode step, for a benchmark row (reads the device once)."""
        union = self.mean_union()
        b = routed_bytes(all_weight_bytes, self.experts, union)
        return {"decode_steps_counted": self.steps, "moe_layers": self.layer_ids, "num_experts": self.num_experts,
                "mean_union_per_layer": union,
                "mean_union": sum(union) / len(union),
                "routed_expert_fraction": b.routed_fraction, "routed_weight_bytes": b.weight_bytes,
                "all_expert_bytes": b.all_expert_bytes, "routed_expert_bytes": b.routed_expert_bytes}

    def remove(self) -> None:
        """Take the hooks off the routers."""
        for h in self._handles:
            h.remove()
        self._handles = []
