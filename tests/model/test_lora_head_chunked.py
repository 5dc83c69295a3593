"""A LoRA adapter on the lm_head trains through the chunked loss and the chunked GRPO log-probs (a fresh trial
found it skipped: the chunked paths read the head's base weight alone); a frozen head costs the chunked loss no
weight gradient."""

import pytest
import torch

from lightning_ffpa.loss import linear_cross_entropy
from lightning_ffpa.module import Gemma4LM
from lightning_ffpa.rl.logprobs import full_token_logprobs, policy_token_logprobs

LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["lm_head", "q_proj"]}


def _module(loss_impl: str) -> Gemma4LM:
    torch.manual_seed(0)
    lm = Gemma4LM(preset="tiny", dtype="float32", lora=LORA, loss_impl=loss_impl, loss_chunk_size=8)
    lm.configure_model()
    for n, p in lm.model.named_parameters():
        if "lora_B" in n:  # B = 0 at init would leave the adapter out of the loss
            torch.nn.init.normal_(p, std=0.05, generator=torch.Generator().manual_seed(len(n)))
    return lm


def _loss_and_grads(loss_impl: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    lm = _module(loss_impl)
    ids = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(1))
    loss, _ = lm.compute_loss({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids})
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in lm.model.named_parameters() if p.requires_grad}


def test_chunked_loss_trains_the_head_adapter_as_the_plain_loss_does():
    plain, plain_grads = _loss_and_grads("plain")
    chunked, chunked_grads = _loss_and_grads("chunked")
    torch.testing.assert_close(chunked, plain, atol=1e-5, rtol=1e-5)
    head = [n for n in plain_grads if "lm_head" in n]
    assert len(head) == 2 and all(chunked_grads[n].abs().sum() > 0 for n in head)  # lora_A and lora_B
    for n, g in plain_grads.items():
        torch.testing.assert_close(chunked_grads[n], g, atol=1e-5, rtol=1e-4, msg=n)


def test_grpo_log_probs_score_with_the_head_adapter():
    lm = _module("chunked")
    ids = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(2))
    comp = torch.zeros_like(ids)
    comp[:, 6:] = 1
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "completion_mask": comp}
    logp, _ = policy_token_logprobs(lm.model, lm.hf_model.get_output_embeddings(), batch, softcap=30.0)
    ref = full_token_logprobs(lm.model, batch)
    mask = comp[:, 1:].bool()
    torch.testing.assert_close(logp[mask], ref[mask], atol=1e-5, rtol=1e-5)
    with lm.model.disable_adapter():  # the KL reference: the adapter-free model, head included
        base, _ = policy_token_logprobs(lm.model, lm.hf_model.get_output_embeddings(), batch, softcap=30.0)
        torch.testing.assert_close(base[mask], full_token_logprobs(lm.model, batch)[mask], atol=1e-5, rtol=1e-5)
    assert (base[mask] - logp[mask]).abs().max() > 1e-3  # the check can fail: the adapter moves the scores


@pytest.mark.parametrize("weight_trains", [True, False])
def test_a_frozen_head_saves_no_weight_gradient(weight_trains):
    hidden = torch.randn(40, 16, requires_grad=True)
    weight = torch.randn(300, 16, requires_grad=weight_trains)
    labels = torch.randint(0, 300, (40,))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
        loss = linear_cross_entropy(hidden, weight, labels, chunk_size=8)
    loss.backward()
    assert ((300, 16) in saved) is weight_trains  # the (V, H) gradient buffer only for a head that trains
    assert hidden.grad is not None and (weight.grad is not None) is weight_trains
