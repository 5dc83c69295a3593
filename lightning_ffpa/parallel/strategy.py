"""`FSDP2Strategy`: Lightning's ModelParallelStrategy over a data- x context- (x expert-) parallel mesh.

Owns building the run's `ParallelDims` (sizes and mesh: `dims.py` validates them), the sampler split (CP peers read
the same sample), and applying `fsdp.parallelize` when the LightningModule has not parallelized itself. It does
not choose attention kernels or install the CP ring (the attention Callback reads `context_parallel_size` and
does that), nor dispatch tokens to experts (`expert_parallel.py`).

YAML: `strategy: {class_path: lightning_ffpa.parallel.FSDP2Strategy, init_args: {...}}`. Keep the
Trainer's `precision` at "32-true": mixed precision comes from `param_dtype` / `reduce_dtype`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn
from typing_extensions import override

from lightning_ffpa import compile_fallbacks
from lightning_ffpa._compat import lightning as lightning_compat
from lightning_ffpa._compat import transformers as hf_compat
from lightning_ffpa._compat.torch import dtensor_rng_spans_shards, local_part
from lightning_ffpa.checkpoint.atomic import AtomicCheckpointIO
from lightning_ffpa.checkpoint.frozen import check_frozen_base, read_frozen_record
from lightning_ffpa.checkpoint.sharded import ShardedCheckpointWriter
from lightning_ffpa.dtypes import parse_dtype
from lightning_ffpa.errors import ConfigError, InputError
from lightning_ffpa.experts import EXPERT_STACKS
from lightning_ffpa.lora import lora_spec
from lightning_ffpa.parallel.activation_offload import ActivationOffload
from lightning_ffpa.parallel.checkpointing import ACMode, SaveMM, check_ac_mode, sac_context_fn
from lightning_ffpa.parallel.dims import ParallelDims, check_expert_parallel
from lightning_ffpa.parallel.expert_parallel import clip_grad_norm_by_mesh, find_experts
from lightning_ffpa.parallel.fp8 import Float8Training, FP8Recipe
from lightning_ffpa.parallel.fsdp import (
    REPLICATE_WITH_OFFLOAD,
    dtypes_cast,
    parallelize,
    shard_trainable_rest,
)

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["FSDP2Strategy", "close_process_group", "init_as_whole", "materialize"]


def close_process_group() -> None:
    """After work that every rank completed (e.g. the last `trainer.fit`): meet, then take the process group
    down on every rank. The `lightning-ffpa` CLI calls it; a script with its own Trainer can too.

    Lightning leaves a gloo group to the interpreter's exit. Under `srun` each task exits on its own, and rank 0
    (which serves the rendezvous store) can go while another rank's group is still torn down at exit: that rank
    aborted (`terminate called without an active exception`, exit 134) after a finished two-task fit. With more
    than one rank, a console script then ends right after its exit handlers, without the interpreter's
    finalization (`errors.skip_finalizing`): gloo's worker threads outlive the group and can be ended inside a
    C++ destructor by it (docs/troubleshooting.md)."""
    import torch.distributed as dist

    from lightning_ffpa.errors import skip_finalizing

    if dist.is_available() and dist.is_initialized():
        if dist.get_world_size() > 1:  # a console script then ends without finalization (`skip_finalizing`)
            skip_finalizing()
        dist.barrier()
        dist.destroy_process_group()


def model_text_config(module: Any) -> Any:
    """The (text) config of a LightningModule that holds one before its model is built (`Gemma4LM.config`), else
    None: then `parallelize` checks expert parallelism against the built model."""
    config = getattr(module, "config", None)
    get_text = getattr(config, "get_text_config", None)
    return get_text() if callable(get_text) else None


def _find_parallelize_target(module: nn.Module, required: bool = True) -> nn.Module | None:
    """The HF model inside a LightningModule that `parallelize` shards (see `find_hf_model`)."""
    try:
        target = hf_compat.find_hf_model(module, with_decoder_layers=True)
    except hf_compat.AmbiguousModelError as err:
        raise InputError(str(err)) from None
    if target is not None or not required:
        return target
    raise TypeError(
        f"FSDP2Strategy found no decoder model in {type(module).__name__}: set `self.model` to an HF model, "
        "or call `lightning_ffpa.parallel.parallelize(...)` yourself in `configure_model()`"
    )


def _plain_ties(model: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """(module, name) groups sharing one plain (not FSDP2-sharded) parameter, e.g. lm_head = embedding.

    `to_empty` gives each module a new tensor, so such ties (kept out of FSDP2 by `replicate_frozen`) break
    there; FSDP2's own parameters keep theirs."""
    shared: dict[int, list[tuple[nn.Module, str]]] = {}
    for sub in model.modules():
        for name, p in sub._parameters.items():
            if p is not None and not hasattr(p, "device_mesh"):  # a DTensor parameter has a mesh
                shared.setdefault(id(p), []).append((sub, name))
    return [refs for refs in shared.values() if len(refs) > 1]


