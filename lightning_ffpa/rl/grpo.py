"""GRPO math: advantages, DAPO's overlong shaping, and the five policy losses as token weights times a clipped
surrogate, so that a step split into micro-batches (or ranks) sums to exactly the one-batch loss.

Owns formulas only; which of them a run uses is `rl/algorithm.py`'s `GRPOAlgorithm`, generation and rewards
live in `callbacks/rollout.py` and `rl/rewards.py`, the policy forward in `rl/module.py`. Conventions follow
TRL 1.16: advantages (r - mean_group) / (std + 1e-4) with the unbiased std; KL is the k3 estimator
exp(ref - logp) - (ref - logp) - 1, added per token before the loss type's normalisation. A sampler that is not
the policy's own numerics (a bf16 engine) is corrected by truncated importance sampling, as TRL's
`vllm_importance_sampling_correction` does.

The losses (A_i the advantage of completion i, |o_i| its length, r_it = pi(o_it) / pi_old(o_it), clip to
[1 - eps_low, 1 + eps_high], N completions and T = sum_i |o_i| tokens in the step):

- `grpo`, DeepSeekMath (Shao et al. 2024, arXiv:2402.03300), per-sequence mean then mean over sequences:
  L = -1/N sum_i 1/|o_i| sum_t min(r_it A_i, clip(r_it) A_i)
- `bnpo`, batch-normalised: every token of this rank's step weighs the same:
  L = -1/T_rank sum_i sum_t min(r_it A_i, clip(r_it) A_i)
- `dapo`, DAPO (Yu et al. 2025, arXiv:2503.14476) token-level loss over the global batch (all ranks):
  L = -1/T_global sum_i sum_t min(r_it A_i, clip(r_it) A_i)
- `dr_grpo`, Dr. GRPO (Liu et al. 2025, arXiv:2503.20783): no length normalisation, a constant denominator
  with L_max the largest completion length (`max_new_tokens`):  L = -1/(N L_max) sum_i sum_t min(...)
- `gspo`, GSPO (Zheng et al. 2025, arXiv:2507.18071), a sequence-level ratio
  s_i = exp(1/|o_i| sum_t log r_it) in place of r_it, aggregated as `grpo` (TRL's importance_sampling_level
  "sequence"):  L = -1/N sum_i min(s_i A_i, clip(s_i) A_i)
"""

from __future__ import annotations

import torch

from lightning_ffpa.errors import ConfigError

LOSS_TYPES = ("grpo", "bnpo", "dapo", "dr_grpo", "gspo")
SCALE_REWARDS = ("group", "batch", "none")
STD_EPS = 1e-4  # TRL's


def group_advantages(rewards: torch.Tensor, group_size: int, scale: str = "group", eps: float = STD_EPS) -> torch.Tensor:
    """r - group mean, divided by (std + eps) of the group (`group`), of the whole batch (`batch`) or not (`none`).

    Rewards come as consecutive groups of `group_size`; stds are unbiased, as TRL's.
    """
    if rewards.numel() % group_size:
        raise ConfigError("RolloutCallback.num_generations", group_size,
                          f"{rewards.numel()} rewards are not whole groups")
    g = rewards.view(-1, group_size)
    # a group whose rewards all equal learns nothing: exactly 0, not the mean's rounding (for 1/6, ~1e-8, which
    # the group scale's 1/(std + eps) made ~1e-4 and AdamW a full step)
    centred = (g - g.mean(1, keepdim=True)).masked_fill(zero_std_groups(rewards, group_size)[:, None], 0.0)
    if scale == "group":
        centred = centred / (g.std(1, keepdim=True) + eps)
    elif scale == "batch":
        centred = centred / ((rewards.std() if rewards.numel() > 1 else rewards.new_zeros(())) + eps)
    elif scale != "none":
        raise ValueError(f"`scale_rewards={scale!r}` is not one of {SCALE_REWARDS}")
    return centred.reshape(-1)


def zero_std_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """(num_groups,) bool: groups whose rewards all equal (DAPO's dynamic sampling drops these: zero advantage)."""
    g = rewards.view(-1, group_size)
    return (g == g[:, :1]).all(1)


