"""The rollout engine's weights: the policy's own tensors (`shared`) or a full merged copy (`merged`).

Owns the choice between the two (`WeightsPlan`: what each tensor of the engine's model will be, and its bytes,
before anything is allocated), building the engine's model from the plan, and the refresh of what the engine
owns (`SharedWeights`).

Shared: the engine's model is built on the meta device and its parameters are pointed at the policy's tensors
(the same storage) wherever the policy's tensor is frozen, a plain tensor (not an FSDP2 DTensor), on the
engine's device and in its dtype. LoRA targets become `LoraLinear`s over the policy's W0 (`lora_linear.py`): the
adapters are applied unmerged, from buffers a refresh fills in place; an adapted MoE expert stack is read in place
too, its adapter applied unmerged in the experts' grouped GEMMs from an `experts.StackAdapter`. With `fuse`, the q/k/v and gate/up base
weights of each layer are moved into one tensor per group on the policy's side (its Parameters keep their
identity; their `.data` become row views, as `fused_linear.py` does for a copy), so a group's W0 is one tensor and
its adapters one A-GEMM. What cannot be aliased (weights the policy trains: `modules_to_save`, a full fine-tune;
another dtype or device) gets a tensor of its own, copied at refresh (a LoRA target there: merged, W0 + s*B@A),
and is counted with the reason. A float8 W0 (`model.lora.base_dtype: fp8`) is aliased with its rowwise scales
(its rows fused as W0's are) and read by `LoraGroup` through the policy's float8 matmul; a merged copy dequantises it. `path` says what ran; nothing falls back silently.

Merged: `lora_sync.py`'s inference copy, a second full model. Under FSDP2 without `replicate_frozen` the frozen
base is sharded: nothing can alias it, so a `shared` request plans the merged copy and its path says why.
Does not run generation, and does not own the name mapping from training to inference names (`lora_sync.py`).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from lightning_ffpa.experts import EXPERT_STACKS, StackAdapter, serve_adapters, unsupported
from lightning_ffpa.fp8_base import as_dtype, scale_of
from lightning_ffpa.lora import merged_weight, unwrap_peft
from lightning_ffpa.rollout.fused_linear import GROUPS, SHARED_MARK
from lightning_ffpa.rollout.lora_linear import LoraGroup, LoraLinear
from lightning_ffpa.rollout.lora_sync import (
    LoraSync,
    _full,
    _infer_name,
    _sources,
    check_no_drift,
    tensor_digest,
)

WeightsMode = Literal["shared", "merged"]
WEIGHTS_MODES = ("shared", "merged")
SHARDED = ("the frozen base is sharded (FSDP2 without replicate_frozen): nothing can alias it; "
           "FSDP2Strategy(replicate_frozen=true) keeps it whole on every rank, and the engine then reads it")


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def human_bytes(n: int) -> str:
    """GiB above 1 GiB, else MiB."""
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _is_dtensor(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def why_not_alias(t: torch.Tensor, dtype: torch.dtype, device: torch.device | None) -> str | None:
    """Why the engine cannot read `t` as it is (None: it can). `device` None: not checked (a plan on meta)."""
    if _is_dtensor(t):
        return "sharded (DTensor)"
    if t.requires_grad:
        return "trained by the policy"
    if t.dtype != dtype and scale_of(t) is None:  # a float8 W0 is read with its scales, in any engine dtype
        return f"{t.dtype} where the engine runs {dtype}"
    if device is not None and t.device != device:
        return f"on {t.device}, the engine on {device}"
    return None


def meta_model(base: nn.Module, dtype: torch.dtype) -> nn.Module:
    """A fresh model of `base`'s class and config (no LoRA layers) on the meta device, in `dtype`."""
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            return type(base)(base.config)
    finally:
        torch.set_default_dtype(saved)


def fuse_rows(params: list[torch.Tensor]) -> torch.Tensor:
    """One tensor whose row blocks are `params`, in order: their own storage when they already are such blocks,
    else a new one they move into (`.data` becomes a row view; the Parameters keep their identity)."""
    first, total = params[0], sum(p.shape[0] for p in params)
    offsets = [p.storage_offset() for p in params]
    adjacent = (all(p.is_contiguous() and p.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
                    for p in params)
                and all(offsets[i + 1] == offsets[i] + params[i].numel() for i in range(len(params) - 1)))
    if adjacent:  # fused before (a second engine on the same policy): read the rows where they are
        out = torch.empty(0, dtype=first.dtype, device=first.device)
        return out.set_(first.untyped_storage(), first.storage_offset(), (total, *first.shape[1:]))
    buf = torch.cat([p.detach() for p in params])  # (total, ...); the old storages die with the swap below
    lo = 0
    with torch.no_grad():
        for p in params:
            p.data = buf[lo:lo + p.shape[0]]
            lo += p.shape[0]
    return buf