def plan_replicate_frozen(mode: bool | str, cpu_offload: bool, mesh_size: int, frozen: list[nn.Parameter],
                          param_dtype: torch.dtype | None, fp8_base: bool = False) -> tuple[bool, str]:
    """Whether `replicate_frozen` keeps this model's frozen parameters out of FSDP2, and why (logged).

    "auto" does where it costs nothing and changes no numerics: a mesh of one device (sharding splits nothing
    there), no CPU offload, and a frozen base already stored in `param_dtype` (FSDP2 would cast it, and kept
    out it is computed with as stored). True always does (its errors come from `fsdp.frozen_params`).
    """
    if not frozen:
        return False, "no frozen parameters"
    if mode is True:
        return True, "replicate_frozen=true"
    if mode is False:
        return False, "replicate_frozen=false"
    if fp8_base:
        return True, "auto: model.lora.base_dtype fp8 keeps the float8 base whole"
    if cpu_offload:
        return False, "auto: cpu_offload keeps weights in host memory"
    if mesh_size > 1:
        return False, f"auto: a mesh of {mesh_size} devices, where sharding the base saves memory"
    wrong = [str(d).removeprefix("torch.") for d in dtypes_cast(frozen, param_dtype)]
    if wrong:
        return False, f"auto: the frozen base is {', '.join(wrong)} and param_dtype {str(param_dtype).removeprefix('torch.')}"
    return True, "auto: a mesh of one device"


def _copy_local_shard(whole: torch.Tensor, param: torch.Tensor) -> None:
    """Write this rank's part of `whole` into the DTensor `param` (no communication: each rank holds `whole`)."""
    with torch.no_grad():
        param.to_local().copy_(local_part(whole, param))


@contextlib.contextmanager
def init_as_whole(modules: Iterable[nn.Module]) -> Iterator[None]:
    """Inside, the sharded parameters that `modules` own directly (not their submodules') are whole plain tensors;
    on exit each rank copies its own shard of each back. A random initialiser run inside draws what one process
    would draw with the same seed, on any number of ranks.

    Only parameters whose shards a DTensor random op would not draw as parts of one stream are replaced: on a CPU
    mesh each rank fills its shard from its own generator (ranks seeded alike drew the same values into every
    shard), and shards offloaded to CPU under a CUDA mesh draw from the CPU generator, which torch's CUDA RNG
    tracker restores after each op. Shards on CUDA stay as they are: the tracker gives each its own part of the
    stream. Costs the whole size of the replaced parameters while inside: pass a module at a time.
    """
    swapped = []
    for module in modules:
        for name, param in module._parameters.items():
            if param is not None and hasattr(param, "device_mesh") and not dtensor_rng_spans_shards(param):
                whole = torch.empty(param.shape, dtype=param.dtype, device=param.to_local().device)
                module._parameters[name] = nn.Parameter(whole, requires_grad=param.requires_grad)
                swapped.append((module, name, param))
    try:
        yield
    finally:
        for module, name, param in swapped:
            _copy_local_shard(module._parameters[name], param)
            module._parameters[name] = param


