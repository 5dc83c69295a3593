"""GRPO batch building: prompts repeated per group, completions appended, right-padded into the tensors
`GRPOModule.training_step` reads.

Owns the layout of one GRPO batch (`input_ids`, `attention_mask`, `completion_mask`, `old_logprobs`,
`rewards`, `advantages`). Does not generate, score or compute losses or advantages: the rollout Callback
hands it the engine's completions, the rewards and the advantages `rl/algorithm.py` computed.
"""

from __future__ import annotations

from typing import Any

import torch


def repeat_groups(values: list[Any], group_size: int) -> list[Any]:
    """Each value repeated `group_size` times in place: [a, b] -> [a, a, b, b] for G=2."""
    return [v for v in values for _ in range(group_size)]


def build_grpo_batch(prompt_ids: list[list[int]], completion_ids: list[list[int]],
                     completion_logprobs: list[list[float]], rewards: torch.Tensor, advantages: torch.Tensor,
                     pad_token_id: int = 0, loss_rows: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Right-padded prompt+completion rows, their masks, the sampler's logprobs, rewards and advantages.

    Row i is `prompt_ids[i] + completion_ids[i]`. `old_logprobs[i, t]` is the logprob of token t, set on
    completion tokens only. `loss_rows` (N,) bool: rows whose completion takes part in the loss (False: its
    `completion_mask` is all 0, e.g. a truncated completion under `mask_truncated_completions`).
    """
    if not len(prompt_ids) == len(completion_ids) == len(completion_logprobs) == rewards.numel() == advantages.numel():
        raise ValueError(f"{len(prompt_ids)} prompts, {len(completion_ids)} completions, "
                         f"{len(completion_logprobs)} logprob rows, {rewards.numel()} rewards and "
                         f"{advantages.numel()} advantages must match")
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
    if loss_rows is not None:
        comp *= loss_rows.to(comp.dtype)[:, None]
    return {"input_ids": ids, "attention_mask": attn, "completion_mask": comp, "old_logprobs": old,
            "rewards": rewards, "advantages": advantages}
