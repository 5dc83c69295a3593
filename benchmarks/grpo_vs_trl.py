"""GRPO optimizer step on one GPU: TRL's `GRPOTrainer` (HF generate; the version that ran is recorded in each TRL
row, 1.15.0 in `grpo_vs_trl.json`) vs our `GRPOModule` + `RolloutCallback`.

The same algorithm in both rows, each run in its own process (`row_process.py`); the update's recipe is each
side's own (ours compiles per layer and chunks the log-probs; TRL's runs as TRL runs it, without either): the
Gemma4-31B layer shapes at
`--layers` depth (default 12; 60 is full depth) with HF's random init (seed 0), bf16 weights, LoRA `--lora-r` on
all linear layers (q, k, v, o, gate, up, down), `--prompts` random `--prompt-len`-token prompts per step,
`--group` completions each (one generation and one optimizer step per batch: TRL `steps_per_generation` equal
to its `gradient_accumulation_steps`, `num_iterations=1`), `--completion-len` tokens per completion at
temperature 1.0 / top-p 1.0 with EOS suppressed (TRL: `min_new_tokens`; ours: no EOS ids), AdamW at `--lr`,
`--beta` KL (0: no reference pass), the same `--loss-type` (default dapo, TRL's default; gspo is TRL's
`importance_sampling_level="sequence"`) and `--scale-rewards` in both, constant learning rate and no gradient
clipping (TRL `lr_scheduler_type="constant"`, `max_grad_norm=0`), the ratio over the policy's own detached
logprobs (TRL with `num_iterations=1`; ours `old_logprobs: policy`, plus the engine's truncated importance
weights, `sampler_is_cap`, recorded per row). The reward (`lower_half_vocab`) is the fraction of a completion's
tokens in the lower half of the vocabulary: it varies within a group even at random init (the rows record each
rollout's within-group reward std and how many groups had none).

Memory options per row, recorded: ours splits the step's completions into `--max-tokens-per-microbatch`
forwards (chunked log-probs always); TRL into `--trl-micro-batch` sequences per forward (its
`per_device_train_batch_size`, accumulated over one generation) and optionally `--trl-gradient-checkpointing`.
Our row uses the Callback's engine defaults (only sizes are set: `--num-pages`, default every sequence's whole
length). Peak memory allocated and reserved per row (the target: ours at equal or lower peak than TRL).

TRL generates with HF `generate` (no vLLM on the device image), one row per generation option it offers
(`TRL_GENERATION`): its default dynamic cache, a static cache, and HF's continuous batching; the ratios divide
by the fastest that finished. Each TRL row records `trl` and `transformers` versions, or the ImportError.

Wall budget. The GPU call ends at 600 s, so each row gets `--row-wall-s` (default: the call's `--budget` split
over the rows, less a teardown margin) counted from its process start: after each step the row stops if one
more step like the last would end past it, and records the steps it finished and each one's time
(`wall_budget_stop`); a row short of `--min-steps` timed steps says so. Estimate at full depth (60 layers,
H200): HF generate runs ~112 completion tok/s at batch 16 (~7 decode steps/s, about the same at batch 8), so
a TRL step takes about completion_len / 7 s to generate plus ~5-20 s to update, after ~60 s to build the model:
in one ~540 s row, 512-token completions fit ~6 steps (warm-up + 5), 1024 about 3, 2048 one, 4096 none (a
generation alone is ~590 s). Run longer completions one row per call (`--rows trl_grpo`, then `--rows
ours_grpo --resume <file>`) and report the steps they finished; the script prints its estimate first.

Per optimizer step after `--warmup` steps: wall seconds (median, min, max), completion tokens/s, and phases:
generation (ours: LoRA refresh + engine, also apart as `refresh_s`; TRL: `_generate`), scoring (rewards, advantages, batch layout; TRL also
its old/ref logprob passes when it needs them), update (the rest: forward, backward, optimizer step). Summary
key `grpo_full_depth_ours_vs_trl_step` (median step seconds, TRL / ours) when both rows ran all of the preset's
layers with `--min-steps` timed steps; `ours_vs_trl_step_speedup` at any depth.

    python benchmarks/grpo_vs_trl.py --rows trl_grpo --layers 60 --prompt-len 512 --completion-len 512 \
        --group 16 --prompts 1 --out $OUT/grpo_vs_trl_full.json
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
from benchmarks.grpo_budget import StepClock, lower_half_vocab_reward, reward_spread, trl_call_estimate  # noqa: E402
from benchmarks.report.results_io import write_result  # noqa: E402
from benchmarks.row_process import row_main, run_rows  # noqa: E402

T0 = time.perf_counter()  # the row process's start, near enough: its wall budget counts from here
TEARDOWN_S = 30.0  # after its last step a row writes its result and exits within this
TRL_LABEL = "HF generate (vLLM is not installable on this image)"

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# TRL's generation options without vLLM (not on the device image), each a row: the ratio divides by the fastest.
TRL_GENERATION: dict[str, dict[str, Any]] = {
    "trl_grpo": {},  # HF generate, dynamic cache
    "trl_grpo_static_cache": {"cache_implementation": "static"},  # TRL disables generate's compile either way
    "trl_grpo_continuous_batching": {"use_transformers_continuous_batching": True},  # HF's paged generate
}
ROWS = ("ours_grpo", *TRL_GENERATION)
LOSS_TYPES = ("grpo", "bnpo", "dapo", "dr_grpo", "gspo")  # ours; TRL 1.16 spells gspo as a sequence-level ratio
TRL_LOSS = {"gspo": {"loss_type": "grpo", "importance_sampling_level": "sequence"}}


def random_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab, (n, length), generator=g).tolist()


def measure_ours(spec: dict[str, Any]) -> dict[str, Any]:
    import lightning as L

    from lightning_ffpa.callbacks.rollout import RolloutCallback
    from lightning_ffpa.data.prompts import PromptDataModule
    from lightning_ffpa.rl.module import GRPOModule
    from lightning_ffpa.rollout.engine import EngineConfig
    from lightning_ffpa.rollout.sampler import SamplingParams

    cuda = spec["device"] == "cuda"
    n, page = spec["prompts"] * spec["group"], spec["page_size"]
    max_len = -(-(spec["prompt_len"] + spec["completion_len"]) // page) * page
    clock = StepClock(spec["device"], T0 + spec["row_wall_s"])
    rewards: list[list[float]] = []
    # Sizes only: every other engine option (weight sharing, sliding-window KV, compile, graphs) is the default.
    rollout = RolloutCallback(
        [lower_half_vocab_reward(spec["vocab"], rewards)], num_generations=spec["group"], eos_token_ids=[],
        sampling=SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=spec["completion_len"]),
        engine=EngineConfig(page_size=page, num_pages=spec["num_pages"] or n * (max_len // page) + 2,
                            max_batch_size=n, max_seq_len=max_len, max_prefill_tokens=16384,
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
            if clock.out_of_time():
                trainer.should_stop = True

    torch.manual_seed(0)
    module = GRPOModule(preset=spec["preset"], config_overrides={"num_hidden_layers": spec["layers"]},
                        dtype="bfloat16" if cuda else "float32", learning_rate=spec["lr"], beta=spec["beta"],
                        lora={"r": spec["lora_r"], "lora_alpha": 2 * spec["lora_r"], "target_modules": LORA_TARGETS},
                        temperature=1.0, loss_type=spec["loss_type"], scale_rewards=spec["scale_rewards"],
                        num_iterations=1, max_tokens_per_microbatch=spec["max_tokens_per_microbatch"])
    trainer = L.Trainer(max_steps=spec["steps"], accelerator="gpu" if cuda else "cpu", devices=1,
                        precision="bf16-true" if cuda else "32-true", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[Begin(), rollout, After()])
    data = PromptDataModule(num_random_prompts=spec["prompts"] * spec["steps"], prompt_len=spec["prompt_len"],
                            vocab_size=spec["vocab"], batch_size=spec["prompts"])
    trainer.fit(module, datamodule=data)
    e = rollout.engine
    hp = module.hparams
    return {"per_step": clock.steps, "engine": {"attention_path": e.attention_path, "decode_path": e.decode_path,
                                             "graph_replays": e.stats["graph_replays"],
                                             "num_pages": rollout.engine_config.num_pages},
            "sampler_logprob_gap_per_step": gaps,
            "sampler_logprob_gap_median": statistics.median(gaps) if gaps else None,
            "reward": reward_spread(rewards, spec["group"]),
            "attn_implementation": hp.attn_implementation, "trainer_precision": str(trainer.precision),
            "old_logprobs": hp.old_logprobs, "sampler_is_cap": hp.sampler_is_cap, "loss_type": hp.loss_type,
            "scale_rewards": hp.scale_rewards, "num_iterations": hp.num_iterations,
            "max_tokens_per_microbatch": hp.max_tokens_per_microbatch, "logprob_chunk_size": hp.logprob_chunk_size}


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

    cuda = spec["device"] == "cuda"
    clock = StepClock(spec["device"], T0 + spec["row_wall_s"])
    rewards: list[list[float]] = []
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
    mb = spec["trl_micro_batch"] or n  # one generation of n completions, accumulated over n // mb forwards
    loss = TRL_LOSS.get(spec["loss_type"], {"loss_type": spec["loss_type"]})
    args = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl_grpo_"), per_device_train_batch_size=mb, num_generations=spec["group"],
        gradient_accumulation_steps=n // mb, steps_per_generation=n // mb, num_iterations=1, max_steps=spec["steps"],
        max_completion_length=spec["completion_len"], temperature=1.0, top_p=1.0, top_k=0,
        generation_kwargs={"min_new_tokens": spec["completion_len"]}, learning_rate=spec["lr"], beta=spec["beta"],
        scale_rewards=spec["scale_rewards"], epsilon=0.2, **loss,  # ours: clip_eps 0.2, clip_eps_high = clip_eps
        gradient_checkpointing=spec["trl_gradient_checkpointing"], bf16=cuda, use_cpu=not cuda, report_to=[],
        lr_scheduler_type="constant", max_grad_norm=0.0,  # as ours: constant rate, no clipping
        save_strategy="no", logging_steps=spec["steps"], disable_tqdm=True, seed=0, dataloader_num_workers=0,
        **TRL_GENERATION[spec["name"]])
    trainer = GRPOTrainer(model=model, reward_funcs=[lower_half_vocab_reward(spec["vocab"], rewards)], args=args,
                          train_dataset=data,
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

        def on_step_end(self, args_, state, control, **k):
            c = clock.cur
            c["scoring_s"] = c.pop("_gen_and_score_s", 0.0) - c.get("generation_s", 0.0)
            clock.end(made[-1] if made else 0)
            if clock.out_of_time():
                control.should_training_stop = True
            return control

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
            "generation_backend": "transformers.generate (use_vllm=False)", "label": TRL_LABEL,
            "generation_options": TRL_GENERATION[spec["name"]] or "TRL's defaults (dynamic cache)",
            "reward": reward_spread(rewards, spec["group"]),
            "bf16": args.bf16, "loss_type": args.loss_type, "importance_sampling_level": args.importance_sampling_level,
            "scale_rewards": args.scale_rewards, "num_iterations": args.num_iterations, "beta": args.beta,
            "per_device_train_batch_size": args.per_device_train_batch_size,
            "gradient_accumulation_steps": args.gradient_accumulation_steps,
            "gradient_checkpointing": args.gradient_checkpointing}


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    """One row: run it, then the per-step medians of the steps after warm-up, and how the wall budget ended it."""
    if spec["device"] == "cuda":
        torch.cuda.reset_peak_memory_stats()
    row = (measure_ours if spec["name"] == "ours_grpo" else measure_trl)(spec)
    if spec["device"] == "cuda":
        row.update(peak_mem_gb=torch.cuda.max_memory_allocated() / 2**30,
                   peak_reserved_gb=torch.cuda.max_memory_reserved() / 2**30)
    steps = row.get("per_step", [])
    timed = steps[spec["warmup"]:]
    if "error" not in row:
        row.update(steps_finished=len(steps), wall_budget_stop=len(steps) < spec["steps"],
                   min_steps_met=len(timed) >= spec["min_steps"])
        if row["wall_budget_stop"]:
            row["wall_budget_note"] = (f"stopped after {len(steps)} of {spec['steps']} steps: one more would end past "
                                       f"the row's {spec['row_wall_s']:.0f} s wall budget")
    if "error" not in row and not timed:
        row["error"] = f"no step after the {spec['warmup']} warm-up steps (finished {len(steps)})"
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
    """Ratios against the fastest TRL row that finished (`trl_baseline` names it), and against each TRL row;
    at the preset's full depth with `min_steps` timed steps in both, `grpo_full_depth_ours_vs_trl_step`."""
    by = {r["name"]: r for r in rows}
    ours = by.get("ours_grpo", {})
    trls = [by[n] for n in TRL_GENERATION if "step_s_median" in by.get(n, {})]
    out: dict[str, Any] = {"trl_generation": TRL_LABEL}
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
        if ours.get("peak_mem_gb") and trl.get("peak_mem_gb"):
            out["ours_vs_trl_peak_mem"] = ours["peak_mem_gb"] / trl["peak_mem_gb"]  # <= 1: the target
        full = ours.get("layers") is not None and ours.get("layers") == ours.get("full_layers")
        enough = all(r.get("min_steps_met", True) for r in (ours, trl))
        if full and enough:
            out["grpo_full_depth_ours_vs_trl_step"] = out["ours_vs_trl_step_speedup"]
        elif full:
            out["grpo_full_depth_ours_vs_trl_step_missing"] = (
                f"fewer than {ours.get('min_steps')} timed steps: ours {ours.get('timed_steps')}, "
                f"{trl['name']} {trl.get('timed_steps')} (ours_vs_trl_step_speedup is over those)")
    for name, r in by.items():
        if "error" in r:
            out[f"{name}_error"] = r["error"][:300]
        if r.get("peak_mem_gb") is not None:
            out[f"{name}_peak_mem_gib"] = r["peak_mem_gb"]
            out[f"{name}_peak_reserved_gib"] = r.get("peak_reserved_gb")
        if "reward" in r:
            out[f"{name}_reward_zero_std_groups"] = f"{r['reward']['zero_std_groups']} of {r['reward']['groups']}"
        if r.get("min_steps_met") is False:
            out[f"{name}_short_of_min_steps"] = (f"{r.get('timed_steps', 0)} timed of {r.get('min_steps')} "
                                                 f"({r.get('wall_budget_note', '')})")
    r = rows[0] if rows else {}
    out["model_slice"] = (f"{r.get('layers')} of {r.get('full_layers', 60)} layers of the Gemma4-31B shapes "
                          f"({r.get('preset')}), random weights, LoRA r={r.get('lora_r')} on all linear layers, "
                          f"{r.get('prompts')} prompts x {r.get('group')} completions, "
                          f"{r.get('prompt_len')}+{r.get('completion_len')} tokens, loss {r.get('loss_type')}, "
                          f"scale_rewards {r.get('scale_rewards')}, beta {r.get('beta')}")
    out["rows_in_own_process"] = all(x.get("process", {}).get("pid") for x in rows if "error" not in x)
    return out


