"""Token-budgeted micro-batches give the one-batch loss and gradient for every loss type; `num_iterations`
reuses the first pass's log-probs as the old policy and runs that many optimizer steps per rollout."""

import lightning as L
import pytest
import torch

from lightning_ffpa.callbacks.rollout import RolloutCallback
from lightning_ffpa.errors import ConfigError
from lightning_ffpa.rl.algorithm import microbatches
from lightning_ffpa.rl.grpo import LOSS_TYPES, grpo_loss
from lightning_ffpa.rl.module import GRPOModule
from lightning_ffpa.rl.prompts import PromptDataModule
from lightning_ffpa.rl.rewards import token_range_reward
from lightning_ffpa.rollout.engine import EngineConfig
from lightning_ffpa.rollout.sampler import SamplingParams

LORA = {"r": 2, "lora_alpha": 4, "target_modules": ["q_proj", "o_proj"]}


def _batch(n=6, seq=12, seed=0):
    """Rows of different lengths (prompt 3 tokens, completions 2..8) with engine logprobs a little off."""
    torch.manual_seed(seed)
    ids = torch.randint(3, 512, (n, seq))
    attn, comp = torch.zeros_like(ids), torch.zeros_like(ids)
    for i, length in enumerate([12, 5, 9, 11, 6, 8][:n]):
        attn[i, :length] = 1
        comp[i, 3:length] = 1
    return {"input_ids": ids, "attention_mask": attn, "completion_mask": comp,
            "old_logprobs": -torch.rand(n, seq) * comp, "advantages": torch.randn(n)}


def _module(**kw):
    torch.manual_seed(0)
    m = GRPOModule(preset="tiny", config_overrides={"num_hidden_layers": 2}, lora=LORA, **kw)
    m.configure_model()
    m.algorithm = m.algorithm.bind(9)  # the Callback binds max_new_tokens at setup (dr_grpo's L_max)
    return m


def _loss_and_grads(module, batch):
    module.model.zero_grad()
    step = module.prepare_step(batch)
    loss = module.backward_pass(batch, step)
    return loss, {n: p.grad.clone() for n, p in module.model.named_parameters() if p.requires_grad}, step


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_microbatches_give_the_one_batch_loss_and_gradient(loss_type):
    """24 padded tokens per micro-batch split the 6 rows into several forwards; loss and LoRA gradients equal
    one forward of all rows (clip-higher, the KL term and the sampler weights on)."""
    kw = dict(loss_type=loss_type, beta=0.04, clip_eps_high=0.28)
    batch = _batch()
    whole, g_whole, s_whole = _loss_and_grads(_module(**kw), batch)
    split, g_split, s_split = _loss_and_grads(_module(max_tokens_per_microbatch=24, **kw), batch)
    assert len(s_whole.parts) == 1 and len(s_split.parts) >= 3
    assert split == pytest.approx(whole, rel=1e-5, abs=1e-7)
    for name, g in g_whole.items():
        torch.testing.assert_close(g_split[name], g, atol=1e-7, rtol=1e-4, msg=name)
    # the same as the one-call loss of rl/grpo.py on the whole batch
    module = _module(**kw)
    logp, _ = module.token_logprobs(batch)
    with torch.no_grad(), module.model.disable_adapter():
        ref, _ = module.token_logprobs(batch)
    w = torch.exp(logp.detach() - batch["old_logprobs"][:, 1:]).clamp(max=3.0)
    want, _ = grpo_loss(logp, logp.detach(), batch["advantages"], batch["completion_mask"][:, 1:], beta=0.04,
                        ref_logprobs=ref, clip_eps_high=0.28, token_weights=w, loss_type=loss_type,
                        max_completion_length=9)
    assert whole == pytest.approx(want.item(), rel=1e-5, abs=1e-7)


def test_microbatch_packing_by_padded_tokens():
    assert microbatches([4, 4, 4, 4], 8) == [[0, 1], [2, 3]]
    assert microbatches([2, 6, 3, 3, 3], 9) == [[0], [1], [2, 3, 4]]  # 2 rows of 6 would pad to 12
    assert microbatches([5, 5], None) == [[0, 1]]


def test_a_rank_with_fewer_microbatches_splits_then_pads_to_the_most():
    """Under data parallelism every rank runs as many forwards/backwards as the rank with the most (each is a
    collective): parts are halved, then zero-weight repeats of row 0 pad the count; the loss and gradient stay
    those of one forward."""
    from dataclasses import replace
    from types import SimpleNamespace

    module = _module()
    others = torch.tensor(5)  # another rank's micro-batch count
    module._trainer = SimpleNamespace(strategy=SimpleNamespace(all_gather=lambda t: torch.stack([t, others])))
    assert module._equal_parts([[0, 1, 2], [3]], world=2) == ([[0], [1], [2], [3], [0]], 1)
    others = torch.tensor(2)
    assert module._equal_parts([[0, 1, 2], [3]], world=2) == ([[0, 1, 2], [3]], 0)  # already the most
    module._trainer = None
    batch = _batch()
    whole, g_whole, step = _loss_and_grads(_module(loss_type="dapo", beta=0.04), batch)
    module = _module(loss_type="dapo", beta=0.04)
    module.model.zero_grad()
    padded = replace(step, parts=[[0, 1], [2], [3, 4, 5], [0], [0]], pads=2, first=[], refs=[])
    got = module.backward_pass(batch, padded)
    assert got == pytest.approx(whole, rel=1e-5, abs=1e-7)
    for name, p in module.model.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(p.grad, g_whole[name], atol=1e-7, rtol=1e-4, msg=name)


