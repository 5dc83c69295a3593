"""`AttentionPlan`: which attention serves which layer in this run, resolved once and read everywhere.

Owns the one decision three settings used to make separately: the model's `attn_implementation`, the
`FFPAAttention` Callback (its own `attn_implementation` and `sliding` options) and the context-parallel size.
`plan_for(trainer, model)` resolves it once per trainer (the pre-flight checks, the Callback's `setup` and the
module's data checks all get the same object, cached on the model) and raises the user-facing errors for
combinations that cannot run. Does not own the kernels (``registry.py``) nor per-call routing (``backend.py``,
which reads the plan's sliding choice; ``lightning_ffpa.cp.ring``).

The plan:
- CP > 1: the FFPA ring (full layers: ring blocks of `ring_block_ops`; sliding layers: a halo and Flex). It needs
  the Callback, which installs it.
- CP = 1: `attn_implementation` is what HF runs: the Callback's option when the Callback is there, else the
  model's. Under "ffpa", full layers at head_dim 512 run FFPA and sliding layers run `sliding` ("flex").
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

from lightning_ffpa.attention.documents import check_packing

__all__ = ["AttentionPlan", "plan_for", "resolve_plan"]

CALLBACK = "lightning_ffpa.callbacks.FFPAAttention"


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
    """The sliding layers' kernel under "ffpa" (a registry name)."""
    ring_block_ops: str = "ffpa"
    """The ring's full-layer block kernel (a registry name with block ops)."""
    from_callback: bool = False
    """Whether the FFPAAttention Callback is in the run (it installs the plan on the model)."""

    @property
    def ring(self) -> bool:
        """Whether attention runs over the context-parallel ring."""
        return self.cp_size > 1

    @property
    def runs_ffpa_kernels(self) -> bool:
        """Whether the FFPA contract kernels run (the "ffpa" backend, or the ring's blocks): SAC must save them."""
        return self.ring or self.attn_implementation == "ffpa"

    def check_packing(self, pack: bool) -> None:
        """Packed rows need an attention that keeps documents apart (the ring carries them in its layout)."""
        if not self.ring and self.attn_implementation is not None:
            check_packing(self.attn_implementation, pack)

    def describe(self) -> str:
        """One line: the route and its kernels."""
        if self.ring:
            return f"ring CP={self.cp_size}"
        if self.attn_implementation == "ffpa" and self.sliding != "flex":  # the default stays out of the line
            return f"attn_implementation=ffpa, sliding={self.sliding}"
        return f"attn_implementation={self.attn_implementation}"


def resolve_plan(model_attn: str | None, cp_size: int = 1, callback: Any = None) -> AttentionPlan:
    """The plan for a model option, a CP size and the FFPAAttention callback (None: not in the run); raises
    ValueError naming the option for a combination that cannot run."""
    if cp_size > 1 and callback is None:
        if model_attn == "ffpa":
            raise ValueError(f"`model.attn_implementation='ffpa'` is the direct backend, which cannot run with "
                             f"`context_parallel_size={cp_size}`; use attn_implementation=sdpa and add the "
                             f"`{CALLBACK}` callback (it installs the FFPA ring)")
        # each rank would attend only within its own chunks: a wrong model, with no error
        raise ValueError(f"`context_parallel_size={cp_size}` needs the `{CALLBACK}` callback in trainer.callbacks: "
                         "it installs the ring that attends across the ranks' chunks")
    attn = callback.attn_implementation if callback is not None else model_attn
    return AttentionPlan(attn_implementation=attn, cp_size=cp_size, from_callback=callback is not None)


def _attention_callback(trainer: Any) -> Any:
    from lightning_ffpa.callbacks.attention import FFPAAttention

    found = [cb for cb in getattr(trainer, "callbacks", None) or [] if isinstance(cb, FFPAAttention)]
    return found[0] if found else None


def _cp_size(trainer: Any, model: Any) -> int:
    from lightning_ffpa.callbacks.attention import context_parallel_size

    size = context_parallel_size(trainer, model)
    return size if isinstance(size, int) else 1


def plan_for(trainer: Any, model: Any, callback: Any = None) -> AttentionPlan:
    """This run's plan: resolved on the first call for `trainer` and cached on `model`, so every reader gets the
    same object. `callback`: the FFPAAttention instance (found in `trainer.callbacks` when not given)."""
    cached = getattr(model, "_attention_plan", None)
    if cached is not None and cached[0]() is trainer:
        return cached[1]
    hparams = getattr(model, "hparams", None) or {}
    plan = resolve_plan(hparams.get("attn_implementation"), _cp_size(trainer, model),
                        callback if callback is not None else _attention_callback(trainer))
    try:
        model._attention_plan = (weakref.ref(trainer), plan)
    except (AttributeError, TypeError):  # a model or trainer that takes no attribute / weak reference: no cache
        pass
    return plan
