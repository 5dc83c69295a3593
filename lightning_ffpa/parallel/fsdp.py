"""`parallelize`: the public recipe that turns an HF decoder model into an FSDP2 (+AC, +compile) model.

Owns the order of the wrapping steps. It does not build the mesh (the strategy does), find the decoder
layers (`lightning_ffpa._compat.transformers.find_decoder_layers`), pick attention kernels (the attention
Callback does) or dispatch tokens to experts (`expert_parallel.py`). Any LightningModule can call it from
`configure_model` with `self.device_mesh` (or the strategy's `parallel_dims`).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    fully_shard,
    register_fsdp_forward_method,
)

from lightning_ffpa import compile_fallbacks
from lightning_ffpa._compat.torch import allow_checkpoint_side_effects_under_compile
from lightning_ffpa._compat.transformers import disable_kv_cache, find_decoder_layers
from lightning_ffpa.hidden_states import (
    HIDDEN_STATES_METHOD,
    causal_lm_hidden_states,  # re-exported: `lightning_ffpa.parallel.causal_lm_hidden_states`
    install_hidden_states_method,
)
from lightning_ffpa.parallel.checkpointing import (
    ACMode,
    SaveMM,
    apply_activation_checkpointing,
    check_ac_mode,
    sac_context_fn,
)
from lightning_ffpa.parallel.dims import ParallelDims
from lightning_ffpa.parallel.expert_parallel import shard_experts
from lightning_ffpa.parallel.fp8 import SAC_SAVE_OPS as FP8_SAC_SAVE_OPS
from lightning_ffpa.parallel.fp8 import Float8Training

__all__ = ["parallelize", "find_decoder_layers", "causal_lm_hidden_states"]


def parallelize(model: nn.Module, mesh: ParallelDims | DeviceMesh | None, *, activation_checkpointing: ACMode = "none",
                sac_extra_save_ops: list[str] | tuple[str, ...] = (), sac_save_mm: SaveMM = "high_k",
                compile: bool = False, mp_policy: MixedPrecisionPolicy | None = None,
                reshard_after_forward: bool = True, cpu_offload: bool = False,
                replicate_frozen: bool = False, fp8: Float8Training | None = None) -> nn.Module:
    """FP8 conversion, AC, per-layer compile, then FSDP2 per decoder layer and at the root; returns `model`.

    `mesh`: the run's `ParallelDims` (the strategy's), or a DeviceMesh (`ParallelDims.from_mesh` reads it); FSDP
    shards over all its dims flattened. With expert parallelism (`ep > 1`) each MoE layer's expert stacks are split
    over the expert-parallel dim instead (`expert_parallel.shard_experts`), and FSDP2 leaves them alone.
    `mesh=None` applies AC and compile only (single process without a process group).
    `replicate_frozen`: parameters with `requires_grad=False` (a LoRA's base) stay whole plain tensors on
    every rank (FSDP2's `ignored_params`): no all-gather and no gathered copy of them, each rank holding all
    of them. They must already be in the compute dtype (`mp_policy.param_dtype`), which FSDP2 would cast to.
    `fp8`: torchao float8 training of the decoder layers' nn.Linear modules (`lightning_ffpa.parallel.fp8`); what
    was converted is kept in `model.fp8_layout`.
    Sets `use_cache=False` in the model's HF configs: a training forward needs no KV cache.
    """
    # Validate and resolve op names first: a typo must fail before any wrapping.
    check_ac_mode(activation_checkpointing)
    fp8 = fp8 or Float8Training()
    if fp8.enabled:  # the float8 casts' amax reductions are saved (the SAC rule in `fp8`)
        sac_extra_save_ops = (*sac_extra_save_ops, *FP8_SAC_SAVE_OPS)
    context_fn = sac_context_fn(sac_extra_save_ops, sac_save_mm) if activation_checkpointing == "selective" else None
    found = find_decoder_layers(model)
    if found is None:
        raise ValueError(f"parallelize found no decoder layers (`.model.layers` / `.layers`) in {type(model).__name__}")
    owner, attr = found
    layers: nn.ModuleList = getattr(owner, attr)
    # A training recipe: HF's default `use_cache=True` would grow a KV cache in every forward (and again in
    # every checkpoint recompute, which torch rejects). Generation is unaffected: `generate` passes its own.
    disable_kv_cache(model)
    if compile and activation_checkpointing != "none":
        allow_checkpoint_side_effects_under_compile()
    if compile:
        compile_fallbacks.prepare()

    # FP8 conversion comes first, on the raw layers (meta weights are fine):
    # - before compile, so each compiled layer traces the float8 forward and fuses its casts (a swap after
    #   compile would change the modules the compiled code guards on);
    # - before fully_shard, which takes each parameter as it is then: with float8 all-gather the converted weight
    #   is torchao's tensor subclass, whose FSDP2 hooks cast the shard to float8 before the all-gather;
    # - AC has no order with it (its wrapper holds the same layer object); the SAC rule is in the save ops above.
    fp8_layout = fp8.convert(layers)
    if fp8.enabled:
        model.fp8_layout = fp8_layout

    for i, layer in enumerate(layers):
        # AC wraps the raw layer so the checkpoint region is exactly one decoder layer.
        layer = apply_activation_checkpointing(layer, activation_checkpointing, context_fn)
        # Compile after AC wrapping and before FSDP, so the compiled graph sees the checkpoint region
        # and FSDP's hooks stay outside the compiled code (torchtitan's order). Static shapes: SAC
        # recompute under automatic dynamic shapes can pick a different graph than the forward
        # (pytorch/pytorch#166926); packed/fixed-length batches make static shapes the norm anyway.
        if compile:
            layer = torch.compile(layer, dynamic=False)
        layers[i] = layer

    if mesh is None:
        return model

    dims = mesh if isinstance(mesh, ParallelDims) else ParallelDims.from_mesh(mesh)
    kwargs = dict(mesh=dims.fsdp_mesh, mp_policy=mp_policy or MixedPrecisionPolicy())
    if cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())  # pinning needs CUDA
    ignored: set[nn.Parameter] = set()
    if replicate_frozen:
        ignored |= frozen_params(model, kwargs["mp_policy"].param_dtype, cpu_offload)
    # Experts are split over the EP dim before fully_shard, which would otherwise take their stacks as its own
    # (the layer's unit and the root's both get them as ignored). Their forward is swapped in place, so the AC
    # wrappers and compiled layers above already call it.
    if dims.ep > 1:
        ignored |= shard_experts(layers, dims, kwargs["mp_policy"].param_dtype)
    if ignored:
        kwargs["ignored_params"] = ignored
    # Per-layer units: one all-gather per layer in forward and backward, and memory bounded by one layer.
    for i, layer in enumerate(layers):
        # The last layer's params are needed again right away in backward: keep them gathered.
        fully_shard(layer, reshard_after_forward=reshard_after_forward and i < len(layers) - 1, **kwargs)
    # The root unit holds embeddings, final norm and the (tied) lm_head.
    has_hidden_method = install_hidden_states_method(model)
    # The root stays gathered after forward: the fused loss reads lm_head.weight after the forward
    # method returns, and backward needs it first thing anyway.
    fully_shard(model, reshard_after_forward=False, **kwargs)
    if has_hidden_method:
        # Register on the root (the peft wrapper under LoRA), so the fused loss's hidden-states call
        # runs the root's all-gather like `forward` does.
        register_fsdp_forward_method(model, HIDDEN_STATES_METHOD)
    return model


def dtypes_cast(params: Iterable[nn.Parameter], param_dtype: torch.dtype | None) -> list[torch.dtype]:
    """The dtypes among `params` that FSDP2 would cast to `param_dtype` (none when it is None)."""
    return sorted({p.dtype for p in params if param_dtype not in (None, p.dtype)}, key=str)


# One rule at two stages: the strategy's constructor (before any model is built) and `frozen_params` (parallelize).
REPLICATE_WITH_OFFLOAD = ("`replicate_frozen=True` keeps frozen weights whole on the device, and `cpu_offload=True` "
                          "keeps weights in host memory: use one of them")


def frozen_params(model: nn.Module, param_dtype: torch.dtype | None, cpu_offload: bool) -> set[nn.Parameter]:
    """The parameters `replicate_frozen` keeps out of FSDP2, checked: no CPU offload, all in `param_dtype`."""
    frozen = {p for p in model.parameters() if not p.requires_grad}
    if frozen and cpu_offload:
        raise ValueError(REPLICATE_WITH_OFFLOAD)
    wrong = [str(d) for d in dtypes_cast(frozen, param_dtype)]
    if wrong:
        raise ValueError(f"`replicate_frozen` computes with frozen weights as stored, and some are {wrong} while "
                         f"`param_dtype` is {param_dtype}: build the model in that dtype (`model.dtype`), or leave "
                         "`replicate_frozen` off")
    return frozen


def shard_trainable_rest(root: nn.Module, mesh: ParallelDims, mp_policy: MixedPrecisionPolicy | None = None,
                         cpu_offload: bool = False) -> list[str]:
    """`fully_shard` each child of `root` that holds trainable parameters no FSDP2 unit holds (a value head beside
    the HF model, a second trained model); returns their names.

    Left plain, such parameters would train on each rank alone: no gradient is averaged, and the ranks part.
    A trainable parameter of `root` itself cannot be sharded apart from the rest and is refused by name.
    """
    from lightning_ffpa.errors import InputError

    covered = {id(p) for m in root.modules() if isinstance(m, FSDPModule) for p in m.parameters()}
    rest = [name for name, p in root.named_parameters() if p.requires_grad and id(p) not in covered]
    if not rest:
        return []
    direct = [n for n in rest if "." not in n]
    if direct:
        raise InputError(f"FSDP2Strategy cannot shard trainable parameters set on the LightningModule itself "
                         f"({', '.join(direct)}): put them in a submodule (an nn.Linear, an nn.ParameterDict) so FSDP2 "
                         "shards them and averages their gradients across ranks")
    kwargs: dict = dict(mesh=mesh.fsdp_mesh, mp_policy=mp_policy or MixedPrecisionPolicy())
    if cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    children = dict.fromkeys(n.split(".", 1)[0] for n in rest)
    for child in children:
        fully_shard(root.get_submodule(child), **kwargs)
    return list(children)