def materialize(model: nn.Module, device: torch.device, exact_random: bool = True) -> None:
    """Allocate and initialise meta-device weights after sharding (each rank only its shard).

    With `exact_random`, on CPU and for shards offloaded to CPU, an HF model gets the values a one-process build
    with the same seed gets, on any number of ranks (`init_as_whole`: each rank draws whole tensors); shards on
    CUDA are drawn by torch's DTensor RNG tracker. Pass False when loaded weights replace the drawn ones."""
    if not any(t.is_meta for t in (*model.parameters(), *model.buffers())):
        return
    init_weights = hf_compat.init_weights_fn(model)
    if init_weights is None:
        lightning_compat.materialize_distributed_module(model, device)  # Lightning's reset_parameters() path
        return
    # HF models: their initialiser also rebuilds non-persistent buffers (rotary inv_freq, embed scale).
    ties = _plain_ties(model)
    model.to_empty(device=device)
    for (owner, name), *others in ties:
        for sub, other in others:
            sub._parameters[other] = owner._parameters[name]
    seen: set[int] = set()
    with torch.no_grad():
        for sub in model.modules():
            own = [id(p) for p in sub.parameters(recurse=False)]
            if own and seen.issuperset(own):
                continue  # a tied lm_head: drawing it again redrew the embedding, its zeroed pad row included
            seen.update(own)
            with init_as_whole([sub] if exact_random else []):  # HF's initialiser touches `sub`'s own tensors only
                init_weights(sub)


