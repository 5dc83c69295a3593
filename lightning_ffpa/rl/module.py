"""A GRPO LightningModule around an HF causal LM, built from the same model options as `Gemma4LM`.

Owns the policy update on batches the rollout Callback has filled (`input_ids`, `attention_mask`,
`completion_mask`, `old_logprobs`, `advantages`): chunked log-probs from the final hidden states, the step's
completions split into token-budgeted micro-batches accumulated into one optimizer step, and `num_iterations`
optimizer steps per rollout. Optimization is manual for that: Lightning's `global_step` counts optimizer
steps (`num_iterations` per rollout batch), so `max_steps` and `every_n_train_steps` count updates, as TRL's
steps do. The algorithm's choices are one `GRPOAlgorithm` (`rl/algorithm.py`) made here and read by the
Callback. Model construction (preset or pretrained, config overrides, attention, dtype, LoRA, FSDP2 meta
build) is `HFModule`'s. It does not generate.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torchmetrics import MeanMetric

from lightning_ffpa.dtypes import DtypeOrAuto
from lightning_ffpa.errors import ConfigError
from lightning_ffpa.hf_module import HFModule, text_config
from lightning_ffpa.lora import LoraSpec, lora_hparam
from lightning_ffpa.module import build_adamw, check_range
from lightning_ffpa.rl.algorithm import GRPOAlgorithm, microbatches
from lightning_ffpa.rl.grpo import policy_loss, sampler_weights
from lightning_ffpa.rl.logprobs import policy_token_logprobs


class GRPOModule(HFModule):
    """GRPO policy: HF model in `self.model`, clipped-ratio loss, optional KL to the adapter-free base."""

    RESUMED_FROM_OPTIMIZER = ("learning_rate",)  # a resume takes it from the checkpoint's optimizer state

    def __init__(
        self,
        pretrained: str | None = None,
        preset: str = "tiny",
        config_overrides: dict[str, Any] | None = None,
        attn_implementation: str = "sdpa",
        dtype: DtypeOrAuto = "float32",
        lora: LoraSpec | None = None,
        save_frozen_weights: bool = True,
        learning_rate: float = 1e-5,
        clip_eps: float = 0.2,
        clip_eps_high: float | None = None,
        beta: float = 0.0,
        temperature: float = 1.0,
        old_logprobs: Literal["policy", "engine"] = "policy",
        sampler_is_cap: float | None = 3.0,
        loss_type: Literal["grpo", "bnpo", "dapo", "dr_grpo", "gspo"] = "grpo",
        scale_rewards: Literal["group", "batch", "none"] = "group",
        num_iterations: int = 1,
        max_tokens_per_microbatch: int | None = None,
        mask_truncated_completions: bool = False,
        dynamic_sampling: bool = False,
        refill_rounds: int = 0,
        overlong_buffer: int | None = None,
        overlong_penalty: float = 1.0,
        logprob_chunk_size: int = 4096,
        gradient_clip_val: float | None = None,
        max_empty_batches: int = 8,
    ) -> None:
        """Build the module; the policy is created in `configure_model` by the same code as `Gemma4LM`'s model.

        Args:
            pretrained: local path or hub id passed to `from_pretrained`; None builds from `preset`.
            preset: config preset when `pretrained` is None: tiny, tiny-moe, gemma4-31b, gemma4-26b-a4b.
            config_overrides: text-config fields to override (e.g. `{num_hidden_layers: 6}`); an unknown field is an error.
            attn_implementation: sdpa, eager, flex_attention or ffpa (any name registered with transformers).
            dtype: parameter dtype; `auto` is bf16 on GPUs that support it, else fp32.
            lora: peft LoRA options (e.g. `{r: 16, lora_alpha: 32, target_modules: [q_proj, v_proj]}`; MoE expert stacks: `target_parameters: [experts.gate_up_proj, experts.down_proj]`; a float8 frozen base: `base_dtype: fp8`); None trains all weights.
            save_frozen_weights: write the frozen base (weights with requires_grad False: a LoRA's base) into
                checkpoints; false saves only the trained weights and a digest of the base, which a resume (or
                `lightning-ffpa-export`) rebuilds from `pretrained` (or `preset` under the run's seed) and checks. Needs `lora`.
            learning_rate: AdamW learning rate (> 0).
            clip_eps: lower ratio clip: the ratio is kept >= 1 - clip_eps (> 0).
            clip_eps_high: upper ratio clip: the ratio is kept <= 1 + clip_eps_high (DAPO's clip-higher); None = clip_eps.
            beta: KL coefficient against the base model (>= 0; > 0 needs `lora`: the base is the adapter-free model).
            temperature: Rollout temperature; the policy scores tokens at the same temperature (> 0).
            old_logprobs: the ratio's denominator. "policy": the policy's own logprobs of the sampled tokens,
                without gradient (the ratio is 1 at the first update; later updates of `num_iterations` divide by the first pass's, as in TRL);
                "engine": the sampler's logprobs, so the ratio also carries the engine's bf16 numerics.
            sampler_is_cap: with "policy", weight each token by min(pi_policy / pi_engine, cap), truncated
                importance sampling for the engine's numerics (TRL's vllm_importance_sampling_correction); >= 1,
                None for no weight. Must be None with "engine".
            loss_type: grpo (per-sequence mean), bnpo (token mean of the rank's step), dapo (token mean of the global step), dr_grpo (sum / (N * max_new_tokens)) or gspo (sequence-level ratio): formulas in rl/grpo.py.
            scale_rewards: Advantages divided by the reward std of the group, of the whole step (all ranks) or not at all (none, as Dr. GRPO).
            num_iterations: Optimizer updates per rollout (TRL's num_iterations, mu); updates after the first use the first pass's log-probs as the old policy.
            max_tokens_per_microbatch: Padded tokens per forward; the step's completions are split into micro-batches within it and accumulated into one update (null: one forward).
            mask_truncated_completions: Completions cut at max_new_tokens without an EOS take no part in the loss (their rewards still count in the group statistics).
            dynamic_sampling: DAPO's dynamic sampling: groups whose rewards all equal are dropped from the step (counted in rollout/dropped_groups).
            refill_rounds: With dynamic_sampling, redraw the dropped groups' completions (same prompts, fresh noise) up to this many times before dropping them (>= 0).
            overlong_buffer: DAPO's soft overlong punishment: the last this-many tokens before max_new_tokens ramp the reward down to -overlong_penalty (null: off).
            overlong_penalty: The overlong punishment's largest penalty (>= 0; needs overlong_buffer).
            logprob_chunk_size: Tokens per chunk of the chunked log-probs through the lm_head (>= 1); memory O(chunk x vocab).
            gradient_clip_val: Clip the gradient norm to this before each update (null: no clipping); Trainer's gradient_clip_val does not apply to this manually optimized module.
            max_empty_batches: Stop with an error after this many rollout batches in a row left no completion token in the loss (every group dropped by dynamic_sampling, or every completion masked by mask_truncated_completions): such a batch makes no update, so the step count would not move (>= 1).
        """
        super().__init__()
        lora = lora_hparam(lora)  # plain data in hparams and checkpoints
        check_range("model.learning_rate", learning_rate, gt=0)
        check_range("model.clip_eps", clip_eps, gt=0)
        if clip_eps_high is not None:
            if clip_eps_high < clip_eps:  # clip-higher widens the upper bound only
                raise ConfigError("model.clip_eps_high", clip_eps_high, f"must be >= `model.clip_eps={clip_eps}`")
        check_range("model.beta", beta, ge=0)
        check_range("model.temperature", temperature, gt=0)
        if old_logprobs not in ("policy", "engine"):
            raise ConfigError("model.old_logprobs", old_logprobs, "must be 'policy' or 'engine'")
        if sampler_is_cap is not None:
            if old_logprobs == "engine":
                raise ConfigError("model.sampler_is_cap", sampler_is_cap,
                                  "corrects the policy ratio for the engine's numerics; set it to null with "
                                  "`old_logprobs: engine`, whose ratio already divides by the engine's logprobs")
            check_range("model.sampler_is_cap", sampler_is_cap, ge=1)
        if beta > 0 and lora is None:
            raise ConfigError("model.beta", beta, "needs `model.lora` (the KL reference is the adapter-free base)")
        check_range("model.logprob_chunk_size", logprob_chunk_size, ge=1)
        if gradient_clip_val is not None:
            check_range("model.gradient_clip_val", gradient_clip_val, gt=0)
        check_range("model.max_empty_batches", max_empty_batches, ge=1)
        self.empty_batches = 0  # rollout batches in a row with no loss token (the same count on every rank)
        self.algorithm = GRPOAlgorithm(  # checks its options: one ConfigError each
            loss_type=loss_type, scale_rewards=scale_rewards, clip_eps=clip_eps, clip_eps_high=clip_eps_high,
            beta=beta, num_iterations=num_iterations, max_tokens_per_microbatch=max_tokens_per_microbatch,
            mask_truncated_completions=mask_truncated_completions, dynamic_sampling=dynamic_sampling,
            refill_rounds=refill_rounds, overlong_buffer=overlong_buffer, overlong_penalty=overlong_penalty)
        self.save_hyperparameters()
        self.init_model_options()
        # Micro-batches and several updates per rollout: backward and optimizer steps are ours.
        self.automatic_optimization = False
        self.entropy = MeanMetric()
        self.clip_fraction = MeanMetric()
        self.kl = MeanMetric()
        self.sampler_gap = MeanMetric()
        self.sampler_weight = MeanMetric()

    def token_logprobs(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(N, L-1) log-probs and entropies of the completion tokens, chunked through the lm_head."""
        # Pass the module given to `parallelize` (the FSDP root), so its hooks gather lm_head too.
        softcap = getattr(text_config(self.config), "final_logit_softcapping", None)
        return policy_token_logprobs(self.model, self.hf_model.get_output_embeddings(), batch, softcap,
                                     self.hparams.temperature, self.hparams.logprob_chunk_size)

    def _global_counts(self, mask: torch.Tensor) -> tuple[float, float, int]:
        """(sequences, tokens, world size) of the whole step, summed over data-parallel ranks."""
        counts = torch.stack([torch.tensor(float(mask.shape[0]), device=mask.device), mask.sum().float()])
        world = self.trainer.world_size if self._trainer is not None else 1
        if world > 1:
            counts = self.trainer.strategy.reduce(counts, reduce_op="sum")
        return float(counts[0]), float(counts[1]), world

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor | None:
        step = self.prepare_step(batch, batch_idx)
        if step is None:  # every completion dropped or masked: no update (decided on global counts: every rank)
            self._no_update(batch_idx)
            return None
        self.empty_batches = 0
        opt = self.optimizers()
        for it in range(self.algorithm.num_iterations):
            self.backward_pass(batch, step, it)
            if self.hparams.gradient_clip_val is not None:
                self.clip_gradients(opt, gradient_clip_val=self.hparams.gradient_clip_val,
                                    gradient_clip_algorithm="norm")
            opt.step()
            opt.zero_grad()
        self._log_step(step)
        return torch.tensor(step.sums["loss"])

    def _no_update(self, batch_idx: int) -> None:
        """Count and say so: a batch with nothing to learn leaves `global_step` (and `max_steps`) where it was,
        so a run where it keeps happening would never end."""
        algo = self.algorithm
        self.empty_batches += 1
        if algo.dynamic_sampling and algo.mask_truncated_completions:
            why = "every group was dropped (tied rewards) or its completions masked (cut at max_new_tokens)"
        elif algo.dynamic_sampling:
            why = "every group's rewards tied and dynamic_sampling dropped them"
        else:
            why = "every completion was cut at max_new_tokens and mask_truncated_completions masked it"
        self.log("rollout/empty_batches", float(self.empty_batches), on_step=True, on_epoch=False, batch_size=1)
        if self.empty_batches >= self.hparams.max_empty_batches:
            option = "model.dynamic_sampling" if algo.dynamic_sampling else "model.mask_truncated_completions"
            raise ConfigError(option, True, f"{self.empty_batches} rollout batches in a row had no completion token "
                              f"in the loss ({why}), so no update has run since step {self.global_step}; check the "
                              "reward functions' spread and the EOS ids, or raise `model.max_empty_batches`")
        rank_zero_warn(f"GRPO batch {batch_idx}: no update, {why} ({self.empty_batches} in a row; the run stops "
                       f"at {self.hparams.max_empty_batches})")

    def prepare_step(self, batch: dict, batch_idx: int = 0) -> _Step | None:
        """The step's micro-batches and loss weights from its whole batch (global counts under data
        parallelism); None when no completion token takes part in the loss on any rank."""
        algo = self.algorithm
        mask = batch["completion_mask"][:, 1:]  # (N, L-1)
        n_seq, n_tok, world = self._global_counts(mask)
        if n_tok == 0:
            return None
        lengths = batch["attention_mask"].sum(1).tolist()
        algo.check_sequence_fits(max(lengths), f" (batch {batch_idx})")
        weights = algo.loss_weights(mask, n_seq, n_tok, float(mask.sum()), world)  # (N, L-1)
        parts, pads = self._equal_parts(microbatches(lengths, algo.max_tokens_per_microbatch), world)
        return _Step(parts, weights, float(mask.sum()), world, pads)

    def _equal_parts(self, parts: list[list[int]], world: int) -> tuple[list[list[int]], int]:
        """The rank's micro-batches, as many as the rank with the most: every forward and backward is a collective
        under DDP and FSDP2, so a rank with fewer (shorter rows, or its groups dropped by dynamic sampling) would
        hang the others. Its largest parts are halved (still within the budget); when every part is one row,
        zero-weight repeats of row 0 pad the count (the second value: how many)."""
        if world <= 1:
            return parts, 0
        counts = self.trainer.strategy.all_gather(torch.tensor(len(parts), device=self.device))
        most = int(counts.max())
        parts = [list(p) for p in parts]
        while len(parts) < most and max(map(len, parts)) > 1:
            big = max(range(len(parts)), key=lambda i: len(parts[i]))
            half = len(parts[big]) // 2
            parts[big:big + 1] = [parts[big][:half], parts[big][half:]]
        pads = most - len(parts)
        return parts + [[0]] * pads, pads

    def backward_pass(self, batch: dict, step: _Step, iteration: int = 0) -> float:
        """One pass over the step's micro-batches, each loss backpropagated (gradients accumulate); returns the
        pass's loss. Pass 0 keeps its log-probs as the old policy of later passes, and the reference's."""
        hp, algo = self.hparams, self.algorithm
        total = 0.0
        for k, rows in enumerate(step.parts):
            pad = k >= len(step.parts) - step.pads  # a zero-weight forward/backward that keeps ranks in step
            mb = _rows(batch, rows)
            logp, entropy = self.token_logprobs(mb)
            m = mb["completion_mask"][:, 1:]
            engine = mb["old_logprobs"][:, 1:]
            if iteration == 0:
                step.first.append(logp.detach())
                step.refs.append(self._reference_logprobs(mb) if algo.beta > 0 else None)
            first = step.first[k]
            old = first if hp.old_logprobs == "policy" else engine
            is_w = sampler_weights(first, engine, hp.sampler_is_cap) if hp.sampler_is_cap is not None else None
            weights = step.weights[rows][:, :m.shape[1]] * (0.0 if pad else 1.0)
            loss, stats = policy_loss(logp, old, mb["advantages"], m, weights,
                                      algo.sequence_ratio, algo.clip_eps, algo.clip_eps_high, algo.beta,
                                      step.refs[k], is_w)
            if self._trainer is not None:
                self.manual_backward(loss)
            else:  # a module used on its own (tests, a user's loop): plain autograd
                loss.backward()
            if pad:
                continue
            total += float(loss.detach())
            step.sums["clipped"] += float(stats["clipped"])
            step.sums["clip_total"] += float(stats["clip_total"])
            if iteration == 0:
                fm = m.to(logp.dtype)
                step.sums["gap"] += float(((first - engine).abs() * fm).sum())
                step.sums["entropy"] += float((entropy * fm).sum())
                step.sums["kl"] += float(stats.get("kl", 0.0))
                if is_w is not None:
                    step.sums["is_weight"] += float((is_w * fm).sum())
        if iteration == 0:
            step.sums["loss"] = total
        return total

    def _reference_logprobs(self, mb: dict) -> torch.Tensor:
        with torch.no_grad(), self.model.disable_adapter():
            return self.token_logprobs(mb)[0]

    def _log_step(self, step: _Step) -> None:
        """Step values: the first pass's loss (summed over micro-batches; the global loss under data
        parallelism), token means of this rank's step for the rest (clipping over every pass)."""
        sums, dev, n = step.sums, self.device, max(step.tokens, 1.0)
        self.log("train/loss", torch.tensor(sums["loss"], device=dev), prog_bar=True, sync_dist=step.world > 1,
                 batch_size=1)
        # How far the sampler's logprobs sit from the policy's on the same tokens: ~0 when the inference copy
        # and numerics match; bf16 engines and kernels move it (the importance weights correct for it).
        for metric, name, value in ((self.sampler_gap, "train/sampler_logprob_gap", sums["gap"] / n),
                                    (self.entropy, "train/entropy", sums["entropy"] / n),
                                    (self.clip_fraction, "train/clip_fraction",
                                     sums["clipped"] / max(sums["clip_total"], 1.0))):
            metric(torch.tensor(value, device=dev))  # forward: the step value is what on_step logs
            self.log(name, metric, on_step=True, on_epoch=False)
        if self.hparams.sampler_is_cap is not None:
            self.sampler_weight(torch.tensor(sums["is_weight"] / n, device=dev))
            self.log("train/sampler_is_weight", self.sampler_weight, on_step=True, on_epoch=False)
        if self.algorithm.beta > 0:
            self.kl(torch.tensor(sums["kl"] / n, device=dev))
            self.log("train/kl", self.kl, on_step=True, on_epoch=False)
        self.log("train/microbatches", float(len(step.parts)), on_step=True, on_epoch=False, batch_size=1)
        # the no-update count back at 0 in the logs too, not its last non-zero value until the next empty batch
        self.log("rollout/empty_batches", 0.0, on_step=True, on_epoch=False, batch_size=1)

    def configure_optimizers(self):
        return build_adamw(self.model, self.hparams.learning_rate, weight_decay=0.0, betas=(0.9, 0.999))  # fused on CUDA


@dataclass
class _Step:
    """One rollout batch's update plan and what its passes leave behind."""

    parts: list[list[int]]  # row indices per micro-batch
    weights: torch.Tensor  # (N, L-1) loss weight per token (the loss type's normalisation)
    tokens: float  # this rank's loss tokens
    world: int
    pads: int = 0  # trailing parts that only keep this rank's collectives in step with the others (zero weight)
    first: list[torch.Tensor] = field(default_factory=list)  # pass 0's log-probs per micro-batch
    refs: list[torch.Tensor | None] = field(default_factory=list)  # the reference's, when beta > 0
    sums: dict[str, float] = field(default_factory=lambda: dict.fromkeys(
        ("loss", "clipped", "clip_total", "kl", "gap", "is_weight", "entropy"), 0.0))


def _rows(batch: dict, rows: list[int]) -> dict:
    """The micro-batch of `rows`, its right padding trimmed to its longest row."""
    idx = torch.tensor(rows, device=batch["input_ids"].device)
    length = int(batch["attention_mask"][idx].sum(1).max())
    out = {}
    for key in ("input_ids", "attention_mask", "completion_mask", "old_logprobs"):
        out[key] = batch[key][idx, :length]
    out["advantages"] = batch["advantages"][idx]
    return out
