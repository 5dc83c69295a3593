"""GRPO batch building: prompts repeated per group, completions appended, right-padded into the tensors
`GRPOModule.training_step` reads.

Owns the layout of one GRPO batch (`input_ids`, `attention_mask`, `completion_mask`, `old_logprobs`,
`rewards`, `advantages`). Does not generate, score or compute losses: the rollout Callback hands it the
engine's completions and the summed rewards; advantages come from `rl/grpo.py`.
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_ffpa.rl.grpo import group_advantages


def repeat_groups(values: list[Any], group_size: int) -> list[Any]:
    """Each value repeated `group_size` times in place: [a, b] -> [a, a, b, b] for G=2."""
    return [v for v in values for _ in range(group_size)]


def build_grpo_batch(prompt_ids: list[list[int]], completion_ids: list[list[int]],
                     completion_logprobs: list[list[float]], rewards: torch.Tensor, group_size: int,
                     pad_token_id: int = 0) -> dict[str, torch.Tensor]:
    """Right-padded prompt+completion rows, their masks, the sampler's logprobs and group advantages.

    Row i is `prompt_ids[i] + completion_ids[i]`; rows come in consecutive groups of `group_size` (one
    prompt each). `old_logprobs[i, t]` is the logprob of token t, set on completion tokens only.
    """
    if not len(prompt_ids) == len(completion_ids) == len(completion_logprobs) == rewards.numel():
        raise ValueError(f"{len(prompt_ids)} prompts, {len(completion_ids)} completions, "
                         f"{len(completion_logprobs)} logprob rows and {rewards.numel()} rewards must match")
    rows = [p + c for p, c in zip(prompt_ids, completion_ids)]
    n, length = len(rows), max(len(r) for r in rows)
    ids = torch.full((n, length), pad_token_id, dtype=torch.long)  # (N, L)
    attn = torch.zeros(n, length, dtype=torch.long)
    comp = torch.zeros(n, length, dtype=torch.long)
    old = torch.zeros(n, length)
    for i, (p, c, lp) in enumerate(zip(prompt_ids, completion_ids, completion_logprobs)):
        a, b = len(p), len(p) + len(c)
        ids[i, :b] = torch.tensor(rows[i], dtype=torch.long)
        attn[i, :b] = 1
        comp[i, a:b] = 1
        old[i, a:b] = torch.tensor(lp, dtype=torch.float32)
    return {"input_ids": ids, "attention_mask": attn, "completion_mask": comp, "old_logprobs": old,
            "rewards": rewards, "advantages": group_advantages(rewards, group_size)}