def overlong_penalty(lengths: torch.Tensor, max_len: int, buffer: int, factor: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment (eq. 13), times `factor`: 0 up to max_len - buffer tokens, then falling
    linearly to -1 at max_len, and -1 beyond."""
    start = max_len - buffer
    ramp = (start - lengths.float()) / max(buffer, 1)
    r = torch.where(lengths <= start, torch.zeros_like(ramp), ramp)
    return factor * torch.where(lengths > max_len, torch.full_like(r, -1.0), r)


def sampler_weights(policy_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, cap: float) -> torch.Tensor:
    """Truncated importance weights min(pi_policy / pi_sampler, cap) per token, without gradient: they correct
    for tokens drawn by a sampler whose numerics differ from the policy's; the cap bounds their variance."""
    return torch.exp(policy_logprobs.detach() - sampler_logprobs).clamp(max=cap)


def loss_weights(mask: torch.Tensor, loss_type: str, num_sequences: float, num_tokens: float,
                 max_completion_length: int | None = None, world_size: int = 1) -> torch.Tensor:
    """(N, T) weight of each token in the loss sum: the loss type's normalisation, read from the whole step.

    `num_sequences`/`num_tokens` count the global step (all micro-batches, all ranks) for `grpo`/`gspo`/`dapo`/
    `dr_grpo`, this rank's step for `bnpo` (pass its counts). Gradients are averaged over `world_size` ranks by
    data parallelism, so global normalisers are multiplied by it: the rank terms then average to the global loss.
    """
    mask = mask.to(torch.float32)
    if loss_type in ("grpo", "gspo"):
        w = world_size / (mask.sum(1, keepdim=True).clamp(min=1) * max(num_sequences, 1))
    elif loss_type == "bnpo":
        w = torch.full_like(mask[:, :1], 1.0 / max(num_tokens, 1))
    elif loss_type == "dapo":
        w = torch.full_like(mask[:, :1], world_size / max(num_tokens, 1))
    elif loss_type == "dr_grpo":
        if max_completion_length is None:
            raise ValueError("loss_type 'dr_grpo' needs the largest completion length (the Callback's max_new_tokens)")
        w = torch.full_like(mask[:, :1], world_size / (max(num_sequences, 1) * max_completion_length))
    else:
        raise ValueError(f"`loss_type={loss_type!r}` is not one of {LOSS_TYPES}")
    return w * mask


def policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                weights: torch.Tensor, sequence_ratio: bool = False, clip_eps: float = 0.2,
                clip_eps_high: float | None = None, beta: float = 0.0, ref_logprobs: torch.Tensor | None = None,
                token_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """sum_it weights_it * (clipped surrogate + beta * KL)_it over (N, T) tokens; `advantages` (N,).

    `weights` come from `loss_weights`; `sequence_ratio` is GSPO's length-normalised sequence ratio. The ratio is
    clipped to [1 - clip_eps, 1 + clip_eps_high] (DAPO's clip-higher; None = clip_eps). `token_weights` (N, T),
    e.g. `sampler_weights`, scale each token's surrogate, as TRL's (the KL term is not scaled). Stats are sums,
    so micro-batches add up: `kl` over masked tokens, `clipped` out of `clip_total` (tokens; sequences with a
    sequence ratio).
    """
    if beta > 0 and ref_logprobs is None:
        raise ValueError(f"`beta={beta}` needs reference logprobs")
    high = clip_eps if clip_eps_high is None else clip_eps_high
    mask = mask.to(logprobs.dtype)
    adv = advantages[:, None]
    log_ratio = logprobs - old_logprobs
    if sequence_ratio:
        log_ratio = ((log_ratio * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1))  # (N, 1)
    ratio = torch.exp(log_ratio)
    clipped = torch.clamp(ratio, 1 - clip_eps, 1 + high)
    per_token = -torch.minimum(ratio * adv, clipped * adv)
    if token_weights is not None:
        per_token = per_token * token_weights
    stats: dict[str, torch.Tensor] = {}
    if beta > 0:
        d = ref_logprobs - logprobs
        kl = torch.exp(d) - d - 1
        per_token = per_token + beta * kl
        stats["kl"] = (kl * mask).sum().detach()
    loss = (per_token * weights * mask).sum()
    is_clipped = ((ratio < 1 - clip_eps) & (adv < 0)) | ((ratio > 1 + high) & (adv > 0))
    stats["clipped"], stats["clip_total"] = _clip_counts(is_clipped, mask, sequence_ratio)
    return loss, stats


def _clip_counts(is_clipped: torch.Tensor, mask: torch.Tensor, sequence_ratio: bool
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(clipped, out of): loss tokens, or with a sequence ratio ((N, 1) flags) the sequences with a loss token:
    GSPO clips whole sequences, and TRL's clip ratio at the sequence level is a fraction of sequences. Counts,
    not a fraction, so micro-batches and passes add up exactly."""
    if sequence_ratio:
        mask = (mask.sum(1, keepdim=True) > 0).to(mask.dtype)
    return (is_clipped.to(mask.dtype) * mask).sum().detach(), mask.sum().detach()


def grpo_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
              clip_eps: float = 0.2, beta: float = 0.0, ref_logprobs: torch.Tensor | None = None,
              clip_eps_high: float | None = None, token_weights: torch.Tensor | None = None,
              loss_type: str = "grpo", max_completion_length: int | None = None
              ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One batch's loss of `loss_type` (all its tokens in one call); stats as means: `clip_fraction` of tokens (of
    sequences for `gspo`), `kl` of tokens."""
    n_tokens = float(mask.sum())
    weights = loss_weights(mask, loss_type, mask.shape[0], n_tokens, max_completion_length)
    loss, sums = policy_loss(logprobs, old_logprobs, advantages, mask, weights, loss_type == "gspo", clip_eps,
                             clip_eps_high, beta, ref_logprobs, token_weights)
    stats = {"clip_fraction": sums["clipped"] / sums["clip_total"].clamp(min=1)}
    if "kl" in sums:
        stats["kl"] = sums["kl"] / max(n_tokens, 1)
    return loss, stats
