"""Weight sync from the training model into the rollout engine's inference copy, without drift: the
`weights="merged"` option of `RolloutCallback` (the default, `shared`, reads the policy's tensors: `shared_weights.py`).

Owns the name mapping (training names -> inference names: wrapper levels removed, then `lora.hf_name`) and the
in-place refresh W = W0 + s * B @ A (`lora.merged_weight(out=W)`), where W0 is the training model's frozen base weight: the base is
only ever read, so it cannot drift, and in-place writes keep captured CUDA graphs valid.
Under FSDP2 each parameter is gathered with `full_tensor()` one at a time and freed right after, so no
second full copy stays resident. It does not run generation.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
from torch import nn

from lightning_ffpa._compat.torch import without_wrapper_levels
from lightning_ffpa.fp8_base import as_dtype
from lightning_ffpa.lora import hf_name, merged_weight


def _full(t: torch.Tensor) -> torch.Tensor:
    """The full tensor behind a (possibly FSDP2-sharded DTensor) parameter."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _infer_name(train_name: str) -> str:
    # the training side may wrap modules (activation checkpointing, torch.compile); the inference copy does not
    return hf_name(without_wrapper_levels(train_name))


_DIGEST_CHUNK = 1 << 26  # words per step: bounds the int64 staging copy (512 MiB)


@torch.no_grad()
def tensor_digest(tensors) -> str:
    """sha256 over per-tensor checksums computed where the tensors live: for each tensor its shape, dtype and the
    sums of its bit patterns (as 16-bit words, bytes for 1-byte dtypes), of their squares and of each word times its
    position mod 65521, in int64. Any changed bit changes a sum; the position term catches moved values. On the
    GPU a 60 GB base takes well under a second, where hashing its bytes on the host took minutes."""
    h = hashlib.sha256()
    for t in tensors:
        flat = _full(t).detach().reshape(-1)
        words = flat.view(torch.int16) if flat.element_size() % 2 == 0 else flat.view(torch.uint8)
        sums = torch.zeros(3, dtype=torch.int64, device=words.device)
        for start in range(0, words.numel(), _DIGEST_CHUNK):
            w = words[start:start + _DIGEST_CHUNK].to(torch.int64)
            pos = torch.arange(start, start + w.numel(), device=w.device, dtype=torch.int64) % 65521 + 1
            sums += torch.stack([w.sum(), (w * w).sum(), (w * pos).sum()])
        h.update(f"{tuple(t.shape)}|{t.dtype}|{sums.tolist()}".encode())
    return h.hexdigest()


_Source = nn.Parameter | tuple[nn.Parameter, nn.Parameter, nn.Parameter, float]  # a weight, or (W0, A, B, scale)


def _sources(train: nn.Module) -> dict[str, _Source]:
    """Inference name -> what it is refreshed from: a LoRA target's (W0, A, B, scale), or a training weight.

    Tied weights are listed under each of their names (`remove_duplicate=False`): a tied head whose training
    side diverged (a LoRA target, a `modules_to_save` copy) needs its own source. A `modules_to_save` module's
    frozen `original_module` is not a source: its trained copy is what runs."""
    loras: dict[str, _Source] = {}  # the adapted tensor's training name -> its source
    base_names: set[str] = set()  # the training names of those tensors (and a float8 W0's scales)
    for name, module in train.named_modules():
        if not (hasattr(module, "lora_A") and hasattr(module, "base_layer")):
            continue
        (adapter,) = module.active_adapters
        if getattr(module, "use_dora", {}).get(adapter, False):
            raise ValueError(f"{name}: DoRA adapters are not supported by the in-place LoRA refresh")
        parameter = getattr(module, "parameter_name", None)
        if parameter is not None:  # peft's ParamWrapper (`target_parameters`): a 3-D expert stack; nested ones
            owner, owner_name = module.base_layer, f"{name}.base_layer"  # wrap each other; the innermost wraps
            while getattr(owner, "parameter_name", None) is not None:  # the experts module
                owner, owner_name = owner.base_layer, f"{owner_name}.base_layer"
            base, key, base_name = getattr(owner, parameter), f"{name}.{parameter}", f"{owner_name}.{parameter}"
        else:
            base, key, base_name = module.base_layer.weight, f"{name}.weight", f"{name}.base_layer.weight"
        loras[key] = (base, module.lora_A[adapter].weight, module.lora_B[adapter].weight, float(module.scaling[adapter]))
        base_names.update({base_name, base_name + "_scale"})  # a float8 W0's scales go with W0
    sources: dict[str, _Source] = {}
    origin: dict[str, str] = {}
    for name, p in train.named_parameters(remove_duplicate=False):
        if "lora_" in name or ".original_module." in name or name in base_names:
            continue
        key = _infer_name(name)
        if key in origin:
            raise ValueError(f"{origin[key]} and {name} both map to {key!r}: one active adapter per model")
        sources[key], origin[key] = p, name
    for name, source in loras.items():
        sources[_infer_name(name)] = source
    return sources