def test_later_iterations_use_the_first_pass_as_old_policy():
    """Pass 1 after an update: its ratio is pi_new / pi_first, not 1, so the loss differs from on-policy."""
    module = _module(clip_eps=10.0, num_iterations=2)  # no clipping: the ratio reaches the loss unchanged
    batch = _batch()
    step = module.prepare_step(batch)
    module.backward_pass(batch, step, 0)
    with torch.no_grad():
        for p in module.model.parameters():
            if p.grad is not None:
                p -= 5.0 * p.grad
                p.grad = None
    got = module.backward_pass(batch, step, 1)
    logp, _ = module.token_logprobs(batch)
    first = step.first[0]
    w = torch.exp(first - batch["old_logprobs"][:, 1:]).clamp(max=3.0)  # the sampler weights of pass 0
    want, _ = grpo_loss(logp, first, batch["advantages"], batch["completion_mask"][:, 1:], clip_eps=10.0,
                        token_weights=w)
    on_policy, _ = grpo_loss(logp, logp.detach(), batch["advantages"], batch["completion_mask"][:, 1:],
                             clip_eps=10.0, token_weights=w)
    assert got == pytest.approx(want.item(), rel=1e-5)
    assert (logp.detach() - first).abs().max() > 1e-3  # the update moved the policy
    assert abs(want.item() - on_policy.item()) > 1e-2 * abs(on_policy.item())  # and the old policy matters


class _Steps(L.Callback):
    def __init__(self):
        self.steps = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.steps.append(trainer.global_step)


@pytest.mark.timeout(120)
def test_num_iterations_runs_that_many_updates_per_rollout():
    torch.manual_seed(0)
    rollout = RolloutCallback([token_range_reward], num_generations=4, sampling=SamplingParams(max_new_tokens=4),
                              engine=EngineConfig(page_size=8, num_pages=32, max_batch_size=8, max_seq_len=16,
                                                  attention="dense"), eos_token_ids=[])
    steps = _Steps()
    trainer = L.Trainer(max_steps=6, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[rollout, steps])
    module = GRPOModule(preset="tiny", config_overrides={"num_hidden_layers": 2}, num_iterations=3,
                        max_tokens_per_microbatch=16, gradient_clip_val=1.0, loss_type="dapo")
    trainer.fit(module, datamodule=PromptDataModule(num_random_prompts=8, prompt_len=4, batch_size=2))
    assert steps.steps == [3, 6]  # global_step counts optimizer updates: 3 per rollout batch
    assert trainer.callback_metrics["train/microbatches"] == 4  # 8 rows of 8 tokens, 2 per 16-token budget
    assert module.algorithm.max_completion_length == 4  # bound once at setup, the module's own object
    assert module.algorithm is rollout.algorithm


def test_bad_microbatch_budget_and_iterations_name_the_option():
    with pytest.raises(ConfigError, match=r"^`model\.num_iterations=0`"):
        GRPOModule(num_iterations=0)
    with pytest.raises(ConfigError, match=r"^`model\.max_tokens_per_microbatch=0`"):
        GRPOModule(max_tokens_per_microbatch=0)
    rollout = RolloutCallback([token_range_reward], num_generations=2, sampling=SamplingParams(max_new_tokens=8),
                              eos_token_ids=[])
    data = PromptDataModule(num_random_prompts=4, prompt_len=6, batch_size=2)
    data.setup("fit")
    module = GRPOModule(max_tokens_per_microbatch=13)  # a 6-token prompt + 8 new tokens is 14: no model built
    with pytest.raises(ConfigError, match=r"^`model\.max_tokens_per_microbatch=13`.*14 tokens"):
        rollout.resolve_algorithm(module, data)
    assert not hasattr(module, "model") or module.model is None


@pytest.mark.parametrize("trainer_kw, option", [({"gradient_clip_val": 1.0}, "trainer.gradient_clip_val"),
                                                ({"accumulate_grad_batches": 2}, "trainer.accumulate_grad_batches")])
def test_trainer_options_a_manual_step_ignores_are_refused_before_fit(trainer_kw, option):
    """Lightning refuses these under manual optimization with its own traceback; the pre-flight (the CLI runs it
    before writing any file) names the option and the module's own one."""
    rollout = RolloutCallback([token_range_reward], num_generations=2, sampling=SamplingParams(max_new_tokens=2),
                              eos_token_ids=[])
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, **trainer_kw)
    with pytest.raises(ConfigError, match=f"^`{option.replace('.', r'[.]')}="):
        rollout.check_before_fit(trainer, GRPOModule(), PromptDataModule(num_random_prompts=4, prompt_len=4))
