"""The MoE experts' math, and LoRA on the expert stacks applied unmerged inside it (`lora.expert_adapters`).

Owns `expert_mlp` (rows grouped by expert through gate_up (E, 2I, H), act(gate) * up and down (E, H, I): one grouped
GEMM per projection, or a loop over experts; optional low-rank terms), the experts forward that routes a layer's
tokens to it the way HF's `grouped_mm` experts do, and `unmerge_expert_adapters`, which points peft's
expert-stack adapters at that forward; `StackAdapter` and `serve_adapters` let the rollout engine run the same
forward over the policy's stacks with adapter buffers of its own.

Why: peft's `target_parameters` adapts a 3-D stack by folding, W + s * B @ A for all E experts, on every forward
(a tensor the size of the stack, 1.5 GB a layer at the 26B-A4B shapes), and its backward computes the gradient of
that whole stack though W is frozen. Unmerged, each projection is
    y = x @ W_e^T + s * (x @ A_e^T) @ B_e^T
over the rows routed to expert e: two grouped GEMMs of rank r beside the base one, nothing the size of the stack,
and no gradient for W. The parameters stay peft's (names, checkpoints, export and the rollout refresh read them as
before). What ran is counted (`counters`, group "expert_lora": `grouped_mm` or `loop` forwards). Also owns the routing
(`sort_by_expert`, `combine_by_token`): rows move to and from expert order by gathers in both directions, so the
backward has no scatter with atomics, and each token's K rows are summed in a fixed order.
Does not own which parameters are adapted (`lora.py`) nor expert parallelism (`parallel/expert_parallel.py`,
which uses `expert_mlp` and the routing for its local experts and refuses expert LoRA).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lightning_ffpa._compat.torch import grouped_mm, grouped_mm_runs
from lightning_ffpa._compat.transformers import experts_implementation
from lightning_ffpa.attention import counters
from lightning_ffpa.errors import ConfigError

__all__ = ["EXPERT_STACKS", "COUNTER", "StackAdapter", "combine_by_token", "expert_mlp", "inverse_permutation",
           "path_counts", "peft_stack_factors", "permute_rows", "serve_adapters", "sort_by_expert",
           "unmerge_expert_adapters", "unsupported"]

EXPERT_STACKS = ("gate_up_proj", "down_proj")  # HF's names of the 3-D expert weights
COUNTER = "expert_lora"
_ALIGN = 8  # grouped GEMMs need 16-byte rows: a bf16 rank is padded to a multiple of 8 (zeros: the same product)

Adapter = tuple[torch.Tensor, torch.Tensor, float]  # A (E, r, in), B (E, r, out) row-major, scaling


def _project(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor | None, counts: list[int] | None,
             adapter: Adapter | None) -> torch.Tensor:
    """x (N, in) grouped by expert through `weight` (E, out, in), plus s * (x A_e^T) B_e when `adapter` is given."""
    if offsets is not None:
        y = grouped_mm(x, weight.transpose(-2, -1), offsets)
        if adapter is not None:
            a, b, s = adapter
            y = y + s * grouped_mm(grouped_mm(x, a.transpose(-2, -1), offsets), b, offsets)
        return y
    outs = []
    for e, rows in enumerate(x.split(counts)):
        y = F.linear(rows, weight[e])
        if adapter is not None:
            a, b, s = adapter
            y = y + s * (rows @ a[e].t()) @ b[e]
        outs.append(y)
    return torch.cat(outs)


def expert_mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, act_fn, *,
               offsets: torch.Tensor | None = None, counts: list[int] | None = None,
               adapters: dict[str, Adapter] | None = None) -> torch.Tensor:
    """Rows `x` (N, H), grouped by expert, through their experts. `offsets` (E,) int32 ends of the groups: one grouped
    GEMM per projection; else `counts` (E,) rows per expert: a loop. `adapters`: {stack name: (A, B, scaling)}."""
    adapters = adapters or {}
    x = x.to(gate_up.dtype)
    gate, up = _project(x, gate_up, offsets, counts, adapters.get("gate_up_proj")).chunk(2, dim=-1)
    return _project(act_fn(gate) * up, down, offsets, counts, adapters.get("down_proj"))


def peft_stack_factors(a: torch.Tensor, b: torch.Tensor, experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """peft's factors of an expert stack, A (r * E, in) with expert e's rows at [e*r, (e+1)*r) and B (out, r * E)
    with its columns at e, e + E, ..., as per-expert views A (E, r, in) and B (E, r, out) (also `lora.merged_weight`'s)."""
    return a.reshape(experts, -1, a.shape[-1]), b.reshape(b.shape[0], -1, experts).permute(2, 1, 0)


@torch.library.custom_op("lightning_ffpa::expert_lora_factors", mutates_args=())
def expert_lora_factors(a: torch.Tensor, b: torch.Tensor, experts: int, rank: int,
                        dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """peft's A (r * E, in) and B (out, r * E) as new contiguous A (E, rank, in) and B (E, rank, out) in `dtype`,
    zeros beyond r. An op, not views + .contiguous(): inductor (torch 2.11) drops the copy and hands the permuted B
    to _grouped_mm, which needs row- or column-major operands."""
    a_e, b_e = peft_stack_factors(a, b, experts)
    r = a_e.shape[1]
    a_out = a.new_zeros(experts, rank, a.shape[-1], dtype=dtype)
    b_out = b.new_zeros(experts, rank, b.shape[0], dtype=dtype)
    a_out[:, :r].copy_(a_e)
    b_out[:, :r].copy_(b_e)
    return a_out, b_out


@expert_lora_factors.register_fake
def _(a, b, experts, rank, dtype):
    return a.new_empty(experts, rank, a.shape[-1], dtype=dtype), b.new_empty(experts, rank, b.shape[0], dtype=dtype)


def _factors_setup(ctx, inputs, output):
    a, b, experts, _, _ = inputs
    ctx.experts, ctx.r = experts, a.shape[0] // experts
    ctx.a_dtype, ctx.b_dtype = a.dtype, b.dtype


def _factors_backward(ctx, grad_a, grad_b):
    r, e = ctx.r, ctx.experts
    ga = gb = None
    if grad_a is not None:  # (E, rank, in) -> (r * E, in)
        ga = grad_a[:, :r].reshape(e * r, grad_a.shape[-1]).to(ctx.a_dtype)
    if grad_b is not None:  # (E, rank, out) -> (out, r, E) -> (out, r * E)
        gb = grad_b[:, :r].permute(2, 1, 0).reshape(grad_b.shape[-1], r * e).to(ctx.b_dtype)
    return ga, gb, None, None, None


expert_lora_factors.register_autograd(_factors_backward, setup_context=_factors_setup)


class _PeftStack:
    """A training stack's adapter: peft's `ParamWrapper`, read at each call (FSDP2 gathers it in the layer)."""

    def __init__(self, wrapper: nn.Module) -> None:
        self.wrapper = wrapper

    def factors(self, dtype: torch.dtype) -> Adapter | None:
        """(A, B, scaling) in `dtype`, the rank padded for the grouped GEMM, or None when the adapter is off."""
        w = self.wrapper
        if w.disable_adapters or w.merged:
            return None
        active = [name for name in w.active_adapters if name in w.lora_A]
        if not active:
            return None
        name = active[0]
        a, b = w.lora_A[name].weight, w.lora_B[name].weight
        rank = StackAdapter.padded(a.shape[0] // w.num_experts)
        a, b = expert_lora_factors(a, b, w.num_experts, rank, dtype)  # fresh contiguous tensors: see the op
        return a, b, w.scaling[name]


class StackAdapter:
    """An expert stack's adapter in buffers of its own (the rollout engine's): A (E, r', in) and s * B (E, r', out),
    r' the rank padded for the grouped GEMM (zeros beyond r), written in place by `set` so captured CUDA graphs stay
    valid across refreshes."""

    def __init__(self, experts: int, rank: int, in_features: int, out_features: int, scaling: float,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.rank, self.scaling = rank, scaling
        self.a = torch.zeros(experts, StackAdapter.padded(rank), in_features, dtype=dtype, device=device)
        self.b = torch.zeros(experts, StackAdapter.padded(rank), out_features, dtype=dtype, device=device)

    @staticmethod
    def elements(stack_shape: tuple[int, ...], rank: int) -> int:
        """Elements of the A and B buffers for a stack (E, out, in) at LoRA rank `rank`."""
        experts, out_features, in_features = stack_shape
        return experts * StackAdapter.padded(rank) * (in_features + out_features)

    @staticmethod
    def padded(rank: int) -> int:
        """The rank as the grouped GEMMs take it: 16-byte rows in bf16."""
        return rank + (-rank % _ALIGN)

    @torch.no_grad()
    def set(self, a: torch.Tensor, b: torch.Tensor) -> None:
        """Write peft's factors (A (r * E, in), B (out, r * E)) into the buffers."""
        a_e, b_e = peft_stack_factors(a, b, self.a.shape[0])
        self.a[:, :self.rank].copy_(a_e)
        self.b[:, :self.rank].copy_(b_e * self.scaling)  # scaled in B's own (training) dtype: one rounding

    def factors(self, dtype: torch.dtype) -> Adapter:
        return self.a, self.b, 1.0


class _RouteRows(torch.autograd.Function):
    """rows = src[index], where each row of `src` lands `group` times, at rows[inverse[t * group + j]] for its j-th
    copy. The backward gathers, g[inverse] summed over each row's copies, where autograd's backward of indexing
    scatter-adds into zeros (`index_put` with accumulation: atomics, an order that varies run to run)."""

    @staticmethod
    def forward(ctx, src: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor, group: int) -> torch.Tensor:
        ctx.save_for_backward(inverse)
        ctx.group = group
        return src[index]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (inverse,) = ctx.saved_tensors
        g = grad[inverse]
        if ctx.group > 1:
            g = g.view(-1, ctx.group, grad.shape[-1]).sum(dim=1)
        return g, None, None, None


def _route(src: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor, group: int) -> torch.Tensor:
    """src[index] through `_RouteRows` where a backward will follow; plain indexing otherwise (rollouts' decode,
    captured in CUDA graphs, runs without autograd)."""
    if torch.is_grad_enabled() and src.requires_grad:
        return _RouteRows.apply(src, index, inverse, group)
    return src[index]


def inverse_permutation(perm: torch.Tensor) -> torch.Tensor:
    """inv with inv[perm[i]] = i."""
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    return inv


def permute_rows(x: torch.Tensor, perm: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
    """x[perm], whose backward gathers by `inv` (the inverse permutation) instead of scattering."""
    return _route(x, perm, inv, 1)


def sort_by_expert(hidden: torch.Tensor,
                   top_k_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each token's row once per routed expert, grouped by expert (stable within an expert).
    Returns (rows (T*K, H), experts of the rows, order, back): row i is token order[i] // K's copy for its
    (order[i] % K)-th expert, and back is order's inverse, which `combine_by_token` takes."""
    top_k = top_k_index.shape[-1]
    experts_sorted, order = torch.sort(top_k_index.reshape(-1), stable=True)
    back = inverse_permutation(order)
    return _route(hidden, order // top_k, back, top_k), experts_sorted, order, back


def combine_by_token(rows: torch.Tensor, top_k_weights: torch.Tensor, order: torch.Tensor, back: torch.Tensor,
                     dtype: torch.dtype) -> torch.Tensor:
    """The experts' rows (in `sort_by_expert`'s order) weighted by the router as HF weights them and summed per
    token over its K rows, in a fixed order (an index_add would add in `dtype` with atomics)."""
    top_k = top_k_weights.shape[-1]
    weights = permute_rows(top_k_weights.reshape(-1, 1), order, back)  # (T*K, 1) in expert order
    per_token = permute_rows(rows * weights, back, order).view(-1, top_k, rows.shape[-1])
    return per_token.sum(dim=1).to(dtype)


def _experts_forward(module: nn.Module, hidden: torch.Tensor, top_k_index: torch.Tensor,
                     top_k_weights: torch.Tensor) -> torch.Tensor:
    """HF's experts forward (hidden (T, H), top_k_index and top_k_weights (T, K)), the stacks' adapters unmerged."""
    num_experts = module.gate_up_proj.shape[0]
    adapters = {}
    for name in EXPERT_STACKS:  # a plain loop: dynamo breaks the graph on a comprehension with `:=`
        adapter = module.expert_adapters.get(name)
        factors = None if adapter is None else adapter.factors(module.gate_up_proj.dtype)
        if factors is not None:
            adapters[name] = factors
    x, experts_sorted, order, back = sort_by_expert(hidden, top_k_index)  # (T*K, H) grouped by expert
    offsets = counts = None
    # compiled in fp32 the grouped GEMM cannot be traced: the loop, counted as such
    if experts_implementation(module) == "grouped_mm" and grouped_mm_runs(module.gate_up_proj.dtype):
        # histc, not bincount: no host sync; CUDA's takes ints, the CPU's floats (as HF counts)
        counted = experts_sorted.int() if experts_sorted.is_cuda else experts_sorted.float()
        offsets = torch.histc(counted, bins=num_experts, min=0, max=num_experts - 1).cumsum(0, dtype=torch.int32)
    else:
        counts = torch.bincount(experts_sorted, minlength=num_experts).tolist()
    counters.count(COUNTER, "grouped_mm" if offsets is not None else "loop", hidden)
    out = expert_mlp(x, module.gate_up_proj, module.down_proj, module.act_fn, offsets=offsets, counts=counts,
                     adapters=adapters)
    return combine_by_token(out, top_k_weights, order, back, hidden.dtype)


def _bypass(wrapper: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """A peft `ParamWrapper`'s call without its fold: the experts forward reads the adapter itself."""
    return wrapper.base_layer(*args, **kwargs)


def _with_forward(module: nn.Module, prefix: str, forward) -> None:
    """Give `module` `forward` through a subclass of its class (made once per class, importable from here so a
    pickled model loads). A class attribute, not an instance one: dynamo guards an instance's `forward` by identity,
    so every layer would compile again (30 compiles of the 26B-A4B layer); a class is one guard for all layers."""
    cls = type(module)
    if cls.__dict__.get("forward") is forward:
        return
    name = f"{prefix}{cls.__name__}"  # the prefix keeps HF's suffix ("...Experts") that code and reports look for
    sub = globals().get(name)
    if sub is None or sub.__bases__ != (cls,):
        sub = type(name, (cls,), {"forward": forward, "__module__": __name__, "__qualname__": name})
        globals()[name] = sub
    module.__class__ = sub


def _stack_wrappers(model: nn.Module) -> dict[nn.Module, dict[str, nn.Module]]:
    """{experts module: {stack name: the peft ParamWrapper adapting it}} (peft nests one wrapper per stack)."""
    found: dict[nn.Module, dict[str, nn.Module]] = {}
    for m in model.modules():
        if getattr(m, "parameter_name", None) in EXPERT_STACKS and hasattr(m, "lora_A") and hasattr(m, "base_layer"):
            inner = m.base_layer
            while hasattr(inner, "parameter_name") and hasattr(inner, "base_layer"):
                inner = inner.base_layer
            found.setdefault(inner, {})[m.parameter_name] = m
    return found


def unsupported(experts: nn.Module, wrappers: dict[str, nn.Module] | None = None) -> str | None:
    """Why this experts module cannot take unmerged adapters (peft's `wrappers` on it, if any), or None."""
    if any(getattr(experts, flag, False) for flag in ("has_bias", "is_transposed", "has_post_expert_norm")):
        return "its experts have biases, transposed stacks or a post-expert norm"
    if getattr(experts, "has_gate", True) is False:
        return "its experts have no gate"
    if any(len(w.lora_A) > 1 for w in (wrappers or {}).values()):
        return "it holds more than one adapter"
    return None


def serve_adapters(experts: nn.Module, adapters: dict[str, _PeftStack | StackAdapter]) -> None:
    """Give `experts` the forward that adds `adapters` ({stack name: adapter}) unmerged."""
    experts.expert_adapters = adapters  # not submodules: no second path to the parameters
    _with_forward(experts, "UnmergedAdapters", _experts_forward)


def unmerge_expert_adapters(model: nn.Module, option: str = "model.lora.expert_adapters") -> dict[str, Any]:
    """Make every peft-adapted expert stack of `model` apply its adapter unmerged in the experts' GEMMs (see the
    module docstring). Returns {"unmerged": experts modules, "stacks": adapted stacks}. Raises ConfigError for an
    experts module the unmerged forward does not cover (`folded` keeps peft's fold)."""
    groups = _stack_wrappers(model)
    for experts, wrappers in groups.items():
        why = unsupported(experts, wrappers)
        if why is not None:
            raise ConfigError(option, "unmerged", f"cannot cover {type(experts).__name__}: {why}; set "
                                                  "expert_adapters: folded (peft's fold)")
        for wrapper in wrappers.values():
            _with_forward(wrapper, "Unfolded", _bypass)
        serve_adapters(experts, {name: _PeftStack(w) for name, w in wrappers.items()})
    return {"unmerged": len(groups), "stacks": sum(len(w) for w in groups.values())}


def path_counts() -> dict[str, int]:
    """Experts forwards with unmerged adapters per path (`grouped_mm`, `loop`) since the counters were reset."""
    return counters.counts(COUNTER)
