"""The five GRPO losses, the advantages and DAPO's overlong shaping against TRL 1.16's own code on the same
tensors (trl is a test extra: `pip install lightning-ffpa[trl]`), and against the papers' formulas written out
here (these run without trl)."""

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from lightning_ffpa.rl.grpo import LOSS_TYPES, group_advantages, grpo_loss, overlong_penalty

N, T, L_MAX = 6, 5, 7


def _tensors(seed=0):
    torch.manual_seed(seed)
    old = -torch.rand(N, T) * 3
    logp = (old + torch.randn(N, T) * 0.3).requires_grad_()
    ref = old + torch.randn(N, T) * 0.2
    mask = (torch.rand(N, T) > 0.25).long()
    mask[0] = 0  # an empty completion (e.g. masked as truncated)
    adv = torch.randn(N)
    is_ratio = torch.rand(N, T) + 0.5
    return logp, old, ref, mask, adv, is_ratio


def _trl_loss(loss_type, logp, old, ref, mask, adv, beta, is_ratio, eps_low=0.2, eps_high=0.28):
    """TRL's `GRPOTrainer._compute_loss` on these tensors: the trainer's state is a namespace, the model's
    per-token log-probs are `logp`."""
    trl_grpo = pytest.importorskip("trl.trainer.grpo_trainer")
    gspo = loss_type == "gspo"
    fake = SimpleNamespace(
        loss_type="grpo" if gspo else loss_type, importance_sampling_level="sequence" if gspo else "token",
        epsilon_low=eps_low, epsilon_high=eps_high, beta=beta, top_entropy_quantile=1.0,
        off_policy_mask_threshold=None, use_vllm=is_ratio is not None, vllm_importance_sampling_correction=True,
        args=SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=1),
        model=SimpleNamespace(training=True), current_gradient_accumulation_steps=1,
        max_completion_length=L_MAX, _entropy_bonus_enabled=False, aux_loss_enabled=False,
        _metrics=defaultdict(lambda: defaultdict(list)),
        accelerator=SimpleNamespace(num_processes=1, sync_gradients=True, gather=lambda t: t,
                                    gather_for_metrics=lambda t: t, reduce=lambda t, reduction: t),
        _get_per_token_logps_and_entropies=lambda *a, **k: (logp, torch.zeros_like(logp), None))
    inputs = {"prompt_ids": torch.zeros(N, 2, dtype=torch.long), "prompt_mask": torch.ones(N, 2, dtype=torch.long),
              "completion_ids": torch.zeros(N, T, dtype=torch.long), "completion_mask": mask,
              "advantages": adv, "old_per_token_logps": old, "ref_per_token_logps": ref,
              "num_items_in_batch": mask.sum(), "importance_sampling_ratio": is_ratio}
    return trl_grpo.GRPOTrainer._compute_loss(fake, None, inputs)


@pytest.mark.parametrize("beta, weighted", [(0.0, False), (0.04, True)])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_losses_equal_trl(loss_type, beta, weighted):
    logp, old, ref, mask, adv, is_ratio = _tensors()
    is_ratio = is_ratio if weighted else None
    ours, _ = grpo_loss(logp, old, adv, mask, clip_eps=0.2, clip_eps_high=0.28, beta=beta, ref_logprobs=ref,
                        token_weights=is_ratio, loss_type=loss_type, max_completion_length=L_MAX)
    (g_ours,) = torch.autograd.grad(ours, logp)
    theirs = _trl_loss(loss_type, logp, old, ref, mask, adv, beta, is_ratio)
    (g_theirs,) = torch.autograd.grad(theirs, logp)
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(g_ours, g_theirs, atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_losses_equal_the_papers_formulas(loss_type):
    """Each formula of rl/grpo.py's docstring, written out with loops."""
    logp, old, _, mask, adv, _ = _tensors(1)
    ours, _ = grpo_loss(logp, old, adv, mask, clip_eps=0.2, clip_eps_high=0.28, loss_type=loss_type,
                        max_completion_length=L_MAX)
    lp, o, m = logp.detach().tolist(), old.tolist(), mask.tolist()

    def surrogate(r, a):
        return min(r * a, min(max(r, 0.8), 1.28) * a)

    seq_terms, tok_sum, n_tok = [], 0.0, 0
    for i in range(N):
        toks = [t for t in range(T) if m[i][t]]
        if loss_type == "gspo":
            s = torch.tensor(sum(lp[i][t] - o[i][t] for t in toks) / max(len(toks), 1)).exp().item()
            seq_terms.append(surrogate(s, adv[i].item()) if toks else 0.0)
            continue
        terms = [surrogate(torch.tensor(lp[i][t] - o[i][t]).exp().item(), adv[i].item()) for t in toks]
        seq_terms.append(sum(terms) / len(terms) if terms else 0.0)
        tok_sum, n_tok = tok_sum + sum(terms), n_tok + len(terms)
    want = {"grpo": lambda: -sum(seq_terms) / N, "gspo": lambda: -sum(seq_terms) / N,
            "bnpo": lambda: -tok_sum / n_tok, "dapo": lambda: -tok_sum / n_tok,
            "dr_grpo": lambda: -tok_sum / (N * L_MAX)}[loss_type]()
    assert ours.item() == pytest.approx(want, rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_equal_trl(scale):
    trl_utils = pytest.importorskip("trl.trainer.utils")
    torch.manual_seed(0)
    r = torch.randn(12)
    r[4:8] = 1.5  # a zero-variance group
    g = r.view(-1, 4)
    centred = (g - g.mean(1, keepdim=True)).view(-1)
    std = {"group": trl_utils.nanstd(g, dim=1).repeat_interleave(4), "batch": trl_utils.nanstd(r).expand(12),
           "none": None}[scale]
    want = centred if std is None else centred / (std + 1e-4)
    torch.testing.assert_close(group_advantages(r, 4, scale), want)


def test_overlong_penalty_equals_trl_and_dapo_eq13():
    rewards = pytest.importorskip("trl.rewards")
    trl_fn = rewards.get_soft_overlong_punishment(max_completion_len=100, soft_punish_cache=20)
    lengths = [0, 50, 80, 81, 90, 100, 101]
    theirs = trl_fn(completion_ids=[[1] * n for n in lengths])
    ours = overlong_penalty(torch.tensor(lengths), 100, 20).tolist()
    assert ours == pytest.approx(theirs)
    assert ours == pytest.approx([0, 0, 0, -1 / 20, -0.5, -1.0, -1.0])  # DAPO eq. 13 by hand
    assert overlong_penalty(torch.tensor([90]), 100, 20, factor=0.5).item() == pytest.approx(-0.25)
