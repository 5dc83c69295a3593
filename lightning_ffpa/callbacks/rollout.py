"""Rollout Callback: before each training batch, refresh the engine's weights, generate `num_generations`
completions per prompt with the paged engine, score them, and fill the batch for GRPO in place.

Drop-in for an existing Lightning project: the LightningModule only needs its HF model at
`model_attr` (peft-wrapped or plain) and a training_step that reads the keys written here:
`input_ids`, `attention_mask`, `completion_mask`, `old_logprobs`, `advantages`, `rewards`.
It owns the orchestration and the checks of its options (all before any model is built); the engine
(`rollout/`), LoRA sync, batch layout (`rl/batch.py`), rewards and GRPO math (`rl/`) live in their own files.
On resume it continues the run: rollouts are seeded by their place in it (`rollout/seed.py`, the run seed kept
in this Callback's checkpoint state), and the first rollout of a fit copies every weight of the restored policy.
What the engine's weights are (the policy's own tensors, or a merged copy: the `weights` option) is
`rollout/shared_weights.py`'s; this file picks the option, checks the room and logs the plan's one-line path.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import nn
from torchmetrics import MeanMetric
from transformers import PreTrainedModel

from lightning_ffpa._compat.transformers import text_config
from lightning_ffpa.callbacks.rollout_tokens import (
    check_token_ids,
    generation_eos,
    resolve_eos,
    resolve_tokenizer,
)
from lightning_ffpa.data.prompts import PROMPT_KEYS
from lightning_ffpa.dtypes import DtypeName, parse_dtype
from lightning_ffpa.errors import ConfigError
from lightning_ffpa.hf_module import HFModule, resolve_dtype
from lightning_ffpa.lora import unwrap_peft
from lightning_ffpa.rl.algorithm import GRPOAlgorithm
from lightning_ffpa.rl.batch import repeat_groups
from lightning_ffpa.rl.reward_metrics import make_metric, reward_stats
from lightning_ffpa.rl.rewards import (
    RewardState,
    check_reward_funcs,
    reward_names,
    rewards_by_function,
    trl_completions,
    weighted_total,
)
from lightning_ffpa.rollout.engine import GIB, EngineConfig, RolloutEngine, free_device_bytes
from lightning_ffpa.rollout.lora_sync import LoraSync
from lightning_ffpa.rollout.sampler import SamplingParams
from lightning_ffpa.rollout.seed import rollout_seed, run_seed, seeded
from lightning_ffpa.rollout.shared_weights import WEIGHTS_MODES, SharedWeights, WeightsMode, WeightsPlan
from lightning_ffpa.rollout.walker import DecoderWalker

OPTION = "RolloutCallback"  # how errors spell this Callback's options: `RolloutCallback.sampling.top_p`
NO_LORA_TO_VERIFY = ("checks the LoRA refresh (W0 + s*B@A from the frozen base), and this policy has no LoRA "
                     "adapters: every refresh copies all weights, so there is nothing to verify; set it false")


class RolloutCallback(L.Callback):
    """Generates GRPO groups between optimizer steps and feeds them to the batch."""

    def __init__(self, reward_funcs: list[Callable], engine: EngineConfig | None = None,
                 sampling: SamplingParams | None = None, num_generations: int = 4, verify_no_drift: bool = False,
                 eos_token_ids: list[int] | None = None, tokenizer: str | None = None, model_attr: str = "model",
                 pad_token_id: int = 0,
                 inference_dtype: DtypeName | None = None, weights: WeightsMode = "shared",
                 reward_weights: list[float] | None = None) -> None:
        """
        Args:
            reward_funcs: TRL-signature reward functions, summed (`reward_weights`); in YAML dotted import paths
                (`lightning_ffpa.rl.rewards.length_reward`).
            engine: Paged engine sizes (page_size, num_pages, max_batch_size, max_seq_len, ...); null = defaults.
            sampling: temperature, top_p, top_k and max_new_tokens of every completion; null = defaults.
            num_generations: Completions per prompt (the GRPO group size G, >= 2).
            verify_no_drift: At fit start, check the base weights hash is unchanged over refreshes and the
                inference copy is deterministic (raises otherwise). LoRA policies only.
            eos_token_ids: Tokens that end a completion (default: the model config's eos_token_id and a pretrained
                model's generation_config.json eos ids, where `generate` stops).
            tokenizer: Tokenizer that decodes completions for the reward functions: "byte", or a local folder or
                hub id for `AutoTokenizer` (None: the datamodule's tokenizer if it has one, else ids joined by spaces).
            model_attr: Attribute of the LightningModule holding the HF model.
            pad_token_id: Right-padding id of the GRPO batch.
            inference_dtype: Dtype of the inference copy; null = the strategy's compute dtype (its public
                `param_dtype`, as FSDP2Strategy has) if it has one, else the training weights' dtype. Under
                FSDP2 the stored weights are fp32 masters: a copy in their dtype would double its memory.
            weights: "shared": the engine reads the policy's frozen tensors in place (LoRA applied unmerged from
                adapter buffers; only adapters and trained weights are copied). "merged": its own full copy with
                W0 + s*B@A written in, faster per decode step by the unmerged adapters' share, for models where a
                second copy fits. Under FSDP2 without `replicate_frozen` the base is sharded and "shared" runs
                the merged copy (the start-up line says so).
            reward_weights: One weight per reward function, as TRL's `reward_weights`: the reward is their
                weighted sum (null: each weighs 1). Each function's own mean is logged unweighted.
        """
        super().__init__()
        self.engine_config = engine if engine is not None else EngineConfig()
        self.sampling = sampling if sampling is not None else SamplingParams()
        self._check_options(reward_funcs, num_generations, eos_token_ids, pad_token_id, inference_dtype)
        if weights not in WEIGHTS_MODES:
            raise ConfigError(f"{OPTION}.weights", weights, f"must be one of {list(WEIGHTS_MODES)}")
        self.weights = weights
        self.reward_funcs = list(reward_funcs)
        self.reward_weights = _reward_weights(reward_weights, len(self.reward_funcs))
        self.num_generations = num_generations
        self.inference_dtype = parse_dtype(f"{OPTION}.inference_dtype", inference_dtype, allow_auto=False,
                                           allow_none=True)
        self.verify_no_drift, self.eos_token_ids = verify_no_drift, eos_token_ids
        self.tokenizer_name, self.model_attr, self.pad_token_id = tokenizer, model_attr, pad_token_id
        self.engine: RolloutEngine | None = None
        self.sync: LoraSync | SharedWeights | None = None
        self.weights_path: str | None = None  # what the engine's weights are (logged at start-up)
        self.metrics = {k: MeanMetric() for k in ("reward", "completion_length", "refresh_s", "generate_s",
                                                  "update_s")}
        self._update_start: float | None = None  # when the step's update (forward, backward, optimizer) began
        self.extra_columns: dict[str, list] = {}  # the last rollout's columns from reward functions' `log_extra`
        self.drift_report: dict[str, str] | None = None
        self._resumed_seed: int | None = None  # the seed of the checkpoint this fit resumes, if any
        self.algorithm = GRPOAlgorithm()  # the module's, bound to this rollout in `setup`
        self.tokenizer: Any = None  # resolved in `check_before_fit` (setup and the CLI's pre-flight)
        self._tokenizer_for: Any = ...  # the datamodule it was resolved for (None is a valid one)

    # ---- option checks: all before any model is built -------------------------------------------
    def _check_options(self, reward_funcs: list, num_generations: int, eos_token_ids: list[int] | None,
                       pad_token_id: int, inference_dtype: str | None) -> None:
        if any(isinstance(f, str) for f in reward_funcs):
            path = next(f for f in reward_funcs if isinstance(f, str))
            raise ConfigError(f"{OPTION}.reward_funcs", path, "give functions; in YAML write dotted import "
                              "paths such as `my_project.rewards.my_reward` (the `module:function` form is gone)")
        check_reward_funcs(reward_funcs, f"{OPTION}.reward_funcs")
        if num_generations < 2:
            raise ConfigError(f"{OPTION}.num_generations", num_generations,
                              "must be >= 2: advantages are normalised within each group")
        self.engine_config.check(f"{OPTION}.engine")
        self.sampling.check(f"{OPTION}.sampling")
        # the shortest possible prompt; the real one is checked at setup and per batch
        self.check_lengths(1, " (even a 1-token prompt; the data's are checked at setup)")
        for tok in eos_token_ids or ():
            if tok < 0:
                raise ConfigError(f"{OPTION}.eos_token_ids", eos_token_ids, "token ids must be >= 0")
        if pad_token_id < 0:
            raise ConfigError(f"{OPTION}.pad_token_id", pad_token_id, "must be >= 0")
        parse_dtype(f"{OPTION}.inference_dtype", inference_dtype, allow_auto=False, allow_none=True)

    def check_lengths(self, prompt_len: int, where: str = "") -> None:
        """Raise unless a prompt of `prompt_len` tokens plus `sampling.max_new_tokens` fits the engine's
        `max_seq_len` and page pool (the engine would otherwise cut completions short)."""
        self.engine_config.check_fits(prompt_len, self.sampling.max_new_tokens, f"{OPTION}.engine", where)

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        """Check options against the data and the module, before the model is built; resolve the GRPO
        algorithm once (the module's `algorithm`, else the defaults) with this rollout's completion length."""
        self.check_before_fit(trainer, pl_module, trainer.datamodule)
        self.algorithm = self.resolve_algorithm(pl_module, trainer.datamodule)
        if hasattr(pl_module, "algorithm"):
            pl_module.algorithm = self.algorithm  # one object, read by the module's loss and by this Callback

    def resolve_algorithm(self, pl_module: L.LightningModule, datamodule: Any) -> GRPOAlgorithm:
        """The module's `GRPOAlgorithm` (defaults for a module without one) bound to `sampling.max_new_tokens`;
        raises when the longest prompt plus completion cannot fit its micro-batch budget."""
        algo = getattr(pl_module, "algorithm", None) or GRPOAlgorithm()
        algo = algo.bind(self.sampling.max_new_tokens, f"{OPTION}.sampling.max_new_tokens")
        longest = _longest_prompt(datamodule)
        if longest is not None:
            algo.check_sequence_fits(longest + self.sampling.max_new_tokens,
                                     f" (the longest prompt, {longest} tokens, plus `{OPTION}.sampling.max_new_tokens="
                                     f"{self.sampling.max_new_tokens}`)")
        return algo

    def check_before_fit(self, trainer: L.Trainer, pl_module: L.LightningModule, datamodule: Any) -> None:
        """Options against the data's prompts and the module (also run by the CLI's pre-flight, before fit
        writes any file)."""
        self.engine_config.check_device(trainer.strategy.root_device, f"{OPTION}.engine")
        longest = _longest_prompt(datamodule)
        if longest is None:
            rank_zero_info("RolloutCallback: the datamodule has no `max_prompt_length()`; prompt lengths "
                           "against `engine.max_seq_len` are checked per batch instead")
        else:
            self.check_lengths(longest, " (the longest prompt of the datamodule)")
        if not hasattr(pl_module, self.model_attr):  # built in configure_model: the attribute exists, as None
            raise ConfigError(f"{OPTION}.model_attr", self.model_attr, f"{type(pl_module).__name__} has no such "
                              "attribute; name the one holding the HF model (`model` in lightning-ffpa's modules)")
        if getattr(pl_module, self.model_attr) is not None:
            self._hf_model(pl_module)
        temperature = getattr(pl_module, "hparams", {}).get("temperature")
        if temperature is not None and temperature != self.sampling.temperature:
            # The ratio exp(logp - old_logp) compares distributions at two temperatures otherwise.
            raise ConfigError(f"{OPTION}.sampling.temperature", self.sampling.temperature,
                              f"must equal the module's `temperature={temperature}` (the policy scores "
                              "tokens at the rollout temperature)")
        hparams = getattr(pl_module, "hparams", {})
        if self.verify_no_drift and "lora" in hparams and not hparams["lora"]:
            raise ConfigError(f"{OPTION}.verify_no_drift", True, NO_LORA_TO_VERIFY)
        if self.engine_config.num_sliding_pages and isinstance(pl_module, HFModule):  # set by hand: one window fits
            meta = unwrap_peft(pl_module.build_model("meta", announce=False))
            self.engine_config.sliding_pages(DecoderWalker(meta).specs, f"{OPTION}.engine")
        config = getattr(pl_module, "config", None)  # the engine's own check comes after the model is built
        if self.engine_config.count_routed_experts and config is not None and not getattr(
                text_config(config), "enable_moe_block", False):
            raise ConfigError(f"{OPTION}.engine.count_routed_experts", True, "the model has no MoE layers to count")
        if not pl_module.automatic_optimization:  # GRPOModule steps its optimizer itself (micro-batches, iterations)
            if trainer.gradient_clip_val:
                raise ConfigError("trainer.gradient_clip_val", trainer.gradient_clip_val,
                                  f"{type(pl_module).__name__} optimizes manually; set `model.gradient_clip_val`")
            if trainer.accumulate_grad_batches != 1:
                raise ConfigError("trainer.accumulate_grad_batches", trainer.accumulate_grad_batches,
                                  f"{type(pl_module).__name__} optimizes manually; its micro-batches are "
                                  "`model.max_tokens_per_microbatch`")
        algo = self.resolve_algorithm(pl_module, datamodule)  # the micro-batch budget against the data's prompts
        check_token_ids(OPTION, self.eos_token_ids, self.pad_token_id, config, algo.mask_truncated_completions,
                        generation_eos(hparams.get("pretrained")))
        self._check_steps_count_updates(trainer, algo.num_iterations)
        if self._tokenizer_for is not datamodule:  # once per datamodule: the pre-flight and setup both get here
            self.tokenizer, self._tokenizer_for = resolve_tokenizer(OPTION, self.tokenizer_name, datamodule), datamodule
        self._check_room_before_fit(trainer, pl_module)  # last: it builds the model on meta

    @staticmethod
    def _check_steps_count_updates(trainer: L.Trainer, num_iterations: int) -> None:
        """Each rollout makes `num_iterations` optimizer steps at once, so `global_step` moves by that much: a
        `max_steps` or a checkpoint interval between its multiples would overshoot or never be met."""
        if num_iterations == 1:
            return
        why = (f"must be a multiple of `model.num_iterations={num_iterations}`: each rollout makes that many "
               "optimizer steps, and the step count moves by all of them at once")
        if trainer.max_steps > 0 and trainer.max_steps % num_iterations:
            raise ConfigError("trainer.max_steps", trainer.max_steps, why)
        for cb in trainer.checkpoint_callbacks:
            every = getattr(cb, "_every_n_train_steps", 0)
            if every and every % num_iterations:
                raise ConfigError("ModelCheckpoint.every_n_train_steps", every, f"{why}; set it in a copy of the "
                                  "config (`lightning-ffpa cp RECIPE my.yaml`): on the command line, "
                                  "`--trainer.callbacks.init_args.*` reaches only the last callback")

    # ---- build ------------------------------------------------------------------------------------
    def _check_room(self, plan: WeightsPlan, dtype: torch.dtype, device: torch.device, free: int,
                    policy: int = 0) -> None:
        """Raise one ConfigError when what the engine's weights own (`plan`: a full copy when merged; adapters and
        copies when shared) and the KV pool in `dtype`, beside `policy` bytes not yet allocated, exceed `free`."""
        own = plan.own_bytes
        cfg = self.engine_config
        specs = DecoderWalker(plan.meta).specs
        pool = cfg.pool_bytes(specs, dtype)
        if policy + own + pool <= free:
            return
        beside = f" beside the policy (at least {policy / GIB:.1f} GiB per device)" if policy else ""
        after = "" if policy else " after the policy"
        what = "the inference copy" if plan.mode == "merged" else "the engine's own weights"
        sizes = (f"{what} ({own / GIB:.1f} GiB in {dtype}) and the KV pool ({pool / GIB:.1f} GiB){beside} "
                 f"need {(policy + own + pool) / GIB:.1f} GiB and {free / GIB:.1f} GiB is free on {device}{after}")
        if policy + own < free:
            raise ConfigError(f"{OPTION}.engine.num_pages", cfg.num_pages,
                              f"{sizes}; at most {cfg.pages_that_fit(specs, dtype, free - policy - own)} pages fit "
                              "(fewer, to leave room for the training step)")
        if plan.mode == "merged":
            instead = (f"; {plan.why}" if plan.why else
                       f"; `{OPTION}.weights: shared` reads the policy's frozen base instead")
            why = ("the engine keeps its own full copy of the model (the LoRA refresh writes W0 + s*B@A into it), "
                   f"so this model needs more memory per GPU (a smaller model, or fewer layers){instead}")
        else:
            why = (f"the engine shares the policy's frozen tensors and owns only these ({plan.describe()}), so this "
                   "model needs more memory per GPU (a smaller model, fewer layers, or LoRA instead of training "
                   "every weight)")
        raise ConfigError(f"{OPTION}.inference_dtype", self.inference_dtype, f"{sizes}: {why}")

    def _check_room_before_fit(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """The room check before any model exists, for modules that can build theirs on meta (`HFModule`): the
        policy counts at its `model.dtype` split over every rank, a lower bound, so a refusal here is certain."""
        free = free_device_bytes(trainer.strategy.root_device)
        if free is None or not isinstance(pl_module, HFModule):
            return
        meta = pl_module.build_model("meta", announce=False)
        policy_dtype = resolve_dtype(pl_module.hparams.get("dtype", "auto"))
        dtype = self.inference_dtype or getattr(trainer.strategy, "param_dtype", None) or policy_dtype
        if (pl_module.hparams.get("lora") or {}).get("base_dtype") == "fp8":  # the base as the fit will store it
            from lightning_ffpa.fp8_base import quantize_lora_bases

            quantize_lora_bases(meta)
        # float8 base weights at their one byte each, every other parameter at `model.dtype`
        policy = sum(p.numel() * (1 if p.element_size() == 1 else policy_dtype.itemsize)
                     for p in meta.parameters()) // max(trainer.world_size, 1)
        # No device yet: frozen weights in the engine's dtype count as shared, a lower bound if FSDP2 shards them
        plan = WeightsPlan(meta, self.weights, dtype, None, self.engine_config.fuse_projections)
        self._check_room(plan, dtype, trainer.strategy.root_device, free, policy)

    def _hf_model(self, pl_module: L.LightningModule) -> tuple[nn.Module, PreTrainedModel]:
        """The module at `model_attr` and the HF model inside it (peft unwrapped), or one line naming the option."""
        train = getattr(pl_module, self.model_attr, None)
        base = unwrap_peft(train) if isinstance(train, nn.Module) else train
        if not isinstance(base, PreTrainedModel):
            raise ConfigError(f"{OPTION}.model_attr", self.model_attr, f"is {type(train).__name__}, not an HF model "
                              "(plain or peft-wrapped)")
        return train, base

    def _build(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        train, base = self._hf_model(pl_module)
        compute = getattr(trainer.strategy, "param_dtype", None)
        dtype = self.inference_dtype or compute or next(base.parameters()).dtype
        device = pl_module.device
        plan = WeightsPlan(train, self.weights, dtype, device, self.engine_config.fuse_projections)
        free = free_device_bytes(device)
        if free is not None:  # the policy is resident now: what is free is what the engine's weights and pool get
            self._check_room(plan, dtype, device, free)
        self.sync = plan.build()  # allocated and filled (a full refresh)
        self.weights_path = self.sync.weights_path
        inference = self.sync.inference
        if self.verify_no_drift:
            if not self.sync.pairs:  # a module whose hparams do not say (a user's own)
                raise ConfigError(f"{OPTION}.verify_no_drift", True, NO_LORA_TO_VERIFY)
            self.drift_report = self.sync.verify_no_drift()
        eos = resolve_eos(self.eos_token_ids, base.config, generation_eos(getattr(pl_module, "hparams", {}).get(
            "pretrained")))
        self.engine = RolloutEngine(inference, self.engine_config, set(eos), option=f"{OPTION}.engine")
        e = self.engine
        rank_zero_info(f"RolloutCallback: completions end at token ids {eos or 'none (max_new_tokens)'}; {dtype} "
                       f"engine weights {self.weights_path}; attention {e.attention_path} over "
                       f"{e.config.decode_block}-token KV blocks in {e.config.page_size}-token pages, decode step "
                       f"{e.decode_path} (K/V write {e.kv_write_path}), projections {e.projection_path}, CUDA graphs "
                       f"{'on' if e.on_cuda and e.config.cuda_graphs else 'off'}")
        for m in self.metrics.values():
            m.to(device)

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._build(trainer, pl_module)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # The base hash before and after every rollout and refresh of the fit: shared weights cannot drift by
        # construction, and this keeps that claim checked (an in-place write to W0 anywhere is caught here).
        if self.drift_report is not None:
            after = self.sync.base_digest()
            self.drift_report["base_sha256_at_end"] = after
            if after != self.drift_report["base_sha256"]:
                raise RuntimeError(f"base weights drifted over {self.sync.num_refreshes} refreshes of this fit: "
                                   f"{self.drift_report['base_sha256']} -> {after}")

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # A checkpoint restore can come after `on_fit_start` built the copy (FSDP2Strategy's does): the first
        # rollout samples from the restored policy, frozen weights included. A fresh fit's copy is current.
        if trainer.ckpt_path is not None:
            self.sync.refresh(full=True)
            if self.drift_report is not None:  # the restored base is the one the end-of-fit hash must find
                self.drift_report["base_sha256"] = self.sync.base_digest()

    # ---- resume: rollouts are seeded by their place in the run (rollout/seed.py) ------------------
    @property
    def seed(self) -> int:
        """The run seed rollouts derive from: the resumed checkpoint's, else `seed_everything`'s."""
        return self._resumed_seed if self._resumed_seed is not None else run_seed()

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._resumed_seed = state_dict.get("seed")

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._resumed_seed = None  # a later fit without a checkpoint starts from its own seed

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer else " ".join(map(str, ids))

    # ---- per batch ------------------------------------------------------------------------------
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if not isinstance(batch, dict) or "prompt_ids" not in batch:
            raise TypeError("RolloutCallback needs dict batches with a `prompt_ids` list (see rl/prompts.py)")
        G = self.num_generations
        prompt_ids = [list(map(int, p)) for p in batch["prompt_ids"]]
        self.check_lengths(max(map(len, prompt_ids)), f" (a prompt of batch {batch_idx})")
        t0 = time.perf_counter()
        self.sync.refresh()
        t1 = time.perf_counter()
        expanded = repeat_groups(prompt_ids, G)
        before = dict(self.engine.stats)
        seed = rollout_seed(self.seed, trainer.current_epoch, batch_idx, trainer.global_step, trainer.global_rank)
        with seeded(pl_module.device, seed):
            seqs = list(self.engine.generate(expanded, sampling=self.sampling))
        extra = {k: repeat_groups(v, G) for k, v in batch.items() if k not in PROMPT_KEYS}
        prompts = repeat_groups(batch.get("prompt", [self._decode(p) for p in prompt_ids]), G)
        # what TRL passes every reward function besides the data's columns
        user_metrics: dict[str, list[float]] = {}
        self.extra_columns.clear()
        hooks = {"trainer_state": RewardState(trainer.global_step, trainer.current_epoch, trainer.max_steps),
                 "log_metric": lambda name, value: user_metrics.setdefault(name, []).append(float(value)),
                 "log_extra": lambda column, values: self.extra_columns.__setitem__(column, list(values))}

        def score(rows: list[int]) -> torch.Tensor:
            ids = [seqs[i].output for i in rows]
            chosen = [prompts[i] for i in rows]
            return rewards_by_function(self.reward_funcs, chosen, trl_completions(chosen, map(self._decode, ids)),
                                       ids, **{k: [v[i] for i in rows] for k, v in extra.items()}, **hooks)

        by_function = score(list(range(len(seqs))))
        total = weighted_total(by_function, self.reward_weights)
        refilled = 0
        # DAPO's dynamic sampling: groups whose rewards all equal are redrawn (fresh noise, same prompts) up to
        # `refill_rounds` times; what still ties is dropped by `rollout_batch`.
        for r in range(1, self.algorithm.refill_rounds + 1):
            redo = self.algorithm.groups_to_redraw(total, torch.tensor([len(s.output) for s in seqs]), G)
            if not redo:
                break
            rows = [g * G + j for g in redo for j in range(G)]
            with seeded(pl_module.device, (seed + r) % 2**63):
                for i, s in zip(rows, self.engine.generate([expanded[i] for i in rows], sampling=self.sampling)):
                    seqs[i] = s
            by_function[rows] = score(rows)
            total[rows] = weighted_total(by_function[rows], self.reward_weights)
            refilled += len(redo)
        t2 = time.perf_counter()
        completion_ids = [s.output for s in seqs]
        device = pl_module.device
        grpo, dropped = self.algorithm.rollout_batch(expanded, seqs, total, G, self.pad_token_id,
                                                     _gather_fn(trainer, device), trainer.global_rank)
        batch.update({k: v.to(device) for k, v in grpo.items()})
        for name, count in (("dropped_groups", dropped), ("refilled_groups", refilled)):
            pl_module.log(f"rollout/{name}", float(count), on_step=True, on_epoch=False, batch_size=len(seqs))
        lengths = torch.tensor([len(c) for c in completion_ids], dtype=torch.float32)
        stats = [*reward_stats(self.algorithm, by_function, self.reward_weights, reward_names(self.reward_funcs),
                               lengths, G),
                 ("completion_length", "mean", lengths), ("completion_length_min", "min", lengths),
                 ("completion_length_max", "max", lengths),
                 ("clipped_ratio", "mean", torch.tensor([float(s.finish_reason == "length") for s in seqs])),
                 ("refresh_s", "mean", torch.tensor(t1 - t0)), ("generate_s", "mean", torch.tensor(t2 - t1))]
        for name, kind, value in stats:
            # a Metric reduces over ranks too; Lightning only accepts Metric objects that are module attributes,
            # so this step's value is logged
            metric = self.metrics.setdefault(name, make_metric(kind).to(device))
            metric.update(value.to(device))
            pl_module.log(f"rollout/{name}", metric.compute(), on_step=True, on_epoch=False,
                          batch_size=len(seqs), prog_bar=name == "reward")
            metric.reset()
        for name, values in user_metrics.items():  # a reward function's `log_metric`: this rank's mean
            pl_module.log(f"rollout/log_metric/{name}", sum(values) / len(values), on_step=True, on_epoch=False,
                          batch_size=len(seqs))
        # How the engine ran this rollout: preemptions mean too few pages; eager decodes on CUDA mean no graph.
        for name in ("preemptions", "eager_decodes", "graph_replays", "capture_s", "decode_steps"):
            pl_module.log(f"rollout/{name}", float(self.engine.stats[name] - before[name]), on_step=True,
                          on_epoch=False, batch_size=len(seqs))
        routing = self.engine.routing
        if routing is not None and routing.steps:  # `engine.count_routed_experts`: the MoE decode roofline's bytes
            union = routing.mean_union()
            for name, value in (("routed_expert_fraction", routing.routed_fraction()),
                                ("moe_mean_union", sum(union) / len(union))):
                pl_module.log(f"rollout/{name}", value, on_step=True, on_epoch=False, batch_size=len(seqs))
            routing.reset()
        self._update_start = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        """Log the update's seconds (every micro-batch and optimizer step of this rollout), beside the rollout's
        `refresh_s` and `generate_s`: the three add up to the step."""
        if self._update_start is None:
            return
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)  # the update's kernels, not just their launches
        metric = self.metrics["update_s"]
        metric.update(torch.tensor(time.perf_counter() - self._update_start, device=pl_module.device))
        pl_module.log("rollout/update_s", metric.compute(), on_step=True, on_epoch=False, batch_size=1)
        metric.reset()
        self._update_start = None


def _reward_weights(weights: list[float] | None, count: int) -> torch.Tensor:
    """The weights of the reward functions' sum, checked: one finite number per function."""
    if weights is None:
        return torch.ones(count)
    if len(weights) != count:
        raise ConfigError(f"{OPTION}.reward_weights", weights, f"gives {len(weights)} weight{'s' * (len(weights) != 1)} "
                          f"for {count} reward function{'s' * (count != 1)}: give one per function, in the order of "
                          "`reward_funcs`")
    try:
        out = torch.tensor([float(w) for w in weights])
    except (TypeError, ValueError):
        out = torch.tensor([float("nan")])
    if not torch.isfinite(out).all():
        raise ConfigError(f"{OPTION}.reward_weights", weights, "must be finite numbers")
    return out


def _gather_fn(trainer: L.Trainer, device: torch.device) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """Concatenates a per-rank tensor over data-parallel ranks in rank order (None on one rank)."""
    if trainer.world_size <= 1:
        return None
    return lambda t: trainer.strategy.all_gather(t.to(device)).reshape(-1, *t.shape[1:]).cpu()


def _longest_prompt(datamodule: Any) -> int | None:
    """Length of the longest prompt of the datamodule (`max_prompt_length()`, as PromptDataModule has after
    `setup`); None when it cannot tell."""
    measure = getattr(datamodule, "max_prompt_length", None)
    return measure() if callable(measure) else None
