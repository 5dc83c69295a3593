"""GRPOAlgorithm's per-rollout decisions: overlong shaping, advantages, DAPO's dynamic sampling, masked
truncated completions, whole groups; and its option checks."""

from types import SimpleNamespace

import lightning as L
import pytest
import torch

from lightning_ffpa.callbacks.rollout import RolloutCallback
from lightning_ffpa.errors import ConfigError
from lightning_ffpa.rl.algorithm import GRPOAlgorithm
from lightning_ffpa.rl.grpo import group_advantages
from lightning_ffpa.rl.module import GRPOModule
from lightning_ffpa.rl.prompts import PromptDataModule
from lightning_ffpa.rollout.engine import EngineConfig
from lightning_ffpa.rollout.sampler import SamplingParams


def _seqs(outputs, reasons):
    return [SimpleNamespace(output=o, logprobs=[-0.5] * len(o), finish_reason=r) for o, r in zip(outputs, reasons)]


PROMPTS = [[5, 6], [5, 6], [7], [7], [8], [8]]
OUTPUTS = [[1, 2, 3, 4], [1], [2, 2], [3, 3], [4, 4, 4, 4], [9]]
REASONS = ["length", "stop", "stop", "stop", "length", "stop"]


def test_dynamic_sampling_drops_zero_variance_groups_and_counts_them():
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5, 2.0, 3.0])  # group 1 has equal rewards
    algo = GRPOAlgorithm(dynamic_sampling=True).bind(4)
    batch, dropped = algo.rollout_batch(PROMPTS, _seqs(OUTPUTS, REASONS), rewards, 2)
    assert dropped == 1 and batch["input_ids"].shape[0] == 4
    torch.testing.assert_close(batch["rewards"], torch.tensor([1.0, 0.0, 2.0, 3.0]))
    torch.testing.assert_close(batch["advantages"], group_advantages(torch.tensor([1.0, 0.0, 2.0, 3.0]), 2))
    kept, dropped = GRPOAlgorithm().bind(4).rollout_batch(PROMPTS, _seqs(OUTPUTS, REASONS), rewards, 2)
    assert dropped == 0 and kept["input_ids"].shape[0] == 6


def test_all_groups_dropped_keeps_one_without_loss_tokens():
    algo = GRPOAlgorithm(dynamic_sampling=True).bind(4)
    batch, dropped = algo.rollout_batch(PROMPTS, _seqs(OUTPUTS, REASONS), torch.ones(6), 2)
    assert dropped == 3 and batch["input_ids"].shape[0] == 2 and batch["completion_mask"].sum() == 0


def test_mask_truncated_completions_zeroes_their_loss_tokens_only():
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.2, 2.0, 3.0])
    algo = GRPOAlgorithm(mask_truncated_completions=True).bind(4)
    batch, _ = algo.rollout_batch(PROMPTS, _seqs(OUTPUTS, REASONS), rewards, 2)
    per_row = batch["completion_mask"].sum(1).tolist()
    assert per_row == [0, 1, 2, 2, 0, 1]  # rows 0 and 4 hit max_new_tokens without an EOS
    torch.testing.assert_close(batch["advantages"], group_advantages(rewards, 2))  # their rewards still count
    plain, _ = GRPOAlgorithm().bind(4).rollout_batch(PROMPTS, _seqs(OUTPUTS, REASONS), rewards, 2)
    assert plain["completion_mask"].sum(1).tolist() == [4, 1, 2, 2, 4, 1]


def test_overlong_shaping_reaches_rewards_and_advantages():
    rewards = torch.zeros(6)
    algo = GRPOAlgorithm(overlong_buffer=2, overlong_penalty=0.5).bind(4)
    batch, _ = algo.rollout_batch(PROMPTS, _seqs(OUTPUTS, REASONS), rewards, 2)
    # lengths 4, 1, 2, 2, 4, 1 against L_max 4 and a 2-token buffer: -(len - 2) / 2 * 0.5 above 2 tokens
    torch.testing.assert_close(batch["rewards"], torch.tensor([-0.5, 0.0, 0.0, 0.0, -0.5, 0.0]))
    assert batch["advantages"][0] < 0 < batch["advantages"][1]


