"""GRPO math: group-normalised advantages and the clipped-ratio policy loss with an optional KL term.

Owns formulas only; generation, rewards, batch layout and logging live in `callbacks/rollout.py`,
`rl/rewards.py`, `rl/batch.py` and `rl/module.py`. Conventions follow TRL: advantages
(r - mean_group) / (std_group + 1e-4); KL is the k3 estimator exp(ref - logp) - (ref - logp) - 1; token
losses are averaged per sequence, then over sequences. Clip bounds may be asymmetric as in DAPO
(`clip_eps` below, `clip_eps_high` above). A sampler that is not the policy's own numerics (a bf16 engine) is
corrected by truncated importance sampling, as TRL's `vllm_importance_sampling_correction` does.
"""

from __future__ import annotations

import torch


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-4) -> torch.Tensor:
    """(r - group mean) / (group std + eps) for rewards laid out as consecutive groups of `group_size`."""
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards are not whole groups of `num_generations={group_size}`")
    g = rewards.view(-1, group_size)
    return ((g - g.mean(1, keepdim=True)) / (g.std(1, keepdim=True) + eps)).view(-1)


def sampler_weights(policy_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, cap: float) -> torch.Tensor:
    """Truncated importance weights min(pi_policy / pi_sampler, cap) per token, without gradient: they correct
    for tokens drawn by a sampler whose numerics differ from the policy's; the cap bounds their variance."""
    return torch.exp(policy_logprobs.detach() - sampler_logprobs).clamp(max=cap)


def grpo_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
              clip_eps: float = 0.2, beta: float = 0.0, ref_logprobs: torch.Tensor | None = None,
              clip_eps_high: float | None = None,
              token_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped surrogate over completion tokens; `logprobs`/`old_logprobs`/`mask` are (N, T), `advantages` (N,).

    The ratio is clipped to [1 - clip_eps, 1 + clip_eps_high] (DAPO's "clip-higher": a larger upper bound
    lets unlikely tokens with positive advantage grow); `clip_eps_high=None` uses clip_eps on both sides.
    `token_weights` (N, T), e.g. `sampler_weights`, scale each token's loss, the KL term's included.
    """
    if beta > 0 and ref_logprobs is None:
        raise ValueError(f"`beta={beta}` needs reference logprobs")
    high = clip_eps if clip_eps_high is None else clip_eps_high
    mask = mask.to(logprobs.dtype)
    adv = advantages[:, None]
    ratio = torch.exp(logprobs - old_logprobs)
    clipped = torch.clamp(ratio, 1 - clip_eps, 1 + high)
    per_token = -torch.minimum(ratio * adv, clipped * adv)
    stats: dict[str, torch.Tensor] = {}
    if beta > 0:
        d = ref_logprobs - logprobs
        kl = torch.exp(d) - d - 1
        per_token = per_token + beta * kl
        stats["kl"] = ((kl * mask).sum() / mask.sum().clamp(min=1)).detach()
    if token_weights is not None:
        per_token = per_token * token_weights
    lengths = mask.sum(1).clamp(min=1)
    loss = ((per_token * mask).sum(1) / lengths).mean()
    is_clipped = ((ratio < 1 - clip_eps) & (adv < 0)) | ((ratio > 1 + high) & (adv > 0))
    stats["clip_fraction"] = ((is_clipped.to(mask.dtype) * mask).sum() / mask.sum().clamp(min=1)).detach()
    return loss, stats
