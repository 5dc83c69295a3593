"""`FFPAAttention`: a drop-in Callback that installs the run's attention plan on the model.

Owns installing the backend on the HF model and reporting which kernels ran. The plan itself (which
attention serves which layer, from the model's option, this Callback's options and the CP size) is
`lightning_ffpa.attention.plan`, resolved once; the kernels, the "ffpa" HF backend, its mask function and the
dispatch counters live in `lightning_ffpa.attention`; the CP ring lives in `lightning_ffpa.cp.ring`.

- CP = 1: register "ffpa" and set it on the model (full layers at head_dim 512 go to FFPA, sliding
  layers to the plan's `sliding` kernel: Flex through the registered mask function, or FA4).
- CP > 1: keep "sdpa" for HF and install the ring hook over the strategy's context-parallel mesh.
When FFPA kernels will run, their forward ops are declared to the SAC policy (`lightning_ffpa.saved_ops`) in
`setup()`, before the strategy wraps the layers. Works with any strategy: without a device mesh, CP is 1.
"""

from __future__ import annotations

import weakref
from collections import Counter
from typing import Any, Literal

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_ffpa import attention, saved_ops, validation
from lightning_ffpa._compat import lightning as lightning_compat
from lightning_ffpa._compat.transformers import (
    AmbiguousModelError,
    config_attn_implementation,
    find_hf_model,
    set_attn_implementation,
)
from lightning_ffpa.attention import kernels, registry
from lightning_ffpa.attention.counters import TrainingCalls
from lightning_ffpa.attention.plan import (
    DEFAULT_SLIDING,
    PLAN_OWNER,
    SLIDING,
    SLIDING_OPTION,
    AttentionPlan,
    check_attn_name,
    plan_for,
)
from lightning_ffpa.cp.stats import RECOMPUTE
from lightning_ffpa.errors import ConfigError, InputError
from lightning_ffpa.parallel.dims import context_parallel_size  # re-exported: the callback's CP size

__all__ = ["FFPAAttention", "context_parallel_size"]