def _targets(inference: nn.Module, sources: dict[str, _Source]) -> dict[str, torch.Tensor]:
    """Inference name -> the tensor the refresh writes. Weights the inference copy ties (the embedding and the
    head) stay tied, written once, while the training side feeds them from one tensor; otherwise the copy
    unties them, as training did (e.g. LoRA on a tied `lm_head`)."""
    params = dict(inference.named_parameters(remove_duplicate=False))
    missing = [k for k in sources if k not in params]
    if missing:
        raise KeyError(f"training weights without an inference counterpart: {missing}")
    targets: dict[str, torch.Tensor] = {}
    written: dict[int, _Source] = {}  # id(inference tensor) -> its source
    for key, source in sources.items():
        target = params[key]
        if id(target) not in written:
            written[id(target)], targets[key] = source, target
            continue
        if written[id(target)] is source:  # tied on both sides: written once
            continue
        module_name, _, attr = key.rpartition(".")
        untied = nn.Parameter(target.detach().clone(), requires_grad=False)
        setattr(inference.get_submodule(module_name), attr, untied)
        targets[key] = untied
    return targets


@dataclass
class _LoraPair:
    target: torch.Tensor  # inference weight (out, in)
    base: nn.Parameter  # training base weight W0 (frozen)
    a: nn.Parameter  # (r, in)
    b: nn.Parameter  # (out, r)
    scale: float


class LoraSync:
    """Refreshes `inference` from `train` (a peft LoRA model, or a plain model for full fine-tuning)."""

    def __init__(self, train: nn.Module, inference: nn.Module) -> None:
        self.train, self.inference = train, inference
        sources = _sources(train)
        targets = _targets(inference, sources)
        self.pairs: list[_LoraPair] = [_LoraPair(targets[k], *src) for k, src in sources.items()
                                       if isinstance(src, tuple) and k in targets]
        self.copies: list[tuple[torch.Tensor, nn.Parameter]] = [
            (targets[k], src) for k, src in sources.items() if not isinstance(src, tuple) and k in targets]
        # Persistent buffers too (Gemma4's `layer_scalar` comes from the checkpoint): a fresh model's are defaults.
        train_buffers = {_infer_name(n): b for n, b in train.named_buffers(remove_duplicate=False)}
        self.buffers = [(b, train_buffers[k]) for k, b in inference.named_buffers(remove_duplicate=False)
                        if k in train_buffers]
        self.num_refreshes = 0

    @property
    def trains_base(self) -> bool:
        """Whether any non-LoRA parameter trains (then `refresh` must copy it every time)."""
        return any(p.requires_grad for _, p in self.copies)

    @torch.no_grad()
    def refresh(self, full: bool = False) -> None:
        """Rewrite LoRA targets as W0 + s*B@A; copy other parameters when `full` or when they train."""
        for pair in self.pairs:
            w0 = as_dtype(_full(pair.base), pair.target.dtype)  # a float8 W0 dequantised
            a = _full(pair.a).to(pair.target.dtype)
            b = _full(pair.b).to(pair.target.dtype)
            merged_weight(w0, a, b, pair.scale, out=pair.target)
            del w0, a, b  # gathered shards die here; nothing extra stays resident
        if full or self.trains_base:
            for target, src in self.copies:
                target.copy_(_full(src))
        if full:
            for target, src in self.buffers:
                target.copy_(src)
        self.num_refreshes += 1

    # ---- drift verification ---------------------------------------------------------------------
    def base_digest(self) -> str:
        """`tensor_digest` of every frozen base weight the refresh reads."""
        return tensor_digest([p.base for p in self.pairs] + [p for _, p in self.copies if not p.requires_grad])

    def inference_digest(self) -> str:
        """`tensor_digest` of the inference copy's parameters."""
        return tensor_digest(list(self.inference.parameters()))

    def verify_no_drift(self, num_refreshes: int = 3) -> dict[str, str]:
        """Refresh `num_refreshes` times around a perturbation of A/B; raise unless the base hash is unchanged
        and the inference copy is bit-identical once A/B are restored (`check_no_drift`)."""
        return check_no_drift(self, num_refreshes)


@torch.no_grad()
def check_no_drift(sync, num_refreshes: int = 3) -> dict[str, str]:
    """Refresh `sync` (a `LoraSync` or `shared_weights.SharedWeights`) `num_refreshes` times around a perturbation
    of its adapters (stand-ins for optimizer steps); raise unless `base_digest()` (W0) is unchanged and
    `inference_digest()` (what the engine owns) is bit-identical once the adapters are restored."""
    if not sync.pairs:
        raise ValueError("verify_no_drift needs LoRA adapters: without them there is no frozen base to check")
    base0 = sync.base_digest()
    saved = [(p.a.detach().clone(), p.b.detach().clone()) for p in sync.pairs]
    sync.refresh(full=True)
    infer0 = sync.inference_digest()
    for i in range(num_refreshes):
        for p in sync.pairs:
            p.a.add_(torch.randn_like(p.a) * 1e-2)
            p.b.add_(torch.randn_like(p.b) * 1e-2 + (1e-2 if i == 0 else 0.0))
        sync.refresh()
    for p, (a, b) in zip(sync.pairs, saved):
        p.a.copy_(a)
        p.b.copy_(b)
    sync.refresh()
    base1, infer1 = sync.base_digest(), sync.inference_digest()
    if base1 != base0:
        raise RuntimeError(f"base weights drifted over {num_refreshes} refreshes: {base0} -> {base1}")
    if infer1 != infer0:
        raise RuntimeError(f"inference copy not deterministic after restoring A/B: {infer0} -> {infer1}")
    return {"base_sha256": base1, "inference_sha256": infer1}
