"""GRPO optimizer step on one GPU: TRL's `GRPOTrainer` (HF generate) vs our `GRPOModule` + `RolloutCallback`.

Same recipe in both rows, each run in its own process (`row_process.py`): the Gemma4-31B layer shapes at
`--layers` depth (default 12) with HF's random init (seed 0), bf16 weights, LoRA `--lora-r` on all linear layers
(q, k, v, o, gate, up, down), `--prompts` random `--prompt-len`-token prompts per step, `--group` completions each
(one generation and one optimizer step per batch: TRL `steps_per_generation=1`, `num_iterations=1`,
`gradient_accumulation_steps=1`), `--completion-len` tokens per completion at temperature 1.0 / top-p 1.0 with
EOS suppressed (TRL: `min_new_tokens`; ours: no EOS ids), no activation checkpointing, AdamW at `--lr`,
`--beta` KL (0: no reference pass), per-sequence mean loss (TRL `loss_type="grpo"`), constant learning rate and
no gradient clipping (TRL `lr_scheduler_type="constant"`, `max_grad_norm=0`), the same toy reward
(`token_range_reward`), the ratio over the policy's own detached logprobs (TRL with `num_iterations=1`; ours
`old_logprobs: policy`, plus the engine's truncated importance weights, `sampler_is_cap`, recorded per row). TRL generates with HF `generate` (no vLLM on the device image), one row per generation
option it offers (`TRL_GENERATION`): its default dynamic cache, a static cache, and HF's continuous batching;
the ratios divide by the fastest that finished. Each TRL row records `trl` and `transformers` versions, or
the ImportError when trl is absent.

Per optimizer step after `--warmup` steps: wall seconds (median, min, max), completion tokens/s, and phases:
generation (ours: LoRA refresh + engine, also apart as `refresh_s`; TRL: `_generate`), scoring (rewards, advantages, batch layout; TRL also
its old/ref logprob passes when it needs them), update (the rest: forward, backward, optimizer step).

    python benchmarks/grpo_vs_trl.py --out $OUT/grpo_vs_trl.json
    python benchmarks/grpo_vs_trl.py --smoke --out /tmp/grpo.json      # CPU, tiny preset
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.results_io import write_result  # noqa: E402
from benchmarks.row_process import row_main, run_rows  # noqa: E402

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# TRL's generation options without vLLM (not on the device image), each a row: the ratio divides by the fastest.
TRL_GENERATION: dict[str, dict[str, Any]] = {
    "trl_grpo": {},  # HF generate, dynamic cache
    "trl_grpo_static_cache": {"cache_implementation": "static"},  # TRL disables generate's compile either way
    "trl_grpo_continuous_batching": {"use_transformers_continuous_batching": True},  # HF's paged generate
}
ROWS = ("ours_grpo", *TRL_GENERATION)


class StepClock:
    """Per-step wall time and phases, synchronising the device at each mark."""

    def __init__(self, device: str) -> None:
        self.device, self.steps, self.cur = device, [], {}

    def now(self) -> float:
        if self.device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()

    def wrap(self, obj: Any, method: str, phase: str) -> None:
        """Time every call of `obj.method` into the current step's `phase` (an instance attribute shadows it)."""
        inner = getattr(obj, method)

        def timed(*args, **kwargs):
            t = self.now()
            try:
                return inner(*args, **kwargs)
            finally:
                self.cur[phase] = self.cur.get(phase, 0.0) + self.now() - t

        setattr(obj, method, timed)

    def begin(self) -> None:
        self.cur = {"t0": self.now()}

    def end(self, completion_tokens: int) -> None:
        c = self.cur
        wall = self.now() - c.pop("t0")
        step = {"wall_s": wall, "completion_tokens": completion_tokens, **c}
        step["update_s"] = wall - sum(v for k, v in c.items())
        self.steps.append(step)


def random_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab, (n, length), generator=g).tolist()