class FSDP2Strategy(ModelParallelStrategy):
    """FSDP2 over a data- x context-parallel mesh (experts optionally split over an expert-parallel dim), with
    activation checkpointing and compile."""

    def __init__(
        self,
        data_parallel_size: Literal["auto"] | int = "auto",
        context_parallel_size: int = 1,
        expert_parallel_size: int = 1,
        activation_checkpointing: ACMode = "selective",
        sac_extra_save_ops: list[str] | None = None,
        sac_save_mm: SaveMM = "high_k",
        param_dtype: str | None = "bf16",
        reduce_dtype: str | None = "fp32",
        reshard_after_forward: bool = True,
        cpu_offload: bool = False,
        replicate_frozen: bool | str = "auto",
        activation_offload: bool = False,
        compile: bool | None = None,
        fp8: FP8Recipe = "none",
        fp8_emulate: bool = False,
        save_distributed_checkpoint: bool = True,
        async_save: bool = False,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        """Configure the mesh and the parallelize recipe.

        Args:
            data_parallel_size: Data-parallel replicas; "auto" = world size / context_parallel_size.
            context_parallel_size: Ranks that split one sequence (ring attention); 1 disables CP.
            expert_parallel_size: Data-parallel ranks that split each MoE layer's experts (each owns
                num_experts / expert_parallel_size of them; tokens reach them by all-to-all); 1 disables EP.
                Must divide the data-parallel size and num_experts; not with context_parallel_size > 1.
            activation_checkpointing: "none", "full" (recompute each decoder layer) or "selective" (SAC).
            sac_extra_save_ops: Extra op names the SAC policy must save, e.g. ["aten.mm.default"].
            sac_save_mm: Matmuls SAC saves (selective only): "high_k" (K > layer width: o_proj, down_proj),
                "every_other", "all", "none".
            param_dtype: Dtype FSDP gathers parameters in for compute ("bf16", "fp32", or null = as stored).
            reduce_dtype: Dtype of the gradient reduce-scatter ("fp32" recommended with bf16 params).
            reshard_after_forward: Free gathered layer weights after forward (ZeRO-3); False keeps them (ZeRO-2).
            cpu_offload: Keep sharded parameters, gradients and optimizer state on CPU.
            replicate_frozen: Keep parameters with `requires_grad=False` (a LoRA's base) out of FSDP2, whole on
                every rank: no all-gather and no gathered copy of them. "auto" does so on a mesh of one GPU
                without `cpu_offload`, with the frozen base stored in `param_dtype` (sharding splits nothing
                there, yet FSDP2 still copies each unit's weights when it gathers them); True also on more
                GPUs (each then holds the whole frozen base, and no base all-gather runs), and needs frozen
                weights stored in `param_dtype`. What ran is logged and kept in `frozen_placement`.
            activation_offload: Move the activations autograd saves for backward to pinned host memory during
                each training step's forward, and back in backward (CUDA only). Less GPU memory for a host copy
                each way; pair it with activation_checkpointing="full", which saves about one input per layer.
            compile: torch.compile each decoder layer (after AC wrapping, before FSDP); null = on for CUDA,
                off elsewhere. Its gain over the eager SAC path: `benchmarks/train_throughput.py --rows ours
                ours_nocompile` (the ablation row is not in the default set).
            fp8: FP8 training (torchao float8) of the decoder layers' linear layers, full fine-tuning only:
                "none", "rowwise" (a scale per row) or "tensorwise" (a scale per tensor; FSDP2 all-gathers the
                weights in float8). The lm_head and embeddings stay bf16. Needs a GPU with FP8 (capability
                >= 8.9) and `pip install lightning-ffpa[fp8]`. Off in the recipes: on one H100 it stepped
                faster but lost 2-3% of the final loss against bf16 (`docs/performance.md`).
            fp8_emulate: Emulate the float8 matmuls in high precision (torchao's `emulate`), so `fp8` runs on CPU
                or an older GPU: for tests of the wiring, never for speed.
            save_distributed_checkpoint: Save per-rank DCP shards (True) or one full file on rank 0; either is
                written under a temporary name and renamed when complete (`lightning_ffpa.checkpoint`).
            async_save: Write DCP checkpoints in the background (`torch.distributed.checkpoint.async_save`);
                training continues once the shards are copied to CPU memory.
            process_group_backend: torch.distributed backend; default nccl on CUDA, gloo on CPU.
            timeout: Process-group timeout.
        """
        super().__init__(data_parallel_size=data_parallel_size, tensor_parallel_size=1,
                         save_distributed_checkpoint=save_distributed_checkpoint,
                         process_group_backend=process_group_backend, timeout=timeout)
        # Validate everything that needs no world size now, before processes start.
        if not (data_parallel_size == "auto" or (isinstance(data_parallel_size, int) and data_parallel_size >= 1)):
            raise ValueError(f"`data_parallel_size={data_parallel_size!r}` must be 'auto' or a positive int")
        if not (isinstance(context_parallel_size, int) and context_parallel_size >= 1):
            raise ValueError(f"`context_parallel_size={context_parallel_size!r}` must be a positive int")
        if not (isinstance(expert_parallel_size, int) and expert_parallel_size >= 1):
            raise ConfigError("expert_parallel_size", expert_parallel_size, "must be a positive int")
        ParallelDims.check_combination(context_parallel_size, expert_parallel_size)
        check_ac_mode(activation_checkpointing)
        self._context_parallel_size = context_parallel_size
        self._expert_parallel_size = expert_parallel_size
        self._parallel_dims: ParallelDims | None = None  # built in setup_environment, once the world size is known
        self.activation_checkpointing = activation_checkpointing
        self.sac_extra_save_ops = list(sac_extra_save_ops or [])
        self.sac_save_mm = sac_save_mm
        if activation_checkpointing == "selective":
            sac_context_fn(self.sac_extra_save_ops, sac_save_mm)  # resolves op names: typos fail here
        elif self.sac_extra_save_ops:
            raise ValueError("`sac_extra_save_ops` needs `activation_checkpointing='selective'`")
        elif sac_save_mm != "high_k":  # the default; another choice would be ignored without SAC
            raise ValueError(f"`sac_save_mm={sac_save_mm!r}` needs `activation_checkpointing='selective'` "
                             f"(with {activation_checkpointing!r} no SAC policy chooses what is saved)")
        self.param_dtype = parse_dtype("param_dtype", param_dtype, allow_auto=False, allow_none=True)
        self.reduce_dtype = parse_dtype("reduce_dtype", reduce_dtype, allow_auto=False, allow_none=True)
        self.reshard_after_forward = reshard_after_forward
        self.cpu_offload = cpu_offload
        if replicate_frozen not in (True, False, "auto"):
            raise ValueError(f"`replicate_frozen={replicate_frozen!r}` must be true, false or 'auto'")
        if replicate_frozen is True and cpu_offload:
            raise ValueError(REPLICATE_WITH_OFFLOAD)
        self.replicate_frozen = replicate_frozen
        if async_save and not save_distributed_checkpoint:  # the one-file save never reaches the async writer
            raise ConfigError("async_save", True, "writes DCP folders in the background; "
                              "with `save_distributed_checkpoint: false` every save is one synchronous file (set one "
                              "of them the other way)")
        self.frozen_placement: dict[str, Any] | None = None  # what `replicate_frozen` did, once parallelized
        self.activation_offload = activation_offload
        self._offload = ActivationOffload() if activation_offload else None
        self.compile = compile
        self.fp8_training = Float8Training(fp8, fp8_emulate)  # an unknown value fails here
        self._dcp_writer = ShardedCheckpointWriter(async_save=async_save)

    @property
    def context_parallel_size(self) -> int:
        """Ranks per context-parallel group (1 = no CP)."""
        return self._context_parallel_size

    @property
    def expert_parallel_size(self) -> int:
        """Ranks per expert group, which split each MoE layer's experts (1 = no EP)."""
        return self._expert_parallel_size

    @property
    def parallel_dims(self) -> ParallelDims:
        """The run's sizes and mesh (built in `setup_environment`); every mesh consumer reads this."""
        if self._parallel_dims is None:
            raise RuntimeError("FSDP2Strategy.parallel_dims exists once the strategy has set up its environment")
        return self._parallel_dims

    @property
    def data_parallel_size(self) -> int:
        """Data-parallel replicas (resolved once the world size is known)."""
        return self.parallel_dims.dp

    def resolve_dims(self, world_size: int, module: Any = None) -> ParallelDims:
        """This strategy's sizes for `world_size` ranks (and, for EP, the LightningModule's model config and LoRA
        options): ConfigError if they do not fit. The CLI's pre-flight runs this before any process starts;
        `setup_environment` again, before the model is built."""
        dims = ParallelDims.resolve(world_size, lightning_compat.requested_data_parallel_size(self),
                                    self._context_parallel_size, self._expert_parallel_size)
        if module is not None:
            check_expert_parallel(dims.ep, model_text_config(module), lora_spec(module))
        return dims

    @override
    def setup_environment(self) -> None:
        # Not ModelParallelStrategy.setup_environment: that one builds a dp x tp mesh.
        # Check sizes before the process group exists (the world size is known from the devices).
        assert self.lightning_module is not None
        dims = self.resolve_dims(self.num_nodes * self.num_processes, self.lightning_module)
        self.check_activation_offload()
        self.fp8_training.check_device(self.root_device)
        lightning_compat.setup_distributed(self)
        self.use_parallel_dims(dims, self.root_device.type)

    def use_parallel_dims(self, dims: ParallelDims, device_type: str) -> None:
        """Build `dims`' mesh (the process group exists) and run over it: what `setup_environment` does, for a
        process that drives the strategy without a Trainer (a benchmark row)."""
        self._parallel_dims = dims
        lightning_compat.set_device_mesh(self, dims.build_mesh(device_type))  # also `self.device_mesh`

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # CP peers must read the same sample: split data over the dp dim only.
        dp_mesh = self.parallel_dims.dp_mesh
        return {"num_replicas": dp_mesh.size(), "rank": dp_mesh.get_local_rank()}

    def check_activation_offload(self) -> None:
        """`activation_offload` needs the devices it offloads from (the CLI's pre-flight runs this too)."""
        if self._offload is not None and self.root_device.type != self._offload.device_type:
            raise ValueError(f"`trainer.strategy.init_args.activation_offload=True` moves saved activations from "
                             f"{self._offload.device_type} devices to host memory; this run's device is "
                             f"{self.root_device.type}")

    @property
    def compile_layers(self) -> bool:
        """Whether decoder layers get compiled (`compile=None`: on CUDA only)."""
        if self.compile is None:
            return self.root_device.type == "cuda"
        return bool(self.compile)

    def mp_policy(self):
        """The FSDP2 MixedPrecisionPolicy from `param_dtype` / `reduce_dtype`."""
        from torch.distributed.fsdp import MixedPrecisionPolicy

        return MixedPrecisionPolicy(param_dtype=self.param_dtype, reduce_dtype=self.reduce_dtype)

    def parallelize_module(self, module: nn.Module) -> nn.Module:
        """Apply this strategy's recipe to `module` (an HF decoder model); returns it."""
        out = parallelize(
            module, self.parallel_dims, activation_checkpointing=self.activation_checkpointing,
            sac_extra_save_ops=self.sac_extra_save_ops, sac_save_mm=self.sac_save_mm, compile=self.compile_layers,
            mp_policy=self.mp_policy(), reshard_after_forward=self.reshard_after_forward,
            cpu_offload=self.cpu_offload, replicate_frozen=self.place_frozen(module), fp8=self.fp8_training,
        )
        if self.fp8_training.enabled:
            from lightning.pytorch.utilities import rank_zero_info

            rank_zero_info(self.fp8_training.describe(out.fp8_layout))  # what FP8 converted, said once
        return out

    def place_frozen(self, module: nn.Module) -> bool:
        """Decide `replicate_frozen` for `module` on this mesh; record and log the decision."""
        from lightning.pytorch.utilities import rank_zero_info

        frozen = [p for p in module.parameters() if not p.requires_grad]
        lora = lora_spec(self.lightning_module) or {}
        on, why = plan_replicate_frozen(self.replicate_frozen, self.cpu_offload, self.device_mesh.size(), frozen,
                                        self.param_dtype, fp8_base=lora.get("base_dtype") == "fp8")
        apart = ""
        if self.parallel_dims.ep > 1:  # expert parallelism splits the expert stacks itself, outside FSDP2
            stacks = {id(getattr(m, n)) for m in find_experts([module]) for n in EXPERT_STACKS}
            if split := [p for p in frozen if id(p) in stacks]:
                frozen = [p for p in frozen if id(p) not in stacks]
                split_gib = sum(p.numel() * p.element_size() for p in split) / 2**30
                apart = (f"; {len(split)} frozen expert stacks ({split_gib:.2f} GiB) are split over "
                         f"expert_parallel_size={self.parallel_dims.ep} instead")
        gib = sum(p.numel() * p.element_size() for p in frozen) / 2**30
        self.frozen_placement = dict(replicated=on, params=len(frozen), gib=round(gib, 3), reason=why)
        if frozen:
            # an fp8 base is quantised after its weights load: this is its size in `model.dtype`, before that
            size = f"{gib:.2f} GiB" + (" before the LoRA targets are stored in float8" if lora.get("base_dtype") == "fp8"
                                       else "")
            rank_zero_info(f"frozen base: {len(frozen)} parameters ({size}) "
                           f"{'kept whole, out of FSDP2' if on else 'sharded by FSDP2'} ({why}){apart}")
        return on

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

        assert self.model is not None
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        if any(isinstance(m, FullyShardedDataParallel) for m in self.model.modules()):
            raise TypeError("FSDP2Strategy supports FSDP2 (`fully_shard`) only; found FSDP1-wrapped modules")
        # Unlike ModelParallelStrategy, `configure_model` is optional: if the module did not shard
        # itself there, apply the recipe to its HF model here (after `configure_model` has run).
        already_sharded = any(isinstance(m, FSDPModule) for m in self.model.modules())
        target = _find_parallelize_target(self.lightning_module, required=not already_sharded)
        if not already_sharded:
            self.parallelize_module(target)
        rest = shard_trainable_rest(self.lightning_module, self.parallel_dims, self.mp_policy(), self.cpu_offload)
        if rest:
            from lightning.pytorch.utilities import rank_zero_info

            rank_zero_info(f"FSDP2 also shards {', '.join(rest)}: trainable, outside the HF model it parallelizes")
        if target is not None:  # a module loading its weights (`pretrained`) needs no exact random draws
            materialize(target, self.root_device, not getattr(self.lightning_module, "loads_pretrained", False))
        lightning_compat.materialize_distributed_module(self.model, self.root_device)  # anything else still on meta
        # Pretrained weights go in after materialisation, shard by shard (the module knows its checkpoint).
        load = getattr(self.lightning_module, "load_sharded_weights", None)
        if callable(load):
            load()
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if self.parallel_dims.ep > 1:
            # torch's clip_grad_norm_ stacks all gradient norms into one DTensor, which fails across the expert
            # stacks' mesh and FSDP2's: clip (trainer.gradient_clip_val, `clip_gradients`) one mesh at a time.
            self.precision_plugin.clip_grad_by_norm = self._clip_grad_by_norm_by_mesh
        if trainer.state.fn == TrainerFn.FITTING:
            lightning_compat.optimizers_to_device(self.optimizers, self.root_device)

    def _clip_grad_by_norm_by_mesh(self, optimizer: torch.optim.Optimizer, clip_val: float) -> None:
        clip_grad_norm_by_mesh(self.precision_plugin.main_params(optimizer), clip_val)

    @override
    def optimizer_step(self, *args: Any, **kwargs: Any) -> Any:
        out = super().optimizer_step(*args, **kwargs)
        self.fp8_training.after_optimizer_step(self.model)  # tensorwise: next all-gather's float8 scales
        return out

    @property
    def activation_offload_stats(self) -> dict[str, int] | None:
        """What activation offload has moved to host memory (tensors, bytes) and kept on the device, or None."""
        return None if self._offload is None else dict(self._offload.stats)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        hooks = self._offload.hooks() if self._offload is not None else contextlib.nullcontext()
        with hooks:  # backward runs later, outside: offload's hooks were attached at save time
            out = super().training_step(*args, **kwargs)
        fallbacks = compile_fallbacks.total()  # functions torch.compile gave up on, now running eagerly
        if fallbacks:
            self.lightning_module.log("compile/fallbacks", float(fallbacks), on_step=True, on_epoch=False,
                                      rank_zero_only=True)
        return out

    @property
    def checkpoint_io(self):
        """Plain-file checkpoints: `AtomicCheckpointIO` unless a CheckpointIO plugin was given."""
        if self._checkpoint_io is None:
            self._checkpoint_io = AtomicCheckpointIO()
        elif getattr(self._checkpoint_io, "checkpoint_io", True) is None:  # AsyncCheckpointIO() around nothing
            self._checkpoint_io.checkpoint_io = AtomicCheckpointIO()
        return self._checkpoint_io

    @checkpoint_io.setter
    def checkpoint_io(self, io) -> None:
        self._checkpoint_io = io

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        if not self._save_distributed_checkpoint:
            if self.fp8_training.float8_all_gather:  # one file of plain tensors, loadable without torchao
                checkpoint = self.fp8_training.plain_tensors(checkpoint)
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        if storage_options is not None:
            raise TypeError("FSDP2Strategy.save_checkpoint(..., storage_options=...) is not supported")
        self._dcp_writer.save(self, checkpoint, filepath)

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        if getattr(self.lightning_module, "saves_frozen_weights", True):
            return super().lightning_module_state_dict()
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        # `save_frozen_weights: false`: the frozen base is never gathered (a single file) nor written (DCP)
        options = StateDictOptions(full_state_dict=not self._save_distributed_checkpoint, cpu_offload=True,
                                   ignore_frozen_params=True)
        return get_model_state_dict(self.model, options=options)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        # A checkpoint saved without the frozen base (`save_frozen_weights: false`) loads over the base this run
        # built, once the base's digest matches the one saved: checked here, before any weight is loaded.
        path = self.broadcast(checkpoint_path)
        saved = read_frozen_record(path, weights_only=weights_only)
        if saved is not None:
            check_frozen_base(saved, self.lightning_module, path)
        with lightning_compat.module_keys_with_wrappers(absent=saved["tensors"] if saved else (), module=self.model):
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        if not self._save_distributed_checkpoint:
            return super().remove_checkpoint(filepath)
        self._dcp_writer.remove(self, filepath)  # after a background save is published, never before

    @override
    def teardown(self) -> None:
        if self._offload is not None and self._offload.stats["moved"]:
            from lightning.pytorch.utilities import rank_zero_info

            st = self._offload.stats
            rank_zero_info(f"activation offload: {st['moved']} saved tensors ({st['moved_bytes'] / 2**30:.2f} GiB) "
                           f"went to host memory and back; {st['kept']} stayed on the device")
        try:
            self._dcp_writer.wait()  # the last background save is on disk before the process may exit
        finally:
            super().teardown()