@dataclass
class _GroupPlan:
    name: str
    parent: nn.Module  # the engine model's module holding the members
    attrs: list[str]
    sources: list  # per member: a training weight, or (W0, A, B, scale)
    biases: list | None  # per member: its bias's training tensor, or None without biases

    @property
    def bases(self) -> list[torch.Tensor]:
        return [s[0] if isinstance(s, tuple) else s for s in self.sources]

    @property
    def ranks(self) -> list[int]:
        return [s[1].shape[0] if isinstance(s, tuple) else 0 for s in self.sources]


class WeightsPlan:
    """What every tensor of the engine's model will be, and the bytes it owns, before anything is allocated."""

    def __init__(self, train: nn.Module, mode: WeightsMode, dtype: torch.dtype, device: torch.device | None,
                 fuse: bool = True) -> None:
        """`device` None plans without the device check (the Callback's pre-flight, on a meta policy)."""
        # "cuda" names the current GPU, whose tensors say "cuda:0": compare the device a tensor would get
        device = None if device is None else torch.empty(0, device=device).device
        self.train, self.dtype, self.device, self.fuse = train, dtype, device, fuse
        self.requested, self.why = mode, ""
        self.meta = meta_model(unwrap_peft(train), dtype)
        self.sources = _sources(train)
        names = {n for n, _ in self.meta.named_parameters(remove_duplicate=False)}
        missing = [k for k in self.sources if k not in names]
        if missing:
            raise KeyError(f"training weights without an inference counterpart: {missing}")
        frozen = [s[0] if isinstance(s, tuple) else s for s in self.sources.values()]
        self.mode = mode
        if mode == "shared" and any(_is_dtensor(t) and not t.requires_grad for t in frozen):
            self.mode, self.why = "merged", SHARDED
        self.groups: list[_GroupPlan] = []
        self.aliases: dict[str, torch.Tensor] = {}
        self.copies: dict[str, torch.Tensor] = {}
        self.merged: dict[str, tuple] = {}
        self.stacks: dict[str, tuple] = {}  # adapted expert stacks read in place, adapters applied unmerged
        self.own_why: Counter[str] = Counter()  # reason -> bytes the engine owns for it
        if self.mode == "shared":
            self._plan_shared()

    # ---- planning ----------------------------------------------------------------------------------------
    def _alias_why(self, t: torch.Tensor) -> str | None:
        return why_not_alias(t, self.dtype, self.device)

    def _plan_shared(self) -> None:
        from lightning_ffpa.rollout.walker import _decoder

        names = {id(m): n for n, m in self.meta.named_modules()}
        done: set[str] = set()
        copied: set[int] = set()
        if self.fuse:
            for layer in _decoder(self.meta).layers:
                for parent_name, attrs in GROUPS:
                    parent = getattr(layer, parent_name, None)
                    attrs = [a for a in attrs if isinstance(getattr(parent, a, None), nn.Linear)]
                    if len(attrs) >= 2:
                        self._try_group(names[id(parent)], attrs, done)
        for key, src in self.sources.items():
            if key in done:
                continue
            module_name, _, attr = key.rpartition(".")
            if isinstance(src, tuple):
                module = self.meta.get_submodule(module_name)
                why = self._alias_why(src[0])
                if why is None and attr in EXPERT_STACKS and unsupported(module) is None:
                    self._plan_stack(key, src)
                    continue
                if why is None and not (isinstance(module, nn.Linear) and attr == "weight"):
                    why = f"a LoRA target that is a {type(module).__name__}"
                parent_name, _, leaf = module_name.rpartition(".")
                if why is None and self._try_group(parent_name, [leaf], done):
                    continue
                self.merged[key] = src
                self.own_why[f"merged LoRA targets ({why or 'bias not shared'})"] += _nbytes(self.meta.get_parameter(key))
            elif (why := self._alias_why(src)) is None:
                self.aliases[key] = src
            else:
                self.copies[key] = src
                if id(src) not in copied:  # a weight the policy ties is copied once
                    copied.add(id(src))
                    self.own_why[f"copied ({why})"] += src.numel() * self.dtype.itemsize

    def _plan_stack(self, key: str, src: tuple) -> None:
        """An adapted expert stack: the policy's W0 read in place, its adapter in buffers of the engine's
        (`experts.StackAdapter`), applied unmerged in the experts' grouped GEMMs."""
        w0, a = src[0], src[1]
        self.stacks[key] = src
        self.own_why["expert LoRA A and B buffers"] += (StackAdapter.elements(w0.shape, a.shape[0] // w0.shape[0])
                                                        * self.dtype.itemsize)

    def _try_group(self, parent_name: str, attrs: list[str], done: set[str]) -> bool:
        """Plan the Linears `attrs` of `parent_name` as one `LoraGroup` over the policy's W0 rows; False (nothing
        planned) when a W0 cannot alias or the members' biases differ in kind."""
        parent = self.meta.get_submodule(parent_name)
        prefix = f"{parent_name}." if parent_name else ""
        keys = [f"{prefix}{a}.weight" for a in attrs]
        if any(k not in self.sources or k in done for k in keys):
            return False
        plan = _GroupPlan(prefix + (attrs[0] if len(attrs) == 1 else "+".join(attrs)), parent, attrs,
                          [self.sources[k] for k in keys], None)
        if any(self._alias_why(b) for b in plan.bases) or len({b.dtype for b in plan.bases}) > 1:
            return False  # each member planned alone (e.g. float8 q/v targets beside a k_proj in model.dtype)
        has_bias = [getattr(parent, a).bias is not None for a in attrs]
        bias_keys = [k.removesuffix("weight") + "bias" for k in keys]
        if any(has_bias) and (not all(has_bias) or any(k not in self.sources for k in bias_keys)):
            return False
        if all(has_bias):
            plan.biases = [self.sources[k] for k in bias_keys]
            if any(self._alias_why(b) for b in plan.biases):  # a trained bias: the engine's own rows
                why = next(self._alias_why(b) for b in plan.biases if self._alias_why(b))
                self.own_why[f"copied ({why})"] += sum(b.shape[0] for b in plan.biases) * self.dtype.itemsize
            done.update(bias_keys)
        self.groups.append(plan)
        done.update(keys)
        total_r, out, width = sum(plan.ranks), sum(b.shape[0] for b in plan.bases), plan.bases[0].shape[1]
        if total_r:
            self.own_why["LoRA A and B buffers"] += (total_r * width + out * total_r) * self.dtype.itemsize
        return True

    # ---- bytes ---------------------------------------------------------------------------------------------
    @property
    def own_bytes(self) -> int:
        """Bytes the engine's weights own: the whole model when merged; adapters and copies when shared."""
        if self.mode == "merged":
            return sum(_nbytes(p) for p in self.meta.parameters())
        return sum(self.own_why.values())

    @property
    def aliased_bytes(self) -> int:
        """Bytes of the policy's tensors the engine reads in place (0 when merged): a float8 W0 at its one byte an
        element, with its rowwise scales."""
        seen = {id(t): _nbytes(t) for t in self.aliases.values()}
        seen.update({id(src[0]): _nbytes(src[0]) for src in self.stacks.values()})
        seen.update({id(b): _nbytes(b) for g in self.groups for b in (*g.bases, *(g.biases or ()))
                     if not self._alias_why(b)})
        seen.update({id(s): _nbytes(s) for g in self.groups for b in g.bases if (s := scale_of(b)) is not None})
        return sum(seen.values())

    def describe(self) -> str:
        """One line: what the engine reads from the policy and what it owns, and why."""
        if self.mode == "merged":
            why = f" ({self.why})" if self.why else ""
            return f"merged copy{why}: {human_bytes(self.own_bytes)} own, W0 + s*B@A written at every refresh"
        fused = sum(len(g.attrs) > 1 for g in self.groups)
        own = ", ".join(f"{what} {human_bytes(n)}" for what, n in self.own_why.most_common())
        return (f"shared: {human_bytes(self.aliased_bytes)} read from the policy's tensors"
                f"{f' (base fused in {fused} groups)' if fused else ''}, {human_bytes(self.own_bytes)} own"
                f"{f': {own}' if own else ''}")

    def build(self) -> LoraSync | SharedWeights:
        """Allocate the engine's weights (on `device`) and fill them once; returns the refresher."""
        if self.device is None:
            raise ValueError("a plan made without a device (a pre-flight estimate) cannot be built")
        if self.mode == "merged":
            saved = torch.get_default_dtype()
            torch.set_default_dtype(self.dtype)  # build in the final dtype: no fp32 staging copy of a 31B model
            try:
                with torch.device(self.device):  # a fresh model: no peft modules, weights filled by the sync
                    inference = type(unwrap_peft(self.train))(unwrap_peft(self.train).config)
            finally:
                torch.set_default_dtype(saved)
            sync = LoraSync(self.train, inference.eval().requires_grad_(False))
        else:
            sync = SharedWeights(self)
        sync.refresh(full=True)
        sync.weights_path = self.describe()
        return sync


@dataclass
class _Adapter:
    group: LoraGroup
    index: int
    a: nn.Parameter
    b: nn.Parameter
    scale: float


@dataclass
class _Stack:
    adapter: StackAdapter
    a: nn.Parameter
    b: nn.Parameter


@dataclass
class _Merged:
    target: torch.Tensor
    base: torch.Tensor
    a: nn.Parameter
    b: nn.Parameter
    scale: float


class SharedWeights:
    """The engine's model over the policy's tensors (a `WeightsPlan` in `shared` mode), and its refresh."""

    def __init__(self, plan: WeightsPlan) -> None:
        self.train, self.inference = plan.train, plan.meta
        self.stats = {"aliased_bytes": plan.aliased_bytes, "own_bytes": plan.own_bytes}
        dtype, device = plan.dtype, plan.device
        self.groups: list[LoraGroup] = []
        self.pairs: list[_Adapter | _Stack | _Merged] = []  # every LoRA adapter the refresh writes
        self.copies: list[tuple[torch.Tensor, torch.Tensor]] = []  # (own tensor, training tensor)
        self._aliased: dict[int, tuple[str, torch.Tensor, int]] = {}  # id -> (name, policy tensor, data_ptr)
        for g in plan.groups:
            self._build_group(g, plan)
        self._build_stacks(plan)
        for key, p in plan.aliases.items():
            p.__dict__[SHARED_MARK] = True  # fused_linear never moves it into a buffer of the engine's
            self._set(key, p)
            self._aliased[id(p)] = (key, p, p.data_ptr())
        made: dict[int, nn.Parameter] = {}  # tied weights the policy still ties: one own tensor
        for key, src in plan.copies.items():
            if id(src) not in made:
                made[id(src)] = nn.Parameter(torch.empty(src.shape, dtype=dtype, device=device), requires_grad=False)
                self.copies.append((made[id(src)], src))
            self._set(key, made[id(src)])
        for key, (w0, a, b, scale) in plan.merged.items():
            target = nn.Parameter(torch.empty(w0.shape, dtype=dtype, device=device), requires_grad=False)
            self._set(key, target)
            self.pairs.append(_Merged(target, w0, a, b, scale))
        policy_buffers = {_infer_name(n): b for n, b in self.train.named_buffers(remove_duplicate=False)}
        for key, meta_buf in list(self.inference.named_buffers(remove_duplicate=False)):
            if key not in policy_buffers:
                raise KeyError(f"engine buffer {key!r} has no counterpart in the policy")
            own = torch.empty(meta_buf.shape, dtype=meta_buf.dtype, device=device)  # its own dtype: RoPE stays fp32
            self._set(key, own)
            self.copies.append((own, policy_buffers[key]))
        left = [n for n, t in (*self.inference.named_parameters(), *self.inference.named_buffers()) if t.is_meta]
        if left:
            raise RuntimeError(f"engine weights with no policy source: {left[:5]}")
        self.inference.eval()
        self.num_refreshes = 0
        self.weights_path = ""

    def _set(self, key: str, value: torch.Tensor) -> None:
        module_name, _, attr = key.rpartition(".")
        setattr(self.inference.get_submodule(module_name), attr, value)

    def _build_stacks(self, plan: WeightsPlan) -> None:
        """Each adapted expert stack: the policy's W0 in the engine's experts module, its adapter in a
        `StackAdapter`, served by the unmerged experts forward."""
        served: dict[str, dict[str, StackAdapter]] = {}
        for key, (w0, a, b, scale) in plan.stacks.items():
            module_name, _, attr = key.rpartition(".")
            self._set(key, w0)
            self._aliased[id(w0)] = (key, w0, w0.data_ptr())
            experts, out_features, in_features = w0.shape
            adapter = StackAdapter(experts, a.shape[0] // experts, in_features, out_features, scale, plan.dtype,
                                   plan.device)
            served.setdefault(module_name, {})[attr] = adapter
            self.pairs.append(_Stack(adapter, a, b))
        for module_name, adapters in served.items():
            serve_adapters(self.inference.get_submodule(module_name), adapters)

    def _build_group(self, g: _GroupPlan, plan: WeightsPlan) -> None:
        bases = g.bases
        weight = fuse_rows(bases) if len(bases) > 1 else bases[0]
        scales = [scale_of(b) for b in bases]  # a float8 W0's rowwise scales, fused as its rows are
        scale = None if scales[0] is None else fuse_rows(scales) if len(scales) > 1 else scales[0]
        for i, p in enumerate(bases):
            self._aliased[id(p)] = (f"{g.name}[{i}]", p, p.data_ptr())
        bias = None
        if g.biases is not None:
            if not any(plan._alias_why(b) for b in g.biases):
                bias = fuse_rows(g.biases) if len(g.biases) > 1 else g.biases[0]
                self._aliased.update({id(b): (f"{g.name}.bias[{i}]", b, b.data_ptr()) for i, b in enumerate(g.biases)})
            else:  # a trained bias: the engine's own rows, copied at refresh
                bias = torch.empty(sum(b.shape[0] for b in g.biases), dtype=plan.dtype, device=plan.device)
                lo = 0
                for b in g.biases:
                    self.copies.append((bias[lo:lo + b.shape[0]], b))
                    lo += b.shape[0]
        if scale is not None:
            self._aliased.update({id(s): (f"{g.name}.scale[{i}]", s, s.data_ptr()) for i, s in enumerate(scales)})
        group = LoraGroup(g.name, weight, bias, [b.shape[0] for b in bases], g.ranks, scale, plan.dtype)
        for i, (attr, src) in enumerate(zip(g.attrs, g.sources)):
            setattr(g.parent, attr, LoraLinear(group, i, weight.shape[1]))
            if isinstance(src, tuple):
                self.pairs.append(_Adapter(group, i, src[1], src[2], src[3]))
        self.groups.append(group)

    # ---- refresh -------------------------------------------------------------------------------------------
    def check_aliases(self) -> None:
        """Raise unless every policy tensor the engine reads is still where it was when the engine was built."""
        for name, t, ptr in self._aliased.values():
            if t.data_ptr() != ptr:
                raise RuntimeError(f"the policy's {name} is no longer the tensor the rollout engine reads (moved by "
                                   "`.to()`, or loaded with `load_state_dict(assign=True)`, after the engine was "
                                   "built); build the engine again on the policy as it is now")

    @torch.no_grad()
    def refresh(self, full: bool = False) -> None:
        """Write the adapters into the engine's buffers; copy what the engine owns when `full` or when it trains."""
        self.check_aliases()
        for p in self.pairs:
            if isinstance(p, _Adapter):
                p.group.set_adapter(p.index, _full(p.a), _full(p.b), p.scale)
            elif isinstance(p, _Stack):
                p.adapter.set(_full(p.a), _full(p.b))
            else:
                dt = p.target.dtype
                merged_weight(as_dtype(_full(p.base), dt), _full(p.a).to(dt), _full(p.b).to(dt), p.scale, out=p.target)
        for target, src in self.copies:
            if full or src.requires_grad:
                target.copy_(_full(src))
        self.num_refreshes += 1

    # ---- drift verification --------------------------------------------------------------------------------
    def base_digest(self) -> str:
        """`tensor_digest` of every frozen policy tensor the engine reads or copies: W0 included."""
        read = [t for _, t, _ in self._aliased.values()]
        frozen = [p.base for p in self.pairs if isinstance(p, _Merged)] + [s for _, s in self.copies
                                                                           if not s.requires_grad]
        return tensor_digest(read + frozen)

    def inference_digest(self) -> str:
        """`tensor_digest` of what the engine owns: adapter buffers, copies and merged targets."""
        own = [t for g in self.groups for t in (g.a, g.b) if t is not None]
        own += [t for p in self.pairs if isinstance(p, _Stack) for t in (p.adapter.a, p.adapter.b)]
        own += [p.target for p in self.pairs if isinstance(p, _Merged)] + [t for t, _ in self.copies]
        return tensor_digest(own)

    def verify_no_drift(self, num_refreshes: int = 3) -> dict[str, str]:
        """Refresh around perturbed adapters; raise unless W0's hash is unchanged and the engine's own tensors are
        bit-identical once the adapters are restored (`lora_sync.check_no_drift`)."""
        return check_no_drift(self, num_refreshes)