def measure_ours(spec: dict[str, Any]) -> dict[str, Any]:
    import lightning as L

    from lightning_ffpa.callbacks.rollout import RolloutCallback
    from lightning_ffpa.data.prompts import PromptDataModule
    from lightning_ffpa.rl.module import GRPOModule
    from lightning_ffpa.rl.rewards import token_range_reward
    from lightning_ffpa.rollout.engine import EngineConfig
    from lightning_ffpa.rollout.sampler import SamplingParams

    cuda = spec["device"] == "cuda"
    n, page = spec["prompts"] * spec["group"], spec["page_size"]
    max_len = -(-(spec["prompt_len"] + spec["completion_len"]) // page) * page
    clock = StepClock(spec["device"])
    rollout = RolloutCallback(
        [token_range_reward], num_generations=spec["group"], eos_token_ids=[],
        sampling=SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=spec["completion_len"]),
        engine=EngineConfig(page_size=page, num_pages=n * (max_len // page) + 2, max_batch_size=n,
                            max_seq_len=max_len, max_prefill_tokens=16384,
                            **({} if cuda else {"attention": "dense"})))

    gaps: list[float] = []  # train/sampler_logprob_gap of each step: the engine's logprobs against the policy's

    def read_gap(trainer) -> None:  # Lightning has the step's logged values once its batch hooks are done
        if "train/sampler_logprob_gap" in trainer.callback_metrics:
            gaps.append(float(trainer.callback_metrics["train/sampler_logprob_gap"]))

    class Begin(L.Callback):  # first: the step starts before the rollout Callback runs
        def on_train_batch_start(self, trainer, *args) -> None:
            if trainer.global_step:
                read_gap(trainer)
            clock.begin()

        def on_train_end(self, trainer, pl_module) -> None:
            read_gap(trainer)

    class After(L.Callback):  # after the rollout Callback: its time minus the engine's is scoring
        def on_fit_start(self, trainer, pl_module) -> None:
            clock.wrap(rollout.sync, "refresh", "refresh_s")
            clock.wrap(rollout.engine, "generate", "generation_s")

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            c = clock.cur
            c["scoring_s"] = clock.now() - c["t0"] - c.get("refresh_s", 0.0) - c.get("generation_s", 0.0)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            clock.end(int(batch["completion_mask"].sum()))

    torch.manual_seed(0)
    module = GRPOModule(preset=spec["preset"], config_overrides={"num_hidden_layers": spec["layers"]},
                        dtype="bfloat16" if cuda else "float32", learning_rate=spec["lr"], beta=spec["beta"],
                        lora={"r": spec["lora_r"], "lora_alpha": 2 * spec["lora_r"], "target_modules": LORA_TARGETS},
                        temperature=1.0)
    trainer = L.Trainer(max_steps=spec["steps"], accelerator="gpu" if cuda else "cpu", devices=1,
                        precision="bf16-true" if cuda else "32-true", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[Begin(), rollout, After()])
    data = PromptDataModule(num_random_prompts=spec["prompts"] * spec["steps"], prompt_len=spec["prompt_len"],
                            vocab_size=spec["vocab"], batch_size=spec["prompts"])
    trainer.fit(module, datamodule=data)
    e = rollout.engine
    return {"per_step": clock.steps, "engine": {"attention_path": e.attention_path, "decode_path": e.decode_path,
                                             "graph_replays": e.stats["graph_replays"]},
            "sampler_logprob_gap_per_step": gaps,
            "sampler_logprob_gap_median": statistics.median(gaps) if gaps else None,
            "attn_implementation": module.hparams.attn_implementation, "trainer_precision": str(trainer.precision),
            "old_logprobs": module.hparams.old_logprobs, "sampler_is_cap": module.hparams.sampler_is_cap}


def word_tokenizer(vocab: int):
    """A tokenizer whose words are token ids ("17 4093" -> [17, 4093]): prompts keep their exact length."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"<pad>": 0, "<eos>": 1, **{str(i): i for i in range(2, vocab)}}
    tok = Tokenizer(models.WordLevel(words, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def measure_trl(spec: dict[str, Any]) -> dict[str, Any]:
    try:
        import trl
        from datasets import Dataset
        from trl import GRPOConfig, GRPOTrainer
    except ImportError as err:  # recorded, not estimated: the lead carries the wheels (DEVICE_EXTRA_WHEELS)
        return {"error": f"ImportError: {err}"}
    import transformers
    from peft import LoraConfig
    from transformers import Gemma4ForCausalLM, TrainerCallback

    from benchmarks.rollout_hf import GLOBAL_ACCESS, CBErrors
    from lightning_ffpa.presets import build_text_config
    from lightning_ffpa.rl.rewards import token_range_reward

    cuda = spec["device"] == "cuda"
    clock = StepClock(spec["device"])
    torch.manual_seed(0)
    cfg = build_text_config(spec["preset"], num_hidden_layers=spec["layers"])
    saved = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16 if cuda else torch.float32)
    try:
        with torch.device(spec["device"]):
            model = Gemma4ForCausalLM(cfg)
    finally:
        torch.set_default_dtype(saved)
    model.generation_config.eos_token_id = None
    if TRL_GENERATION[spec["name"]].get("use_transformers_continuous_batching"):
        # as in rollout.py's HF continuous-batching row: past HF's guard on Gemma4's per-layer head counts
        if getattr(model.config, GLOBAL_ACCESS, None) is not None:
            setattr(model.config, GLOBAL_ACCESS, True)
    prompts = random_prompts(spec["prompts"] * spec["steps"], spec["prompt_len"], spec["vocab"])
    data = Dataset.from_list([{"prompt": " ".join(map(str, p))} for p in prompts])
    n = spec["prompts"] * spec["group"]
    args = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl_grpo_"), per_device_train_batch_size=n, num_generations=spec["group"],
        gradient_accumulation_steps=1, steps_per_generation=1, num_iterations=1, max_steps=spec["steps"],
        max_completion_length=spec["completion_len"], temperature=1.0, top_p=1.0, top_k=0,
        generation_kwargs={"min_new_tokens": spec["completion_len"]}, learning_rate=spec["lr"], beta=spec["beta"],
        loss_type="grpo", gradient_checkpointing=False, bf16=cuda, use_cpu=not cuda, report_to=[],
        lr_scheduler_type="constant", max_grad_norm=0.0,  # as ours: constant rate, no clipping
        save_strategy="no", logging_steps=spec["steps"], disable_tqdm=True, seed=0, dataloader_num_workers=0,
        **TRL_GENERATION[spec["name"]])
    trainer = GRPOTrainer(model=model, reward_funcs=[token_range_reward], args=args, train_dataset=data,
                          processing_class=word_tokenizer(spec["vocab"]),
                          peft_config=LoraConfig(r=spec["lora_r"], lora_alpha=2 * spec["lora_r"],
                                                 target_modules=LORA_TARGETS))
    made = []
    generate = trainer._generate

    def counted(prompts_):  # completion tokens of this step, from what TRL's generation returned
        out = generate(prompts_)
        made.append(sum(len(c) for c in out[1]))
        return out

    trainer._generate = counted
    clock.wrap(trainer, "_generate", "generation_s")
    clock.wrap(trainer, "_generate_and_score_completions", "_gen_and_score_s")

    class Steps(TrainerCallback):
        def on_step_begin(self, *a, **k) -> None:
            clock.begin()

        def on_step_end(self, *a, **k) -> None:
            c = clock.cur
            c["scoring_s"] = c.pop("_gen_and_score_s", 0.0) - c.get("generation_s", 0.0)
            clock.end(made[-1] if made else 0)

    trainer.add_callback(Steps())
    with CBErrors() as cb_errors:  # HF continuous batching logs its failures and returns fewer outputs
        try:
            trainer.train()
        except Exception as err:
            if cb_errors.first is None:
                raise
            raise RuntimeError(f"{type(err).__name__}: {err}, after HF continuous batching logged "
                               f"{cb_errors.first}") from err
    return {"per_step": clock.steps, "trl_version": trl.__version__, "transformers_version": transformers.__version__,
            "generation_backend": "transformers.generate (use_vllm=False)",
            "generation_options": TRL_GENERATION[spec["name"]] or "TRL's defaults (dynamic cache)",
            "bf16": args.bf16, "loss_type": args.loss_type}


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    """One row: run it, then the per-step medians of the steps after warm-up."""
    if spec["device"] == "cuda":
        torch.cuda.reset_peak_memory_stats()
    row = (measure_ours if spec["name"] == "ours_grpo" else measure_trl)(spec)
    if spec["device"] == "cuda":
        row.update(peak_mem_gb=torch.cuda.max_memory_allocated() / 2**30,
                   peak_reserved_gb=torch.cuda.max_memory_reserved() / 2**30)
    timed = row.get("per_step", [])[spec["warmup"]:]
    if "error" not in row and not timed:
        row["error"] = f"no step after the {spec['warmup']} warm-up steps"
    if timed:
        walls = [s["wall_s"] for s in timed]
        row.update(timed_steps=len(timed), step_s_median=statistics.median(walls), step_s_min=min(walls),
                   step_s_max=max(walls),
                   completion_tokens_per_step=statistics.median(s["completion_tokens"] for s in timed),
                   completion_tokens_per_s=statistics.median(s["completion_tokens"] / s["wall_s"] for s in timed),
                   phases_s_median={p: statistics.median(s.get(p, 0.0) for s in timed)
                                    for p in ("refresh_s", "generation_s", "scoring_s", "update_s")})
    return row


def summarize(rows: list[dict]) -> dict[str, Any]:
    """Ratios against the fastest TRL row that finished (`trl_baseline` names it), and against each TRL row."""
    by = {r["name"]: r for r in rows}
    ours = by.get("ours_grpo", {})
    trls = [by[n] for n in TRL_GENERATION if "step_s_median" in by.get(n, {})]
    out: dict[str, Any] = {}
    if "step_s_median" in ours and trls:
        trl = min(trls, key=lambda r: r["step_s_median"])
        out["trl_baseline"] = f"{trl['name']}, the fastest of the TRL rows that finished ({len(trls)})"
        out["ours_vs_trl_step_speedup"] = trl["step_s_median"] / ours["step_s_median"]
        out["ours_vs_trl_completion_tps"] = ours["completion_tokens_per_s"] / trl["completion_tokens_per_s"]
        po, pt = ours["phases_s_median"], trl["phases_s_median"]
        for p in ("generation_s", "scoring_s", "update_s"):
            o = po[p] + (po["refresh_s"] if p == "generation_s" else 0.0)  # ours generates after a LoRA refresh
            out[f"ours_vs_trl_{p[:-2]}_speedup"] = pt[p] / o if o > 0 else None
        for r in trls:
            out[f"ours_vs_{r['name']}_step_speedup"] = r["step_s_median"] / ours["step_s_median"]
    for name, r in by.items():
        if "error" in r:
            out[f"{name}_error"] = r["error"][:300]
    r = rows[0] if rows else {}
    out["model_slice"] = (f"{r.get('layers')} of 60 layers of the Gemma4-31B shapes ({r.get('preset')}), random "
                          f"weights, LoRA r={r.get('lora_r')} on all linear layers, {r.get('prompts')} prompts x "
                          f"{r.get('group')} completions, {r.get('prompt_len')}+{r.get('completion_len')} tokens")
    out["rows_in_own_process"] = all(x.get("process", {}).get("pid") for x in rows if "error" not in x)
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default=",".join(ROWS), help=f"of {', '.join(ROWS)}")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--prompts", type=int, default=2, help="prompts per optimizer step")
    ap.add_argument("--group", type=int, default=8, help="completions per prompt (GRPO group size)")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--completion-len", type=int, default=192)
    ap.add_argument("--steps", type=int, default=8, help="optimizer steps, warm-up included")
    ap.add_argument("--warmup", type=int, default=2, help="steps left out of the medians (compile, capture)")
    ap.add_argument("--lora-r", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--beta", type=float, default=0.0)
    ap.add_argument("--page-size", type=int, default=128)
    ap.add_argument("--preset", default="gemma4-31b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny preset, 2 layers, short lengths, 3 steps")
    ap.add_argument("--row-timeout", type=float, default=540.0)
    ap.add_argument("--budget", type=float, default=570.0)
    ap.add_argument("--out", default=None)
    ap.add_argument("--logs", default=None, help="per-row logs (default: <out>.logs)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.preset, args.device, args.layers, args.prompts, args.group = "tiny", "cpu", 2, 2, 2
        args.prompt_len, args.completion_len, args.steps, args.warmup, args.page_size = 4, 6, 3, 1, 4
    bad = [r for r in args.rows.split(",") if r not in ROWS]
    if bad:
        ap.error(f"--rows: unknown {bad}; choose from {', '.join(ROWS)}")
    if args.warmup >= args.steps:
        ap.error(f"--warmup={args.warmup} must be below --steps={args.steps}")
    return args


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    from lightning_ffpa.presets import build_text_config

    vocab = build_text_config(args.preset).vocab_size
    keys = ("layers", "prompts", "group", "prompt_len", "completion_len", "steps", "warmup", "lora_r", "lr", "beta",
            "page_size", "preset", "device")
    specs = [{"name": r, "vocab": vocab, **{k: getattr(args, k) for k in keys}} for r in args.rows.split(",")]
    out = Path(args.out) if args.out else Path(__file__).resolve().parent / "results" / "grpo_vs_trl.json"
    logs = Path(args.logs) if args.logs else out.with_suffix(".logs")

    def save(done: list[dict]) -> None:
        summary = summarize(done)
        if len(done) < len(specs):
            summary["partial"] = True
        write_result("grpo_vs_trl", done, summary, out=out, driver_pid=os.getpid())

    return run_rows(Path(__file__).resolve(), specs, logs, args.row_timeout, args.budget, save)


if __name__ == "__main__":
    if not row_main(None, measure):
        main()
