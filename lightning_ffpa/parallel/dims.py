"""`ParallelDims`: a run's parallel sizes (dp, cp, ep), their mesh layout and dimension names, resolved once.

Owns validating the sizes against the world size and the model (one `ConfigError` naming the option), the
DeviceMesh's shape and dimension names, and the sub-meshes each consumer reads: the sampler's data-parallel
mesh, the ring's context-parallel mesh, FSDP's flattened mesh, and expert parallelism's two meshes. No other file
spells a mesh dimension's name: a consumer takes a `ParallelDims` (or makes one from a mesh, `from_mesh`).
Does not own what runs over each dimension (`fsdp.py`, `lightning_ffpa.cp`, `expert_parallel.py`).

Layout: `(data_parallel, context_parallel)` without expert parallelism; with it, data parallelism is split into
`(dp_mod_ep, expert_parallel)`: the `ep` consecutive data-parallel ranks of one expert group own disjoint experts,
and `dp_mod_ep` counts the groups, which hold the same experts. The data-parallel mesh is then those two flattened.
"""

from __future__ import annotations

from typing import Any

from torch.distributed.device_mesh import DeviceMesh

from lightning_ffpa._compat import lightning as lightning_compat
from lightning_ffpa._compat.torch import flatten_mesh
from lightning_ffpa.errors import ConfigError

__all__ = ["ParallelDims", "check_expert_parallel", "context_parallel_size"]

WORLD = "world size {world} (trainer.devices x trainer.num_nodes)"


