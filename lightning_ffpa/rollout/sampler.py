"""Token sampler: temperature, top-k, top-p, with per-token logprobs; no host syncs, so it can be
captured inside the decode CUDA graph.

Owns the sampling math and `SamplingParams` (with the completion length cap, as vLLM's `max_tokens`).
The order is temperature, then top-k, then top-p over what top-k kept. Logprobs are those of the
temperature-scaled distribution before top-k/top-p filtering (what a GRPO policy forward at the same
temperature recomputes); greedy (temperature 0) reports logprobs of the unscaled distribution.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lightning_ffpa.errors import ConfigError


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings shared by every request of one engine run.

    Plain data: its user calls `check(option)` so an error names the option as that user spells it
    (`sampling.top_p` for the engine, `RolloutCallback.sampling.top_p` for the Callback).
    """

    temperature: float = 1.0
    """0 means greedy (argmax)."""
    top_p: float = 1.0
    """Nucleus mass kept, in (0, 1], over the temperature-scaled, top-k-filtered distribution."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 keeps all."""
    max_new_tokens: int = 64
    """Completion length cap in tokens (>= 1)."""

    def check(self, option: str = "sampling") -> None:
        """Raise ConfigError naming `<option>.<field>` for the first value out of range."""
        if self.temperature < 0:
            raise ConfigError(f"{option}.temperature", self.temperature, "must be >= 0 (0 = greedy)")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"{option}.top_p", self.top_p, "must be in (0, 1]")
        if self.top_k < 0:
            raise ConfigError(f"{option}.top_k", self.top_k, "must be >= 0 (0 = off)")
        if self.max_new_tokens < 1:
            raise ConfigError(f"{option}.max_new_tokens", self.max_new_tokens, "must be >= 1")

    @property
    def sampler_key(self) -> tuple[float, float, int]:
        """The fields the sampler reads (what a captured decode graph bakes in)."""
        return self.temperature, self.top_p, self.top_k


def sample(logits: torch.Tensor, params: SamplingParams,
           generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row of fp32 `logits` (N, V); return (tokens (N,), logprobs (N,))."""
    if params.temperature == 0:
        tokens = logits.argmax(-1)
        logprobs = torch.log_softmax(logits, -1).gather(1, tokens[:, None])[:, 0]
        return tokens, logprobs
    scaled = logits / params.temperature
    logp = torch.log_softmax(scaled, -1)
    kept = scaled
    if params.top_k > 0:
        kth = torch.topk(scaled, min(params.top_k, scaled.shape[-1]), dim=-1).values[:, -1:]
        kept = kept.masked_fill(scaled < kth, float("-inf"))
    if params.top_p < 1:
        sorted_logits, order = torch.sort(kept, dim=-1, descending=True)
        cum = torch.softmax(sorted_logits, -1).cumsum(-1)
        drop_sorted = (cum - torch.softmax(sorted_logits, -1)) >= params.top_p  # mass before this token
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        kept = kept.masked_fill(drop, float("-inf"))
    probs = torch.softmax(kept, -1)
    # Exponential race (argmax p/E) samples from p without multinomial's host-side checks.
    noise = torch.empty_like(probs).exponential_(generator=generator)
    tokens = (probs / noise).argmax(-1)
    return tokens, logp.gather(1, tokens[:, None])[:, 0]