SPEC_KEYS = ("layers", "prompts", "group", "prompt_len", "completion_len", "steps", "warmup", "min_steps", "lora_r",
             "lr", "beta", "loss_type", "scale_rewards", "max_tokens_per_microbatch", "trl_micro_batch",
             "trl_gradient_checkpointing", "num_pages", "page_size", "preset", "device")
SAME_RECIPE = ("layers", "prompts", "group", "prompt_len", "completion_len", "lora_r", "lr", "beta", "loss_type",
               "scale_rewards", "preset", "device")  # a resumed row must match these


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default=",".join(ROWS), help=f"of {', '.join(ROWS)}")
    ap.add_argument("--layers", type=int, default=12, help="decoder layers (the preset's count is full depth: 60)")
    ap.add_argument("--prompts", type=int, default=2, help="prompts per optimizer step")
    ap.add_argument("--group", type=int, default=8, help="completions per prompt (GRPO group size)")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--completion-len", type=int, default=192)
    ap.add_argument("--steps", type=int, default=8, help="optimizer steps at most, warm-up included")
    ap.add_argument("--warmup", type=int, default=2, help="steps left out of the medians (compile, capture)")
    ap.add_argument("--min-steps", type=int, default=5, help="timed steps a row must finish to count as measured")
    ap.add_argument("--lora-r", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--beta", type=float, default=0.0)
    ap.add_argument("--loss-type", default="dapo", choices=LOSS_TYPES, help="both rows (dapo: TRL's default)")
    ap.add_argument("--scale-rewards", default="group", choices=("group", "batch", "none"), help="both rows")
    ap.add_argument("--max-tokens-per-microbatch", type=int, default=None,
                    help="ours: padded tokens per forward of the update (default: one forward)")
    ap.add_argument("--trl-micro-batch", type=int, default=None,
                    help="TRL: sequences per forward of the update (default: all of the step's)")
    ap.add_argument("--trl-gradient-checkpointing", action="store_true", help="TRL: HF's per-layer recompute")
    ap.add_argument("--num-pages", type=int, default=None,
                    help="ours: KV pages (default: every sequence's whole length in every layer)")
    ap.add_argument("--page-size", type=int, default=128)
    ap.add_argument("--preset", default="gemma4-31b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny preset, 2 layers, short lengths, 3 steps")
    ap.add_argument("--row-timeout", type=float, default=540.0, help="a row's process is killed after this")
    ap.add_argument("--row-wall-s", type=float, default=None,
                    help=f"each row's steps stop before this many seconds from its start (default: --budget over "
                         f"the rows, less {TEARDOWN_S:.0f} s each to exit)")
    ap.add_argument("--budget", type=float, default=570.0)
    ap.add_argument("--resume", default=None, help="an earlier result of the same recipe: keep its rows not rerun")
    ap.add_argument("--out", default=None)
    ap.add_argument("--logs", default=None, help="per-row logs (default: <out>.logs)")
    if ap.parse_args(argv).smoke:  # the smoke's defaults; options given beside --smoke still apply
        ap.set_defaults(preset="tiny", device="cpu", layers=2, prompts=2, group=2, prompt_len=4, completion_len=6,
                        steps=3, warmup=1, page_size=4)
    args = ap.parse_args(argv)
    bad = [r for r in args.rows.split(",") if r not in ROWS]
    if bad:
        ap.error(f"--rows: unknown {bad}; choose from {', '.join(ROWS)}")
    if args.warmup >= args.steps:
        ap.error(f"--warmup={args.warmup} must be below --steps={args.steps}")
    if args.group < 2:
        ap.error(f"--group={args.group} must be >= 2: advantages are normalised within each group")
    n = args.prompts * args.group
    if args.trl_micro_batch is not None and (args.trl_micro_batch < 1 or n % args.trl_micro_batch):
        ap.error(f"--trl-micro-batch={args.trl_micro_batch} must divide the step's {n} completions")
    n_rows = len(args.rows.split(","))
    if args.row_wall_s is None:
        args.row_wall_s = min(args.row_timeout, args.budget / n_rows) - TEARDOWN_S
    if args.row_wall_s <= 0 or args.row_wall_s + TEARDOWN_S > args.row_timeout:
        ap.error(f"--row-wall-s={args.row_wall_s:.0f} must be > 0 and leave {TEARDOWN_S:.0f} s to exit inside "
                 f"--row-timeout={args.row_timeout:.0f}")
    return args


def resumed_rows(path: str, specs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows of an earlier result that this call does not rerun; SystemExit naming --resume if its recipe
    differs from this call's."""
    import json

    earlier = json.loads(Path(path).read_text())["rows"]
    rerun = {s["name"] for s in specs}
    for r in earlier:
        diff = {k: (r.get(k), specs[0][k]) for k in SAME_RECIPE if r.get(k) != specs[0][k]}
        if diff and r["name"] not in rerun:
            raise SystemExit(f"--resume {path}: row {r['name']} ran another recipe (earlier, now): {diff}")
    return [r for r in earlier if r["name"] not in rerun]


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    from lightning_ffpa.presets import build_text_config

    cfg = build_text_config(args.preset)
    vocab, full = cfg.vocab_size, cfg.num_hidden_layers
    specs = [{"name": r, "vocab": vocab, "full_layers": full, "row_wall_s": args.row_wall_s,
              **{k: getattr(args, k) for k in SPEC_KEYS}} for r in args.rows.split(",")]
    kept = resumed_rows(args.resume, specs) if args.resume else []
    out = Path(args.out) if args.out else Path(__file__).resolve().parent / "results" / "grpo_vs_trl.json"
    logs = Path(args.logs) if args.logs else out.with_suffix(".logs")
    estimate = trl_call_estimate(args.layers, args.prompts, args.group, args.prompt_len, args.completion_len,
                                 args.warmup, args.row_wall_s, full_layers=full)
    print(f"estimate: a TRL step ~{estimate['trl_step_s']} s (generate {estimate['trl_generate_s']} s, update "
          f"{estimate['trl_update_s']} s): ~{estimate['timed_steps_in_row']} timed steps fit a row's "
          f"{args.row_wall_s:.0f} s (--min-steps {args.min_steps}); {estimate['basis']}", flush=True)

    def save(done: list[dict]) -> None:
        summary = summarize(kept + done)
        summary["trl_call_estimate"] = estimate
        if len(done) < len(specs):
            summary["partial"] = True
        if kept:
            summary["resumed_rows"] = f"{', '.join(r['name'] for r in kept)} from {args.resume}"
        write_result("grpo_vs_trl", kept + done, summary, out=out, driver_pid=os.getpid())

    # --row-timeout stays the hard bound: a row whose first step alone overruns its wall budget is killed there
    return kept + run_rows(Path(__file__).resolve(), specs, logs, args.row_timeout, args.budget, save)


if __name__ == "__main__":
    if not row_main(None, measure):
        main()