class ParallelDims:
    """Sizes of the data-, context- and expert-parallel dimensions, and (once built) the DeviceMesh over them."""

    DP = "data_parallel"
    CP = "context_parallel"
    EP = "expert_parallel"
    DP_MOD_EP = "dp_mod_ep"  # data-parallel groups that hold the same experts (dp / ep of them)
    FSDP = "dp_cp"  # every dimension flattened: FSDP2 shards the non-expert weights over it

    def __init__(self, dp: int, cp: int = 1, ep: int = 1) -> None:
        """Sizes already checked against each other (use `resolve` for a user's options).

        Args:
            dp: Data-parallel ranks (ranks that read different samples).
            cp: Context-parallel ranks (ranks that split one sequence).
            ep: Expert-parallel ranks (data-parallel ranks that split each MoE layer's experts); divides dp.
        """
        if min(dp, cp, ep) < 1 or dp % ep or (ep > 1 and cp > 1):
            raise ValueError(f"ParallelDims(dp={dp}, cp={cp}, ep={ep}) is not a layout: use ParallelDims.resolve")
        self.dp, self.cp, self.ep = dp, cp, ep
        self.mesh: Any = None  # a DeviceMesh once built (`build_mesh`) or given (`from_mesh`)
        self._flat: dict[str, DeviceMesh] = {}  # flattened meshes, made on first use (it makes process groups)
        self._all_data_parallel = False  # a mesh from elsewhere: every dimension is data-parallel

    def __repr__(self) -> str:
        return f"ParallelDims(dp={self.dp}, cp={self.cp}, ep={self.ep})"

    # ---- sizes ---------------------------------------------------------------------------------------------
    @classmethod
    def resolve(cls, world_size: int, data_parallel_size: str | int = "auto", context_parallel_size: int = 1,
                expert_parallel_size: int = 1) -> ParallelDims:
        """The sizes for `world_size` ranks from the strategy's options; a `ConfigError` names the one at fault."""
        cp, ep = context_parallel_size, expert_parallel_size
        world = WORLD.format(world=world_size)
        if world_size % cp:
            raise ConfigError("context_parallel_size", cp, f"does not divide the {world}")
        dp = world_size // cp if data_parallel_size == "auto" else data_parallel_size
        if dp * cp != world_size:
            raise ConfigError("data_parallel_size", dp, f"times `context_parallel_size={cp}` is {dp * cp}, "
                                                        f"not the {world}")
        cls.check_combination(cp, ep)
        if dp % ep:
            raise ConfigError("expert_parallel_size", ep, f"does not divide the data-parallel size {dp} "
                                                          f"({world})")
        return cls(dp, cp, ep)

    @staticmethod
    def check_combination(context_parallel_size: int, expert_parallel_size: int) -> None:
        """The sizes that cannot run together whatever the world size (the strategy checks at construction)."""
        if expert_parallel_size > 1 and context_parallel_size > 1:
            raise ConfigError("expert_parallel_size", expert_parallel_size, "cannot be combined with "
                              f"`context_parallel_size={context_parallel_size}` yet: use one of them")

    @property
    def world_size(self) -> int:
        """Ranks in the mesh: dp x cp (expert parallelism splits dp, it adds no ranks)."""
        return self.dp * self.cp

    @property
    def dp_mod_ep(self) -> int:
        """Expert groups: data-parallel ranks that hold the same experts (dp / ep)."""
        return self.dp // self.ep

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        """The DeviceMesh's shape, in the order of `mesh_dim_names`."""
        return (self.dp, self.cp) if self.ep == 1 else (self.dp_mod_ep, self.ep, self.cp)

    @property
    def mesh_dim_names(self) -> tuple[str, ...]:
        """The DeviceMesh's dimension names."""
        return (self.DP, self.CP) if self.ep == 1 else (self.DP_MOD_EP, self.EP, self.CP)

    # ---- the mesh ------------------------------------------------------------------------------------------
    def build_mesh(self, device_type: str) -> DeviceMesh:
        """Build (once per process group) and keep the DeviceMesh; returns it."""
        from torch.distributed.device_mesh import init_device_mesh

        self.mesh = init_device_mesh(device_type, self.mesh_shape, mesh_dim_names=self.mesh_dim_names)
        self._flat.clear()
        return self.mesh

    @classmethod
    def from_mesh(cls, mesh: DeviceMesh) -> ParallelDims:
        """The dims of a mesh: one this class built, or any other (e.g. a LightningModule's own, or a 1-D mesh),
        all of whose dimensions are then data-parallel."""
        names = tuple(mesh.mesh_dim_names or ())
        cp = mesh[cls.CP].size() if cls.CP in names else 1
        if cls.EP in names:
            dims = cls(mesh[cls.DP_MOD_EP].size() * mesh[cls.EP].size(), cp, mesh[cls.EP].size())
        elif cls.DP in names and cls.CP in names and len(names) == 2:
            dims = cls(mesh[cls.DP].size(), cp)
        elif names == (cls.CP,):  # a ring's own 1-D mesh
            dims = cls(1, cp)
        else:
            dims = cls(mesh.size())
            dims._all_data_parallel = True
        dims.mesh = mesh
        return dims

    def _built(self) -> DeviceMesh:
        if self.mesh is None:
            raise RuntimeError(f"{self!r} has no mesh yet: call build_mesh() (the strategy does, in setup_environment)")
        return self.mesh

    def _flat_mesh(self, name: str, dims: tuple[str, ...]) -> DeviceMesh:
        if name not in self._flat:
            self._flat[name] = flatten_mesh(self._built(), name, dims)
        return self._flat[name]

    @property
    def dp_mesh(self) -> DeviceMesh:
        """The data-parallel ranks (the sampler splits samples over these; CP peers share a rank here)."""
        if self._all_data_parallel:
            return self.fsdp_mesh
        if self.ep == 1:
            return self._built()[self.DP]
        return self._flat_mesh(self.DP, (self.DP_MOD_EP, self.EP))

    @property
    def cp_mesh(self) -> DeviceMesh:
        """The context-parallel ranks that split one sequence (the ring runs over these)."""
        if self._all_data_parallel:
            raise RuntimeError(f"{self!r} was read from a mesh without a {self.CP!r} dimension")
        return self._built()[self.CP]

    @property
    def fsdp_mesh(self) -> DeviceMesh:
        """Every rank, one dimension: FSDP2 shards the non-expert weights (and gathers them) over it."""
        return self._flat_mesh(self.FSDP, self._built().mesh_dim_names)

    @property
    def ep_mesh(self) -> DeviceMesh:
        """The ranks of this rank's expert group, which split each MoE layer's experts (all-to-all over these)."""
        if self.ep == 1:
            raise RuntimeError(f"{self!r} has no expert-parallel dimension")
        return self._built()[self.EP]

    @property
    def expert_replicas_mesh(self) -> DeviceMesh:
        """The ranks holding the same experts as this one (one per expert group): expert gradients sum over these."""
        if self.ep == 1:
            raise RuntimeError(f"{self!r} has no expert-parallel dimension")
        return self._built()[self.DP_MOD_EP]


def check_expert_parallel(ep: int, config: Any, lora: dict[str, Any] | None = None,
                          option: str = "expert_parallel_size") -> None:
    """`expert_parallel_size` against a model's (text) config, a MoE model whose expert count it divides (None: not
    known before the model is built; `parallelize` checks the model then), and its LoRA options (`model.lora`)."""
    if ep == 1:
        return
    if lora and lora.get("target_parameters"):
        raise ConfigError(option, ep, "is not supported with LoRA on the expert stacks (`model.lora.target_parameters`) "
                                      "yet: train the experts' base weights, or leave expert_parallel_size at 1")
    if config is None:
        return
    if not getattr(config, "enable_moe_block", False):
        raise ConfigError(option, ep, f"needs a MoE model (enable_moe_block); {type(config).__name__} is dense")
    experts = config.num_experts
    if experts % ep:
        raise ConfigError(option, ep, f"does not divide the model's num_experts={experts}: each rank of an expert "
                                      "group owns num_experts / expert_parallel_size experts")


def context_parallel_size(trainer: Any, pl_module: Any) -> int:
    """CP size from the strategy (`context_parallel_size`) or the module's mesh (`ParallelDims.from_mesh`); 1
    without either."""
    size = getattr(trainer.strategy, "context_parallel_size", None)
    if isinstance(size, int):
        return size
    mesh = lightning_compat.module_device_mesh(pl_module)
    return 1 if mesh is None else ParallelDims.from_mesh(mesh).cp
