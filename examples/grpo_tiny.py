"""GRPO with your own reward function: LoRA policy, paged rollouts between optimizer steps, on CPU by default.

What comes from lightning-ffpa: `GRPOModule` (policy + clipped-ratio loss), `PromptDataModule` (prompts) and
`RolloutCallback` (before each step: refresh the inference copy's LoRA weights in place, generate
`num_generations` completions per prompt with the paged engine, score them with the reward functions,
write group-normalised advantages into the batch). What is yours: the reward function below. It has TRL's
signature, so TRL reward functions plug in unchanged; in YAML it is a dotted import path.

    python examples/grpo_tiny.py                    # tiny random Gemma4, CPU, LoRA rank 8
    python examples/grpo_tiny.py --steps 30         # longer; at this size its reward stays noisy
The same run from YAML: `lightning-ffpa fit --config tiny_grpo` (GPU: `--config gemma4_grpo`), from any folder.
"""

from __future__ import annotations

import argparse
from typing import Any

import lightning as L

from lightning_ffpa.callbacks.rollout import RolloutCallback
from lightning_ffpa.callbacks.screen import default_callbacks
from lightning_ffpa.rl.module import GRPOModule
from lightning_ffpa.rl.prompts import PromptDataModule
from lightning_ffpa.rollout.engine import EngineConfig
from lightning_ffpa.rollout.sampler import SamplingParams


def even_token_reward(prompts: list[Any], completions: list[str], completion_ids: list[list[int]],
                      **kwargs: Any) -> list[float | None]:
    """Your reward: the fraction of even token ids in each completion (None = no opinion, counts as 0)."""
    return [sum(t % 2 == 0 for t in ids) / len(ids) if ids else None for ids in completion_ids]


def main(argv: list[str] | None = None) -> dict:
    """Train for `--steps`; return the last logged rollout reward and the LoRA drift check."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--lora-rank", type=int, default=8, help="0 trains all weights")
    p.add_argument("--num-generations", type=int, default=4, help="GRPO group size G")
    p.add_argument("--max-new-tokens", type=int, default=6)
    p.add_argument("--accelerator", default="cpu")
    args = p.parse_args(argv)

    L.seed_everything(0, verbose=False)
    lora = None if args.lora_rank == 0 else {"r": args.lora_rank, "lora_alpha": 2.0 * args.lora_rank,
                                             "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj",
                                                                "gate_proj", "up_proj", "down_proj"]}
    policy = GRPOModule(preset="tiny", lora=lora, learning_rate=2e-2, clip_eps=0.2, beta=0.0, dtype="float32")
    prompts = PromptDataModule(num_random_prompts=16, prompt_len=4, vocab_size=512, batch_size=2)
    # the engine sized for these options: 2 prompts x G sequences of 4 + max_new_tokens tokens in 8-token pages
    batch, pages = max(16, 2 * args.num_generations), -(-(4 + args.max_new_tokens) // 8)
    rollout = RolloutCallback(
        reward_funcs=[even_token_reward],  # its signature is checked right here (TRL's keywords + **kwargs)
        num_generations=args.num_generations,
        sampling=SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens),
        engine=EngineConfig(page_size=8, num_pages=max(64, batch * pages), max_batch_size=batch,
                            max_seq_len=max(32, 8 * pages),
                            attention="dense" if args.accelerator == "cpu" else "flex"),  # CPU: SDPA, same masks
        eos_token_ids=[],
        verify_no_drift=lora is not None,  # proves the in-place LoRA refresh is exact before training starts
    )
    # the project's step progress bar: `step 2/2` (Lightning's reads `Epoch 0/-2` under max_steps, and a small
    # GRPO loss `-0.000`)
    trainer = L.Trainer(accelerator=args.accelerator, devices=1, max_steps=args.steps,
                        callbacks=[rollout, *default_callbacks({"enable_model_summary": False}, [rollout])],
                        logger=False, enable_checkpointing=False, enable_model_summary=False,
                        log_every_n_steps=1)
    trainer.fit(policy, prompts)
    report = {"reward": float(trainer.callback_metrics["rollout/reward"]), "drift": rollout.drift_report,
              "loss": float(trainer.callback_metrics["train/loss"])}
    print(f"last rollout reward {report['reward']:.3f}, loss {report['loss']:.4g}, LoRA drift check {report['drift']}")
    return report


if __name__ == "__main__":
    main()