class FFPAAttention(Callback):
    """Install FFPA attention (CP=1) or the ring CP hook (CP>1) and log which kernels ran."""

    installs_attention_plan = True  # how `attention.plan` finds this Callback in a trainer (`PLAN_OWNER`)

    def __init__(self, log_every_n_steps: int = 50, attn_implementation: str = "ffpa",
                 sliding: Literal["flex", "fa4", "auto"] = DEFAULT_SLIDING) -> None:
        """Configure the callback.

        Args:
            log_every_n_steps: Log the dispatch counters every this many optimizer steps (0 = never).
            attn_implementation: HF attention name installed at CP=1 ("ffpa"; "sdpa" to compare).
            sliding: Sliding-window layers under "ffpa" and in the CP ring: `auto` (FA4 where a call can take it, else
                block-sparse Flex, each fallback counted), `fa4` (flash-attn-4; an error where it cannot run) or `flex`.
                Measured against Flex in docs/performance.md#the-sliding-layers-on-fa4.
        """
        if log_every_n_steps < 0:
            raise ConfigError("FFPAAttention.log_every_n_steps", log_every_n_steps, "must be >= 0")
        if sliding not in SLIDING:
            raise ConfigError(SLIDING_OPTION, sliding, f"must be one of {list(SLIDING)}")
        check_attn_name(attn_implementation)  # here too: a Callback built in Python fails where it is built
        self.sliding = sliding
        self.log_every_n_steps = log_every_n_steps
        self.attn_implementation = attn_implementation
        self.cp_size = 1
        self.plan: AttentionPlan | None = None  # this run's plan, from `setup`
        self._installed_on: weakref.ref | None = None  # the model configured in this stage
        self.ring = None  # the ring handle at CP > 1 (its `stats` count the blocks that ran)
        self._sliding_before: str | None = None  # the backend's sliding kernel before this run set its own
        self._training = TrainingCalls(self._counts)  # validation loops inside fit are not logged as training's

    # -- install ---------------------------------------------------------------------------
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Resolve the attention plan and register its backend; configure the model if it already exists."""
        owners = [cb for cb in getattr(trainer, "callbacks", None) or [] if getattr(cb, PLAN_OWNER, False)]
        if len(owners) > 1:  # each would install, count and log: every line and metric twice
            raise InputError(f"`trainer.callbacks` holds {len(owners)} FFPAAttention Callbacks; keep one")
        if stage == "fit":  # the CLI checks this before launch; a Python user's Trainer meets it here
            validation.check_attention_trains_here(trainer, pl_module)
        self.plan = plan_for(trainer, pl_module, context_parallel_size(trainer, pl_module), callback=self)
        self.cp_size = self.plan.cp_size
        if not self.plan.ring and self.plan.attn_implementation == "ffpa":
            self._sliding_before = attention.backend.config().sliding  # given back at teardown
            attention.register_ffpa(sliding=self.plan.sliding_kernel)
        elif self.plan.ring:
            # The ring is installed once the model exists, possibly after the strategy has wrapped the layers
            # for SAC (the policy is built then): hand SAC the ring's kernel forwards now.
            saved_ops.register(kernels.forward_ops())
            if self.plan.ring_sliding_backend is not None:  # FA4 serves the ring's sliding layers
                saved_ops.register(registry.get("fa4").forward_ops())
        attention.reset_dispatch_counts()
        self._training.start(counted_before=False)  # a previous fit's ring is replaced when this one installs
        self._install(trainer, pl_module, required=False)

    def _install(self, trainer: pl.Trainer, pl_module: pl.LightningModule, required: bool) -> None:
        try:
            model = find_hf_model(pl_module)
        except AmbiguousModelError as err:
            raise InputError(str(err)) from None
        if model is None:
            if required:
                raise TypeError(f"FFPAAttention found no transformers PreTrainedModel in {type(pl_module).__name__}")
            return  # built later in configure_model; installed at the *_start hooks
        if self._installed_on is not None and self._installed_on() is model:
            return
        if self.plan.ring:
            self._say_replaced(pl_module, model, f"the FFPA ring (context_parallel_size={self.cp_size})")
            set_attn_implementation(model, "sdpa")  # install_ring then routes every layer to its ring function
            # Sharding the batch (and passing `ring_layout`) is the LightningModule's part, see
            # lightning_ffpa.cp.shard_batch.
            from lightning_ffpa.cp.ring import install_ring

            self.ring = install_ring(model, trainer.strategy.parallel_dims.cp_mesh,
                                     sliding_backend=self.plan.ring_sliding_backend)
        else:
            self._say_replaced(pl_module, model, f"attn_implementation={self.plan.attn_implementation!r}")
            set_attn_implementation(model, self.plan.attn_implementation)
        self._installed_on = weakref.ref(model)

    def _say_replaced(self, pl_module: pl.LightningModule, model: Any, installs: str) -> None:
        """sdpa is the default; any other attention the model was built with is replaced by `installs` (the plan's
        attention, or the ring at CP > 1), and the user sees it (named as the module's option where it came from
        one, as the model's own setting otherwise)."""
        current = config_attn_implementation(model.config)
        if current in (None, "sdpa", self.plan.attn_implementation):
            return
        asked = (getattr(pl_module, "hparams", None) or {}).get("attn_implementation")
        where = (f"`model.attn_implementation={asked!r}`" if asked == current
                 else f"the model's attn_implementation={current!r}")
        rank_zero_info(f"FFPAAttention installs {installs} in place of {where}")

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._installed_on = None  # the next stage installs again: the model's attention may have changed since
        if self._sliding_before is not None:  # the sliding choice is this run's, not the process's
            attention.register_ffpa(sliding=self._sliding_before)
            self._sliding_before = None

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._install(trainer, pl_module, required=True)

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._install(trainer, pl_module, required=True)
        self._training.eval_start()

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._training.eval_end()

    def on_test_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._install(trainer, pl_module, required=True)

    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._install(trainer, pl_module, required=True)

    # -- report ----------------------------------------------------------------------------
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        n = self.log_every_n_steps
        if not self._counted():  # transformers' own implementation runs: zeros would say nothing ran
            return
        # once per optimizer step: with gradient accumulation only the window's last micro-batch logs. Straight to
        # the loggers: `pl_module.log` values are written again at every later logging step (stale counts between)
        if n and trainer.global_step % n == 0 and not lightning_compat.accumulating(trainer) and trainer.is_global_zero:
            counts = self.training_counts()
            if counts:
                # the step this batch's `self.log` metrics (train/loss) land on: global_step is one ahead here
                step = lightning_compat.logging_step(trainer)
                for logger in trainer.loggers:
                    logger.log_metrics({f"attention/{k}": float(v) for k, v in counts.items()}, step=step)

    def training_counts(self) -> dict[str, int]:
        """Calls per path in this fit's training forwards so far, and at CP > 1 the ring's forward counts as
        `ring-<key>` (the sanity check and validation loops left out, and the exchanges a checkpoint recompute
        repeats; `summary` counts every forward and those)."""
        return {k: v for k, v in self._training.counts().items() if not k.startswith(f"ring-{RECOMPUTE}")}

    def _counts(self) -> Counter:
        """Every call counted so far: the backend's paths, and the ring's stats as `ring-<key>` (the ring counts its
        own blocks; the backend's path counters never see them)."""
        counts = Counter(attention.dispatch_counts())
        counts.update({f"ring-{k}": v for k, v in (getattr(self.ring, "stats", None) or {}).items()})
        return counts

    def _counted(self) -> bool:
        """Whether the installed attention is ours (the FFPA backend or the ring), whose dispatches are counted."""
        return self.plan is None or self.plan.ring or self.plan.attn_implementation == "ffpa"

    def summary(self) -> str:
        """One line: which attention kernels ran and how often (this rank)."""
        if not self._counted():
            return (f"FFPAAttention ({self.plan.describe()}): transformers' {self.plan.attn_implementation!r} ran "
                    "every layer (its calls are not counted)")
        counts = self._counts()
        ran = ", ".join(f"{k}={v}" for k, v in sorted(counts.items()) if v) or "no attention calls counted"
        mode = self.plan.describe() if self.plan is not None else f"attn_implementation={self.attn_implementation}"
        why = ", ".join(f"{k}={v}" for k, v in sorted(attention.fallback_counts().items()) if v)
        return f"FFPAAttention ({mode}): {ran}" + (f" (fallbacks by reason: {why})" if why else "")

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # rank 0's counts: on several ranks they read as the job's otherwise
        where = f" [rank 0's calls, of {trainer.world_size} ranks]" if trainer.world_size > 1 else ""
        rank_zero_info(self.summary() + where)