def test_scale_rewards_batch_uses_every_ranks_rewards():
    """With a gather (data parallelism), advantages come from the whole step: rank 1's slice equals the
    one-rank advantages of the concatenated rewards."""
    mine = torch.tensor([1.0, 0.0, 0.5, 0.2])
    theirs = torch.tensor([4.0, 2.0, 0.0, 0.0])
    algo = GRPOAlgorithm(scale_rewards="batch").bind(4)
    batch, _ = algo.rollout_batch(PROMPTS[:4], _seqs(OUTPUTS[:4], REASONS[:4]), mine, 2,
                                  gather=lambda t: torch.cat([theirs, t]), rank=1)
    torch.testing.assert_close(batch["advantages"], group_advantages(torch.cat([theirs, mine]), 2, "batch")[4:])
    local, _ = algo.rollout_batch(PROMPTS[:4], _seqs(OUTPUTS[:4], REASONS[:4]), mine, 2)
    assert not torch.allclose(local["advantages"], batch["advantages"])  # the gather changes the batch std


def test_a_batch_that_is_not_whole_groups_is_one_config_error():
    with pytest.raises(ConfigError, match=r"^`RolloutCallback\.num_generations=2`.*not whole groups"):
        GRPOAlgorithm().rollout_batch(PROMPTS[:3], _seqs(OUTPUTS[:3], REASONS[:3]), torch.zeros(3), 2)
    with pytest.raises(ConfigError, match=r"^`RolloutCallback\.num_generations=4`"):
        group_advantages(torch.zeros(6), 4)


@pytest.mark.parametrize("kwargs, option", [
    ({"loss_type": "ppo"}, "model.loss_type"),
    ({"scale_rewards": "rank"}, "model.scale_rewards"),
    ({"num_iterations": 0}, "model.num_iterations"),
    ({"max_tokens_per_microbatch": 0}, "model.max_tokens_per_microbatch"),
    ({"overlong_buffer": 0}, "model.overlong_buffer"),
    ({"overlong_penalty": -1.0}, "model.overlong_penalty"),
    ({"overlong_penalty": 2.0}, "model.overlong_penalty"),  # no overlong_buffer: it would scale nothing
    ({"logprob_chunk_size": 0}, "model.logprob_chunk_size"),
    ({"gradient_clip_val": 0.0}, "model.gradient_clip_val"),
])
def test_bad_algorithm_options_name_the_option(kwargs, option):
    with pytest.raises(ConfigError, match=f"^`{option.replace('.', r'[.]')}="):
        GRPOModule(**kwargs)


def test_overlong_buffer_longer_than_completions_is_refused_at_bind():
    with pytest.raises(ConfigError, match=r"^`model\.overlong_buffer=8`.*max_new_tokens=4"):
        GRPOAlgorithm(overlong_buffer=8).bind(4)


class _TiesFirst:
    """A reward whose first call ties every group (1.0 each); later calls score tokens (they differ)."""

    def __init__(self):
        self.calls = 0

    def __call__(self, prompts, completions, completion_ids, **kw):
        self.calls += 1
        return [1.0] * len(completion_ids) if self.calls == 1 else [sum(ids) / 1000 for ids in completion_ids]


class _Logged(L.Callback):
    def __init__(self):
        self.rows = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        m = trainer.callback_metrics
        self.rows.append((float(m["rollout/dropped_groups"]), float(m["rollout/refilled_groups"]),
                          trainer.global_step))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("refill, want", [(1, (0.0, 2.0, 1)), (0, (2.0, 0.0, 0))])
def test_dynamic_sampling_refills_tied_groups_or_drops_them(refill, want):
    """Both groups of the first draw tie. With a refill round they are redrawn and scored again (they now
    differ): nothing dropped, one update. Without, both are dropped: no loss token, no update."""
    reward = _TiesFirst()
    rollout = RolloutCallback([reward], num_generations=4, sampling=SamplingParams(max_new_tokens=4),
                              engine=EngineConfig(page_size=8, num_pages=32, max_batch_size=8, max_seq_len=16,
                                                  attention="dense"), eos_token_ids=[])
    logged = _Logged()
    trainer = L.Trainer(max_steps=1, max_epochs=1, limit_train_batches=1, accelerator="cpu", logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[rollout, logged])
    module = GRPOModule(preset="tiny", config_overrides={"num_hidden_layers": 2}, dynamic_sampling=True,
                        refill_rounds=refill)
    trainer.fit(module, datamodule=PromptDataModule(num_random_prompts=2, prompt_len=4, batch_size=2))
    assert logged.rows == [want]
    assert reward.calls == 1 + refill


def test_refill_needs_dynamic_sampling():
    with pytest.raises(ConfigError, match=r"^`model\.refill_rounds=2`.*dynamic_sampling"):
        GRPOModule(refill_rounds=2)
