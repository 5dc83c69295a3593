"""GRPOModule: the shared model options, the asymmetric clip bounds and the sampler's importance weights
reaching the loss, and option checks."""

import math

import pytest
import torch

from lightning_ffpa.errors import ConfigError
from lightning_ffpa.module import Gemma4LM
from lightning_ffpa.rl.logprobs import full_token_logprobs
from lightning_ffpa.rl.module import GRPOModule

LORA = {"r": 2, "lora_alpha": 4, "target_modules": ["q_proj", "o_proj"]}


def _batch_with_ratios(module, ratios, advantages, seq=8):
    """A GRPO batch whose old logprobs make the policy/old ratio exactly `ratios[i]` on every token of row i."""
    torch.manual_seed(1)
    ids = torch.randint(3, 512, (len(ratios), seq))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "completion_mask": torch.ones_like(ids),
             "advantages": torch.tensor(advantages, dtype=torch.float32)}
    with torch.no_grad():
        logp = full_token_logprobs(module.model, batch, module.hparams.temperature)  # (N, L-1)
    old = torch.zeros(ids.shape)
    old[:, 1:] = logp - torch.tensor([math.log(r) for r in ratios])[:, None]
    batch["old_logprobs"] = old
    return batch


def _step_loss(module, batch) -> float:
    """The loss `training_step` backpropagates (one pass over the step's micro-batches), without a Trainer."""
    return module.backward_pass(batch, module.prepare_step(batch))


@pytest.mark.parametrize("low, high", [(0.1, 0.3), (0.2, None), (0.05, 0.5)])
def test_clip_bounds_reach_the_loss_by_hand(low, high):
    """Row 0: ratio 1.25, advantage +1 (only the upper bound can clip); row 1: ratio 0.85, advantage -1 (only
    the lower bound can). Swapping the bounds, or dropping clip_eps_high, changes the loss."""
    module = GRPOModule(preset="tiny", config_overrides={"num_hidden_layers": 2}, clip_eps=low,
                        clip_eps_high=high, learning_rate=1e-3, old_logprobs="engine", sampler_is_cap=None)
    module.configure_model()
    batch = _batch_with_ratios(module, [1.25, 0.85], [1.0, -1.0])
    hi = low if high is None else high
    up = min(1.25, 1 + hi)  # clipped surrogate for A > 0: min(r, clip(r))
    down = max(0.85, 1 - low)  # for A < 0: -min(-r, -clip(r)) = max(r, clip(r))
    want = (-up + down) / 2
    got = _step_loss(module, batch)
    assert got == pytest.approx(want, abs=1e-5)
    swapped = (-min(1.25, 1 + low) + max(0.85, 1 - hi)) / 2
    if hi != low:
        assert abs(swapped - want) > 1e-3  # the case would catch swapped bounds


@pytest.mark.parametrize("cap, want", [(3.0, (-1.25 + 0.85) / 2), (1.1, (-1.1 + 0.85) / 2), (None, 0.0)])
def test_policy_ratio_with_truncated_sampler_weights(cap, want):
    """`old_logprobs: policy`: the ratio is 1 at the step, so no clip bites; each token is weighted by
    min(pi_policy / pi_engine, cap). Rows: policy/engine 1.25 with advantage +1, 0.85 with advantage -1."""
    module = GRPOModule(preset="tiny", config_overrides={"num_hidden_layers": 2}, learning_rate=1e-3,
                        sampler_is_cap=cap)
    module.configure_model()
    batch = _batch_with_ratios(module, [1.25, 0.85], [1.0, -1.0])
    assert _step_loss(module, batch) == pytest.approx(want, abs=1e-5)


def test_shared_options_build_the_same_model_as_gemma4lm():
    opts = dict(preset="tiny", config_overrides={"num_hidden_layers": 2}, attn_implementation="eager",
                dtype="float32", lora=LORA)
    torch.manual_seed(0)
    grpo = GRPOModule(**opts, beta=0.1)
    grpo.configure_model()
    torch.manual_seed(0)
    lm = Gemma4LM(**opts)
    lm.configure_model()
    assert type(grpo.model) is type(lm.model)
    assert len(grpo.hf_model.model.layers) == 2
    assert grpo.hf_model.config._attn_implementation == "eager"
    a, b = grpo.model.state_dict(), lm.model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert grpo.hparams.lora == lm.hparams.lora == LORA


@pytest.mark.parametrize("kwargs, option", [
    ({"clip_eps": 0.0}, "model.clip_eps"),
    ({"clip_eps": 0.2, "clip_eps_high": 0.1}, "model.clip_eps_high"),
    ({"beta": -0.1}, "model.beta"),
    ({"beta": 0.1}, "model.beta"),  # a KL term needs LoRA (its reference is the adapter-free base)
    ({"temperature": 0.0}, "model.temperature"),
    ({"learning_rate": 0.0}, "model.learning_rate"),
    ({"config_overrides": {"hidden_sise": 8}}, "model.config_overrides.hidden_sise"),
    ({"lora": {"r": 0}}, "model.lora.r"),
    ({"attn_implementation": "flash_magic"}, "model.attn_implementation"),
    ({"old_logprobs": "sampler"}, "model.old_logprobs"),
    ({"sampler_is_cap": 0.5}, "model.sampler_is_cap"),
    ({"old_logprobs": "engine"}, "model.sampler_is_cap"),  # the engine ratio needs no second correction
])
def test_bad_options_name_the_option(kwargs, option):
    with pytest.raises(ConfigError, match=f"^`{option.replace('.', r'[.]')}="):
        GRPOModule(**kwargs)
