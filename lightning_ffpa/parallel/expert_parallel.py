"""Expert parallelism (EP) for MoE layers whose experts are 3-D stacks, as HF Gemma4 stores them.

Owns splitting each experts module's stacks, `gate_up_proj` (E, 2I, H) and `down_proj` (E, H, I), over the
expert-parallel mesh (a DTensor sharded on the expert dim: a rank's local part holds its E / ep experts; state dicts
and DCP checkpoints keep HF's names and whole shapes), and the experts' forward under EP:
1. sort the (token, expert) pairs by expert, so they are grouped by the rank that owns the expert;
2. all-to-all the pairs' hidden states to those ranks (the counts first, as split sizes);
3. run the local experts: as HF's `grouped_mm` runs them (one grouped GEMM per projection, torch's
   grouped GEMM, `experts.expert_mlp`) when the model's experts implementation is "grouped_mm", else HF's eager math, one expert
   after another (what ran is counted in the module's `expert_parallel.stats`);
4. all-to-all the results back and sum them per token with the router's weights, as HF does.
Steps 1 and 4 are `experts.sort_by_expert` and `experts.combine_by_token`, the routing of the EP=1 path: the same
sums in the same order, and gathers in both directions of the backward.
The router is HF's, unchanged and replicated (its softmax in fp32); so are the dense MLP and attention, which
FSDP2 shards over every rank (`fsdp.py`). Expert gradients: the all-to-all's backward brings each owner the
gradient from every rank's tokens; they are then summed over the expert groups holding the same experts and divided
by the world size, the average FSDP2 gives the other weights.
Also owns gradient-norm clipping over gradients on two meshes (`clip_grad_norm_by_mesh`).
Does not own the mesh (`dims.py`) nor FSDP2 (`fsdp.py`).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from lightning_ffpa._compat.torch import HAS_GROUPED_MM, all_to_all_autograd
from lightning_ffpa._compat.transformers import experts_implementation
from lightning_ffpa.errors import ConfigError
from lightning_ffpa.experts import (
    EXPERT_STACKS,
    combine_by_token,
    expert_mlp,
    inverse_permutation,
    permute_rows,
    sort_by_expert,
)
from lightning_ffpa.parallel.dims import ParallelDims

__all__ = ["EXPERT_STACKS", "clip_grad_norm_by_mesh", "find_experts", "shard_experts"]

def _is_experts(module: nn.Module) -> bool:
    stacks = [getattr(module, name, None) for name in EXPERT_STACKS]
    return all(isinstance(p, nn.Parameter) and p.ndim == 3 for p in stacks) and hasattr(module, "act_fn")


def find_experts(layers: Iterable[nn.Module]) -> list[nn.Module]:
    """The experts modules (3-D `gate_up_proj` and `down_proj`) inside `layers`, in order."""
    return [m for layer in layers for m in layer.modules() if _is_experts(m)]


def _lora_on_experts(layers: Iterable[nn.Module]) -> bool:
    """Whether peft adapts an expert stack (its `ParamWrapper` holds `parameter_name` and `base_layer`)."""
    return any(getattr(m, "parameter_name", None) in EXPERT_STACKS and hasattr(m, "base_layer")
               for layer in layers for m in layer.modules())


def shard_experts(layers: Iterable[nn.Module], dims: ParallelDims,
                  compute_dtype: torch.dtype | None = None) -> set[nn.Parameter]:
    """Split every experts module's stacks over `dims.ep_mesh` and give it the all-to-all forward; returns the
    sharded parameters (FSDP2 must leave them alone). `compute_dtype`: the dtype the experts compute in (FSDP2's
    `param_dtype`; None = as stored)."""
    layers = list(layers)
    experts = find_experts(layers)
    if not experts:
        raise ConfigError("expert_parallel_size", dims.ep, "needs a MoE model: found no experts modules (3-D "
                          "`experts.gate_up_proj` / `experts.down_proj`) in the decoder layers")
    if _lora_on_experts(layers):
        raise ConfigError("expert_parallel_size", dims.ep, "is not supported with LoRA on the expert stacks "
                          "(`lora.target_parameters`) yet")
    ep_mesh = dims.ep_mesh
    replicas = dims.expert_replicas_mesh.get_group() if dims.dp_mod_ep > 1 else None
    impl = experts_implementation(experts[0])
    path = "grouped_mm" if impl == "grouped_mm" and HAS_GROUPED_MM else "a loop over experts"
    why = " (torch has no grouped GEMM)" if impl == "grouped_mm" and not HAS_GROUPED_MM else ""
    rank_zero_info(f"expert parallelism: {len(experts)} MoE layers, {experts[0].gate_up_proj.shape[0] // dims.ep} "
                   f"experts per rank over {dims.ep} ranks; local experts run on {path}{why}")
    sharded: set[nn.Parameter] = set()
    for module in experts:
        num_experts = module.gate_up_proj.shape[0]
        if num_experts % dims.ep:
            raise ConfigError("expert_parallel_size", dims.ep, f"does not divide num_experts={num_experts}")
        for name in EXPERT_STACKS:
            module._parameters[name] = param = _shard_stack(module._parameters[name], ep_mesh)
            sharded.add(param)
        dispatch = _Dispatch(ep_mesh.get_group(), dims.ep, num_experts // dims.ep, replicas, 1.0 / dims.world_size,
                             compute_dtype)
        module.forward = functools.partial(dispatch.forward, module)  # an instance attribute: the module's call
        module.expert_parallel = dispatch  # its `stats` count what the all-to-all moved
    return sharded


def clip_grad_norm_by_mesh(parameters: Iterable[nn.Parameter], max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """`torch.nn.utils.clip_grad_norm_` for gradients that are DTensors on different meshes (the expert stacks on the
    expert-parallel mesh, the other weights on FSDP2's), where torch's own stacks every norm into one DTensor and
    fails. One norm per mesh, made whole over it, then their norm: the same global norm. Returns it."""
    groups: dict[object, list[nn.Parameter]] = {}
    for p in parameters:
        if p.grad is not None:
            groups.setdefault(getattr(p.grad, "device_mesh", None), []).append(p)
    norms = []
    for params in groups.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if not norms:
        return torch.tensor(0.0)
    total = torch.nn.utils.get_total_norm(norms, norm_type)
    for params in groups.values():
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


def _shard_stack(param: nn.Parameter, ep_mesh) -> nn.Parameter:
    """`param` (E, ...) as a DTensor sharded on dim 0 over `ep_mesh`; this rank keeps only its experts' rows."""
    per_rank = param.shape[0] // ep_mesh.size()
    start = ep_mesh.get_local_rank() * per_rank
    local = param.detach()[start:start + per_rank].clone()  # a meta tensor stays meta
    whole = DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False, shape=param.shape, stride=param.stride())
    return nn.Parameter(whole, requires_grad=param.requires_grad)


