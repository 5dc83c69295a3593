"""`AttentionPlan`: which attention serves which layer in this run, resolved once and read everywhere.

Owns the one decision three settings used to make separately: the model's `attn_implementation`, the
`FFPAAttention` Callback (its own `attn_implementation` and `sliding` options) and the context-parallel size.
`plan_for(trainer, model, cp_size)` resolves it once per trainer (the pre-flight checks, the Callback's `setup` and the
module's data checks all get the same object, cached on the model) and raises the user-facing errors for
combinations that cannot run. Does not own the kernels (``registry.py``) nor per-call routing (``backend.py``,
which reads the plan's sliding choice; ``lightning_ffpa.cp.ring``).

The plan:
- CP > 1: the FFPA ring (the Callback's `attn_implementation` must be "ffpa", its default; full layers: ring blocks of the registry's "ffpa" block ops; sliding layers: a halo and
  one local call, Flex, or FA4's varlen kernel over the chunk's documents under `sliding: fa4 | auto`). It needs
  the Callback, which installs it.
- CP = 1: `attn_implementation` is what HF runs: the Callback's option when the Callback is there, else the
  model's. Under "ffpa", full layers at head_dim 512 run FFPA and sliding layers run `sliding`: "auto" (default:
  FA4 where a call can take it, else Flex, each fallback counted and warned about once per reason by the backend;
  measured against Flex in docs/performance.md), "fa4" (flash-attn-4; refused here
  with one line where it cannot run) or "flex".
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch

from lightning_ffpa._compat.transformers import attention_names, text_config
from lightning_ffpa.attention import fa4, registry
from lightning_ffpa.attention.documents import check_packing
from lightning_ffpa.errors import ConfigError

__all__ = ["DEFAULT_SLIDING", "SLIDING", "AttentionPlan", "plan_for", "resolve_plan"]

CALLBACK = "lightning_ffpa.callbacks.FFPAAttention"
SLIDING = ("flex", "fa4", "auto")
DEFAULT_SLIDING = "auto"  # the Callback's default; the start-up line names any other choice
SLIDING_OPTION = "FFPAAttention.sliding"
PLAN_OWNER = "installs_attention_plan"  # the class attribute that marks the FFPAAttention Callback


@dataclass(frozen=True)
class AttentionPlan:
    """Which attention serves which layer: made once at setup (`plan_for`), read by the module, the Callback and
    the pre-flight checks."""

    attn_implementation: str | None
    """The HF attention implementation at CP = 1 ("ffpa", "sdpa", "eager", ...; None: a model without the option);
    at CP > 1 the ring replaces it."""
    cp_size: int = 1
    """Context-parallel size; > 1 runs the FFPA ring."""
    sliding: str = "flex"
    """The sliding layers' kernel under "ffpa", as asked: "flex", "fa4" or "auto" (`SLIDING`); without the Callback,
    the backend's own "flex" (the Callback's default is `DEFAULT_SLIDING`)."""
    from_callback: bool = False
    """Whether the FFPAAttention Callback is in the run (it installs the plan on the model)."""

    @property
    def option(self) -> str:
        """The option that chose `attn_implementation`, as errors name it."""
        return "FFPAAttention.attn_implementation" if self.from_callback else "model.attn_implementation"

    @property
    def ring(self) -> bool:
        """Whether attention runs over the context-parallel ring."""
        return self.cp_size > 1

    @property
    def sliding_kernel(self) -> str:
        """The registry kernel the backend tries first for sliding layers ("flex" or "fa4")."""
        return "flex" if self.sliding == "flex" else "fa4"

    @property
    def ring_sliding_backend(self) -> str | None:
        """The ring's sliding-layer local call (`cp.sliding`): None (Flex on CUDA), "fa4" or "auto"."""
        return None if self.sliding == "flex" else self.sliding

    def check_packing(self, pack: bool) -> None:
        """Packed rows need an attention that keeps documents apart (the ring carries them in its layout)."""
        if not self.ring and self.attn_implementation is not None:
            check_packing(self.attn_implementation, pack, self.option)

    def describe(self) -> str:
        """One line: the route and its kernels."""
        if self.ring:
            return f"ring CP={self.cp_size}" + (f", sliding={self.sliding}" if self.sliding != DEFAULT_SLIDING else "")
        if self.attn_implementation == "ffpa" and self.sliding != DEFAULT_SLIDING:  # the default stays out of the line
            return f"attn_implementation=ffpa, sliding={self.sliding}"
        return f"attn_implementation={self.attn_implementation}"


def _fa4_refusal(device: torch.device | None, head_dim: int | None) -> str:
    """Why an explicit `sliding: fa4` cannot run here ('' when it can)."""
    kernel = registry.get("fa4")
    lo, hi = kernel.head_dims
    if head_dim is not None and not (lo <= head_dim <= hi and head_dim % kernel.head_dim_multiple == 0):
        return f"the sliding layers' head_dim={head_dim} is outside FA4's {lo}-{hi} (multiples of 8)"
    if kernel.unavailable(device):
        return fa4.unavailable_detail(device) or kernel.unavailable(device)
    if head_dim is not None and not kernel.head_dim_rule(head_dim, device):
        return f"FA4 has no kernel for the sliding layers' head_dim={head_dim} on {device} (SM100: 8-128 or 256)"
    return ""


