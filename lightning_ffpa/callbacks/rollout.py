"""Rollout Callback: before each training batch, refresh the inference copy, generate `num_generations`
completions per prompt with the paged engine, score them, and fill the batch for GRPO in place.

Drop-in for an existing Lightning project: the LightningModule only needs its HF model at
`model_attr` (peft-wrapped or plain) and a training_step that reads the keys written here:
`input_ids`, `attention_mask`, `completion_mask`, `old_logprobs`, `advantages`, `rewards`.
It owns the orchestration; the engine, LoRA sync and GRPO math live in their own files.
"""

from __future__ import annotations

import time
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info
from torchmetrics import MeanMetric

from lightning_ffpa.rl.grpo import group_advantages
from lightning_ffpa.rl.rewards import resolve_reward_funcs
from lightning_ffpa.rollout.engine import EngineConfig, RolloutEngine
from lightning_ffpa.rollout.lora_sync import LoraSync
from lightning_ffpa.rollout.sampler import SamplingParams


class RolloutCallback(L.Callback):
    """Generates GRPO groups between optimizer steps and feeds them to the batch."""

    def __init__(self, reward_funcs: list[str], num_generations: int = 4, max_new_tokens: int = 64,
                 temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, page_size: int = 128,
                 num_pages: int = 1024, max_batch_size: int = 64, max_seq_len: int = 1024,
                 max_prefill_tokens: int = 8192, cuda_graphs: bool = True, verify_no_drift: bool = False,
                 eos_token_ids: list[int] | None = None, tokenizer: str | None = None,
                 model_attr: str = "model", pad_token_id: int = 0, attention: str = "flex",
                 compile_decode: bool | None = None, inference_dtype: str | None = None) -> None:
        """
        Args:
            reward_funcs: Import paths `pkg.module:func` of TRL-signature reward functions (summed).
            num_generations: Completions per prompt (the GRPO group size G).
            max_new_tokens: Completion length cap.
            temperature: Sampling temperature (0 = greedy).
            top_p: Nucleus sampling mass.
            top_k: Top-k sampling (0 = off).
            page_size: KV page size in tokens.
            num_pages: KV pages per layer.
            max_batch_size: Most sequences decoded at once.
            max_seq_len: Longest prompt + completion.
            max_prefill_tokens: Token budget per packed prefill.
            cuda_graphs: Capture decode steps per batch bucket on CUDA.
            verify_no_drift: At fit start, check the base weights hash is unchanged over refreshes and the
                inference copy is deterministic (raises otherwise).
            eos_token_ids: Tokens that end a completion (default: the model config's eos_token_id).
            tokenizer: HF tokenizer to decode completions for reward functions (None: ids joined by spaces).
            model_attr: Attribute of the LightningModule holding the HF model.
            pad_token_id: Right-padding id of the GRPO batch.
            attention: "flex" (compiled on CUDA, eager on CPU) or "dense" (SDPA over the same masks; fast tiny CPU runs).
            compile_decode: torch.compile the whole decode step before graph capture, fusing small ops; null = on
                for CUDA, off on CPU.
            inference_dtype: Dtype of the inference copy ("bf16", "fp16", "fp32"); null = the strategy's compute
                dtype (`param_dtype` of FSDP2Strategy) if it has one, else the training weights' dtype. Under
                FSDP2 the stored weights are fp32 masters: a copy in their dtype would double its memory.
        """
        super().__init__()
        from lightning_ffpa.parallel.strategy import _dtype

        self.inference_dtype = _dtype(inference_dtype, "inference_dtype")  # a typo fails here, before any model
        if num_generations < 2:
            raise ValueError(f"`num_generations={num_generations}` must be >= 2 for group-normalised advantages")
        self.reward_paths = list(reward_funcs)
        self.reward_funcs = resolve_reward_funcs(self.reward_paths)  # fail before any model is built
        self.num_generations, self.max_new_tokens = num_generations, max_new_tokens
        self.sampling = SamplingParams(temperature, top_p, top_k)
        self.engine_config = EngineConfig(page_size=page_size, num_pages=num_pages, max_batch_size=max_batch_size,
                                          max_seq_len=max_seq_len, max_prefill_tokens=max_prefill_tokens,
                                          cuda_graphs=cuda_graphs, attention=attention,
                                          compile_decode=compile_decode)
        self.verify_no_drift, self.eos_token_ids = verify_no_drift, eos_token_ids
        self.tokenizer_name, self.model_attr, self.pad_token_id = tokenizer, model_attr, pad_token_id
        self.engine: RolloutEngine | None = None
        self.sync: LoraSync | None = None
        self.metrics = {k: MeanMetric() for k in ("reward", "completion_length", "refresh_s", "generate_s")}
        self.drift_report: dict[str, str] | None = None

    # ---- setup ----------------------------------------------------------------------------------
    def _build(self, pl_module: L.LightningModule) -> None:
        train = getattr(pl_module, self.model_attr)
        base = train.get_base_model() if hasattr(train, "get_base_model") else train
        compute = getattr(pl_module.trainer.strategy, "param_dtype", None) if pl_module._trainer else None
        dtype = self.inference_dtype or compute or next(base.parameters()).dtype
        device = pl_module.device
        saved_dtype = torch.get_default_dtype()
        torch.set_default_dtype(dtype)  # build in the final dtype: no fp32 staging copy of a 31B model
        try:
            with torch.device(device):  # a fresh model: no peft modules, weights filled by the sync
                inference = type(base)(base.config)
        finally:
            torch.set_default_dtype(saved_dtype)
        inference.eval().requires_grad_(False)
        self.sync = LoraSync(train, inference)
        self.sync.refresh(full=True)
        if self.verify_no_drift:
            self.drift_report = self.sync.verify_no_drift()
        eos = self.eos_token_ids
        if eos is None:
            e = getattr(base.config, "eos_token_id", None)
            eos = [] if e is None else ([e] if isinstance(e, int) else list(e))
        self.engine = RolloutEngine(inference, self.engine_config, set(eos))
        e = self.engine
        rank_zero_info(f"RolloutCallback: {dtype} inference copy; attention {e.attention_path}, decode step "
                       f"{e.decode_path}, CUDA graphs {'on' if e.on_cuda and e.config.cuda_graphs else 'off'}")
        self.tokenizer = None
        if self.tokenizer_name:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_name)
        for m in self.metrics.values():
            m.to(device)

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._build(pl_module)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer else " ".join(map(str, ids))

    # ---- per batch ------------------------------------------------------------------------------
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if not isinstance(batch, dict) or "prompt_ids" not in batch:
            raise TypeError("RolloutCallback needs dict batches with a `prompt_ids` list (see rl/prompts.py)")
        G = self.num_generations
        t0 = time.perf_counter()
        self.sync.refresh()
        t1 = time.perf_counter()
        prompt_ids = [list(map(int, p)) for p in batch["prompt_ids"]]
        expanded = [p for p in prompt_ids for _ in range(G)]
        before = dict(self.engine.stats)
        seqs = self.engine.generate(expanded, self.max_new_tokens, self.sampling)
        t2 = time.perf_counter()
        completion_ids = [s.output for s in seqs]
        extra = {k: [v for v in vals for _ in range(G)] for k, vals in batch.items()
                 if k not in ("prompt_ids", "prompt")}
        prompts = [p for p in batch.get("prompt", [self._decode(p) for p in prompt_ids]) for _ in range(G)]
        completions = [self._decode(c) for c in completion_ids]
        total = torch.zeros(len(seqs))
        for fn in self.reward_funcs:
            r = fn(prompts=prompts, completions=completions, completion_ids=completion_ids, **extra)
            total += torch.tensor([float("nan") if x is None else float(x) for x in r]).nan_to_num(0.0)
        device = pl_module.device
        self._fill(batch, expanded, seqs, total, device)
        lengths = torch.tensor([len(c) for c in completion_ids], dtype=torch.float32)
        for name, value in (("reward", total), ("completion_length", lengths),
                            ("refresh_s", torch.tensor(t1 - t0)), ("generate_s", torch.tensor(t2 - t1))):
            metric = self.metrics[name]
            metric.update(value.to(device))
            # Lightning only accepts Metric objects that are module attributes; log this step's value
            pl_module.log(f"rollout/{name}", metric.compute(), on_step=True, on_epoch=False,
                          batch_size=len(seqs), prog_bar=name == "reward")
            metric.reset()
        # How the engine ran this rollout: preemptions mean too few pages; eager decodes on CUDA mean no graph.
        for name in ("preemptions", "eager_decodes", "graph_replays", "capture_s"):
            pl_module.log(f"rollout/{name}", float(self.engine.stats[name] - before[name]), on_step=True,
                          on_epoch=False, batch_size=len(seqs))

    def _fill(self, batch: dict, prompts: list[list[int]], seqs, rewards: torch.Tensor, device) -> None:
        """Right-padded prompt+completion rows with masks, engine logprobs and advantages, written into `batch`."""
        rows = [p + s.output for p, s in zip(prompts, seqs)]
        L_ = max(len(r) for r in rows)
        N = len(rows)
        ids = torch.full((N, L_), self.pad_token_id, dtype=torch.long)
        attn = torch.zeros(N, L_, dtype=torch.long)
        comp = torch.zeros(N, L_, dtype=torch.long)
        old = torch.zeros(N, L_)
        for i, (p, s) in enumerate(zip(prompts, seqs)):
            n, m = len(p), len(s.output)
            ids[i, : n + m] = torch.tensor(p + s.output)
            attn[i, : n + m] = 1
            comp[i, n: n + m] = 1
            old[i, n: n + m] = torch.tensor(s.logprobs)
        batch.update(input_ids=ids.to(device), attention_mask=attn.to(device), completion_mask=comp.to(device),
                     old_logprobs=old.to(device), rewards=rewards.to(device),
                     advantages=group_advantages(rewards, self.num_generations).to(device))