class _ScaleAndSumGrad(torch.autograd.Function):
    """Identity forward; backward scales the gradient and sums it over `group` (None: no sum)."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, group, scale: float) -> torch.Tensor:  # noqa: D102
        ctx.group, ctx.scale = group, scale
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: D102
        grad = grad * ctx.scale
        if ctx.group is not None:
            dist.all_reduce(grad, group=ctx.group)
        return grad, None, None


class _Dispatch:
    """The EP forward of one experts module: its group, its share of experts and the gradient rule."""

    def __init__(self, group, ep: int, per_rank: int, replicas, grad_scale: float,
                 compute_dtype: torch.dtype | None) -> None:
        self.group, self.ep, self.per_rank = group, ep, per_rank
        self.replicas, self.grad_scale, self.compute_dtype = replicas, grad_scale, compute_dtype
        # (token, expert) pairs this rank routed, and which local-experts path ran (`grouped_mm_unavailable`: the
        # model asked for grouped_mm on a torch without a grouped GEMM, so the loop ran)
        self.stats = {"forwards": 0, "rows_kept": 0, "rows_sent": 0, "grouped_mm": 0, "loop": 0,
                      "grouped_mm_unavailable": 0}

    def _local(self, param: nn.Parameter) -> torch.Tensor:
        weight = _ScaleAndSumGrad.apply(param.to_local(), self.replicas, self.grad_scale)
        return weight if self.compute_dtype is None else weight.to(self.compute_dtype)

    # The split sizes go to the host (`tolist`): under per-layer compile the experts run eagerly between two
    # compiled graphs rather than graph-breaking at an arbitrary point.
    @torch.compiler.disable
    def forward(self, module: nn.Module, hidden: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        """HF's experts forward (hidden (T, H), top_k_index and top_k_weights (T, K)) with tokens all-to-all'd."""
        ep, per_rank = self.ep, self.per_rank
        sent, experts_sorted, order, back = sort_by_expert(hidden, top_k_index)  # (T*K, H): by expert, so by rank
        counts = torch.bincount(experts_sorted, minlength=per_rank * ep)  # (E,)
        recv_counts = torch.empty_like(counts)  # (ep * per_rank,): from each rank, per local expert
        dist.all_to_all_single(recv_counts, counts, group=self.group)
        send_splits = counts.view(ep, per_rank).sum(1).tolist()
        mine = send_splits[dist.get_rank(self.group)]
        self.stats["forwards"] += 1
        self.stats["rows_kept"] += mine
        self.stats["rows_sent"] += sum(send_splits) - mine
        recv_counts = recv_counts.view(ep, per_rank)
        recv_splits = recv_counts.sum(1).tolist()
        got = all_to_all_autograd(sent, recv_splits, send_splits, self.group)  # (N, H): by source, then expert
        # Regroup the received rows by local expert.
        row_expert = torch.arange(per_rank, device=counts.device).repeat(ep).repeat_interleave(recv_counts.reshape(-1))
        by_expert = row_expert.argsort(stable=True)  # (N,)
        arrival = inverse_permutation(by_expert)
        gate_up, down = self._local(module.gate_up_proj), self._local(module.down_proj)
        x = permute_rows(got, by_expert, arrival)
        grouped = experts_implementation(module) == "grouped_mm"
        if grouped and not HAS_GROUPED_MM:
            self.stats["grouped_mm_unavailable"] += 1
        grouped = grouped and HAS_GROUPED_MM and x.shape[0] > 0  # no rows: nothing to multiply
        self.stats["grouped_mm" if grouped else "loop"] += 1
        per_expert = recv_counts.sum(0)
        if grouped:
            out = expert_mlp(x, gate_up, down, module.act_fn, offsets=per_expert.cumsum(0, dtype=torch.int32))
        else:
            out = expert_mlp(x, gate_up, down, module.act_fn, counts=per_expert.tolist())
        y = permute_rows(out.to(x.dtype), arrival, by_expert)  # back to arrival order
        rows = all_to_all_autograd(y, send_splits, recv_splits, self.group)  # (T*K, H) in `sent`'s order
        return combine_by_token(rows, top_k_weights, order, back, hidden.dtype)