# HF names plus ours; anything else registered in transformers' AttentionInterface is accepted too.
KNOWN_ATTN = ("sdpa", "eager", "flex_attention", "ffpa")


def registered_attention() -> set[str]:
    """The names a model can train with: ours and transformers' registered ones, less the paged ones, which
    serve generation from a KV cache (HF's `paged|*`, and the rollout engine's own)."""
    return set(KNOWN_ATTN) | {n for n in attention_names() if "paged" not in n}


def check_attn_name(attn: str) -> None:
    """`FFPAAttention.attn_implementation` must name a registered attention (HF raised it after the build)."""
    if attn not in (known := registered_attention()):
        raise ConfigError("FFPAAttention.attn_implementation", attn, f"is unknown; choose one of {sorted(known)}")


def resolve_plan(model_attn: str | None, cp_size: int = 1, callback: Any = None, device: torch.device | None = None,
                 sliding_head_dim: int | None = None) -> AttentionPlan:
    """The plan for a model option, a CP size and the FFPAAttention callback (None: not in the run) on `device`
    (whose sliding layers have `sliding_head_dim`); raises ValueError / ConfigError naming the option for a
    combination that cannot run."""
    if cp_size > 1 and callback is None:
        if model_attn == "ffpa":
            raise ValueError(f"`model.attn_implementation='ffpa'` is the direct backend, which cannot run with "
                             f"`context_parallel_size={cp_size}`; use attn_implementation=sdpa and add the "
                             f"`{CALLBACK}` callback (it installs the FFPA ring)")
        # each rank would attend only within its own chunks: a wrong model, with no error
        raise ValueError(f"`context_parallel_size={cp_size}` needs the `{CALLBACK}` callback in trainer.callbacks: "
                         "it installs the ring that attends across the ranks' chunks")
    attn = callback.attn_implementation if callback is not None else model_attn
    if callback is not None:
        check_attn_name(attn)
    if callback is not None and cp_size > 1 and attn != "ffpa":  # the ring runs FFPA blocks: the choice would vanish
        raise ConfigError("FFPAAttention.attn_implementation", attn, f"context_parallel_size={cp_size} runs the FFPA "
                          f"ring, which cannot run {attn!r}; leave it at 'ffpa' (the default), or compare at "
                          "context_parallel_size 1")
    # without the Callback nothing installs a sliding kernel: the "ffpa" backend runs its own default, Flex
    sliding = getattr(callback, "sliding", DEFAULT_SLIDING) if callback is not None else "flex"
    if callback is not None and sliding != DEFAULT_SLIDING and cp_size == 1 and attn != "ffpa":  # else ignored
        raise ConfigError(SLIDING_OPTION, sliding, f"applies to the 'ffpa' backend or the ring (context_parallel_size "
                          f"> 1), and this run has attn_implementation={attn!r}, which runs every layer itself; "
                          "leave it unset")
    if sliding == "fa4":
        why = _fa4_refusal(device, sliding_head_dim)
        if why:
            raise ConfigError(SLIDING_OPTION, sliding, f"flash-attn-4 cannot run here ({why}); use 'auto' (FA4 where "
                              "it runs, else Flex, counted) or 'flex'")
    return AttentionPlan(attn_implementation=attn, cp_size=cp_size, sliding=sliding, from_callback=callback is not None)


def _attention_callback(trainer: Any) -> Any:
    # the FFPAAttention Callback marks itself (`PLAN_OWNER`): this package does not import the callbacks
    found = [cb for cb in getattr(trainer, "callbacks", None) or [] if getattr(cb, PLAN_OWNER, False)]
    return found[0] if found else None


def _sliding_head_dim(model: Any) -> int | None:
    """head_dim of the model's first sliding layer (None: no config or no sliding layer)."""
    config = getattr(model, "config", None)
    if config is None:
        return None
    text = text_config(config)
    # Gemma4 configs hold head_dim per layer (reading the global value raises where layers differ).
    for layer, kind in zip(getattr(text, "per_layer_config", None) or (), getattr(text, "layer_types", None) or ()):
        if kind == "sliding_attention":
            return getattr(layer, "head_dim", None)
    return None


def _device(trainer: Any) -> torch.device | None:
    """The device this process will train on (the strategy's root device), or None where it cannot say yet."""
    try:
        return trainer.strategy.root_device
    except Exception:  # noqa: BLE001 - a stand-in trainer or a strategy not set up: the current CUDA device counts
        return None


def plan_for(trainer: Any, model: Any, cp_size: int, callback: Any = None) -> AttentionPlan:
    """This run's plan: resolved on the first call for `trainer` and cached on `model`, so every reader gets the
    same object. `cp_size`: the run's context-parallel size (`parallel.dims.context_parallel_size`); `callback`:
    the FFPAAttention instance (found in `trainer.callbacks` when not given)."""
    cached = getattr(model, "_attention_plan", None)
    if cached is not None and cached[0]() is trainer:
        return cached[1]
    hparams = getattr(model, "hparams", None) or {}
    plan = resolve_plan(hparams.get("attn_implementation"), cp_size,
                        callback if callback is not None else _attention_callback(trainer),
                        _device(trainer), _sliding_head_dim(model))
    try:
        model._attention_plan = (weakref.ref(trainer), plan)
    except (AttributeError, TypeError):  # a model or trainer that takes no attribute / weak reference: no cache
        pass
    return plan
