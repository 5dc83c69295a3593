"""Packed rows at CP=1 (CPU fp32, the real dispatch code on the reference op): each document as if alone.

A packed batch's loss and parameter gradients must equal the token-weighted sum over its documents run one
at a time, for every attention users pick; "ffpa" must run its full layers through FFPA varlen.
"""

import lightning as L
import pytest
import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from lightning_ffpa.attention import backend, force_kernel
from lightning_ffpa.attention.documents import PackedDocuments, check_packing, packed_inputs
from lightning_ffpa.data import Document, PackedCollate, TextDataModule, pack_documents
from lightning_ffpa.errors import ConfigError
from lightning_ffpa.module import Gemma4LM

LENGTHS = (20, 13, 5, 30, 9)  # 20 and 30 exceed the tiny sliding window (16); two rows of 48, padded
# Gemma4 attends with scale 1.0 on RMS-normed q/k: fp32 summation order alone moves gradients by ~2e-5
# relative (HF's eager and sdpa show the same packed-vs-alone spread), so grads compare at 1e-4.
GRAD_RTOL = 1e-4


def _docs():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 500, (n,), generator=g).tolist() for n in LENGTHS]


def _packed(docs):
    rows = pack_documents([Document(d, d) for d in docs], max_seq_length=48, pad_id=0)
    assert len(rows) == (2 if len(docs) == len(LENGTHS) else 1)
    return PackedCollate()(rows)


def _module(attn):
    torch.manual_seed(0)
    module = Gemma4LM(preset="tiny", dtype="float32", attn_implementation=attn)
    module.configure_model()
    return module


def _grads(module):
    grads = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
    module.zero_grad(set_to_none=True)
    return grads


def _packed_vs_alone(module, docs, grad=True):
    """(packed loss, packed grads, token-weighted loss of the documents alone, their grads)."""
    with torch.set_grad_enabled(grad):
        loss, n_tokens = module.compute_loss(_packed(docs))
        assert n_tokens == sum(len(d) - 1 for d in docs)
        if grad:
            loss.backward()
        packed_grads = _grads(module) if grad else {}
        alone = 0.0
        for d in docs:
            ids = torch.tensor([d])
            loss_d, n_d = module.compute_loss({"input_ids": ids, "labels": ids.clone()})
            alone = alone + loss_d * n_d / n_tokens
        if grad:
            alone.backward()
        return loss.detach(), packed_grads, alone.detach(), _grads(module) if grad else {}


def _assert_grads_close(got, want):
    assert got.keys() == want.keys() and want
    for name in want:
        rel = ((got[name] - want[name]).norm() / want[name].norm().clamp_min(1e-12)).item()
        assert rel < GRAD_RTOL, (name, rel)


@pytest.mark.parametrize("attn", ["ffpa", "sdpa", "eager", "flex_attention"])
def test_every_user_attention_keeps_packed_documents_apart(attn):
    """ffpa splits rows by `documents=` (FFPA varlen); sdpa/eager/flex by position_ids resets (HF's masks).

    torch's flex has no CPU backward, so flex_attention compares losses only here (grads: the GPU test), over
    three documents in one row (one window-crossing): HF compiles flex once per sequence length, ~4 s each on CPU.
    """
    grad = attn != "flex_attention"
    module, docs = _module(attn), _docs()[:None if grad else 3]
    backend.reset_dispatch_counts()
    with force_kernel("reference"):
        loss, grads, alone, alone_grads = _packed_vs_alone(module, docs, grad=grad)
    torch.testing.assert_close(loss, alone, atol=2e-6, rtol=2e-6)
    if grad:
        _assert_grads_close(grads, alone_grads)
    if attn == "ffpa":
        counts = backend.dispatch_counts()
        # one packed forward (2 full + 2 sliding layers), then 5 documents alone (dense full layers)
        assert counts["ffpa-varlen"] == 2 and counts["ffpa-dense"] == 2 * len(docs), counts
        assert backend.fallback_counts() == {"flex_cpu": 2 + 2 * len(docs)}  # sliding layers: no CPU flex backward
        # The check can fail: the same rows with documents allowed to see each other miss by >100x the tolerance.
        batch = _packed(docs)
        with torch.no_grad(), force_kernel("reference"):
            mixed, _ = module.compute_loss({"input_ids": batch["input_ids"], "labels": batch["labels"]})
        assert abs(mixed.item() - alone.item()) > 100 * 2e-6 * abs(alone.item())


@pytest.fixture
def other_attention():
    """An attention name that HF knows but that cannot keep packed documents apart."""
    AttentionInterface.register("plain_test", sdpa_attention_forward)
    AttentionMaskInterface.register("plain_test", sdpa_mask)
    yield "plain_test"


def test_other_attention_with_packing_is_a_config_error(other_attention):
    with pytest.raises(ConfigError, match=r"model.attn_implementation='plain_test'.*data.pack=true"):
        check_packing(other_attention, pack=True)
    check_packing(other_attention, pack=False)
    module = Gemma4LM(preset="tiny", dtype="float32", attn_implementation=other_attention)
    with pytest.raises(ConfigError, match="data.pack"):
        packed_inputs(_packed(_docs()), other_attention)
    # Through the Trainer it fails in setup, before the model is built.
    dm = TextDataModule(max_seq_length=32, batch_size=2, pack=True, val_fraction=0.0)
    trainer = L.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(ConfigError, match="data.pack"):
        trainer.fit(module, datamodule=dm)
    assert module.model is None


def test_fit_with_packed_data_runs_ffpa_varlen():
    """The real Trainer + TextDataModule(pack=True): every full-layer call took FFPA varlen."""
    module = Gemma4LM(preset="tiny", dtype="float32", attn_implementation="ffpa", warmup_steps=1)
    dm = TextDataModule(max_seq_length=64, batch_size=2, pack=True, val_fraction=0.0)
    trainer = L.Trainer(accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    backend.reset_dispatch_counts()
    with force_kernel("reference"):
        trainer.fit(module, datamodule=dm)
    counts = backend.dispatch_counts()
    assert counts["ffpa-varlen"] == 2 * 2 and counts["ffpa-dense"] == 0, counts  # 2 steps x 2 full layers
    assert torch.isfinite(trainer.callback_metrics["train/loss"])


def test_segments_from_document_ids_and_positions():
    docs = torch.tensor([[0, 0, 0, 1, 1, -1, -1], [0, 0, 0, 0, 1, 2, 2]])
    got = PackedDocuments.from_document_ids(docs)
    # rows never share a segment; a padding run is one segment
    assert got.cu_seqlens.tolist() == [0, 3, 5, 7, 11, 12, 14] and got.max_seqlen == 4
    assert got.cu_seqlens.dtype == torch.int32 and got.shape == (2, 7)
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 0], [0, 1, 2, 3, 0, 0, 1]])
    assert PackedDocuments.from_position_ids(pos).cu_seqlens.tolist() == [0, 3, 5, 6, 7, 11, 12, 14]
    mask = PackedDocuments.from_document_ids(docs).dense_mask(None, torch.device("cpu"))
    assert mask[0, 0, 4, 3] and not mask[0, 0, 3, 2] and not mask[0, 0, 3, 4] and mask[1, 0, 6, 5]


def test_hf_attention_needs_position_resets_where_documents_change():
    docs = torch.tensor([[0, 0, 1, 1]])
    ok = {"input_ids": docs, "document_ids": docs, "position_ids": torch.tensor([[0, 1, 0, 1]])}
    assert packed_inputs(ok, "sdpa") == {}
    assert isinstance(packed_inputs(ok, "ffpa")["documents"], PackedDocuments)
    assert packed_inputs({"input_ids": docs}, "plain_anything") == {}  # not packed: nothing to do
    with pytest.raises(ValueError, match="do not restart"):
        packed_inputs({**ok, "position_ids": torch.tensor([[0, 1, 2, 3]])}, "eager")
    with pytest.raises(ValueError, match="position_ids=absent"):
        packed_inputs({"input_ids": docs, "document_ids": docs}, "sdpa")


def test_cli_preflight_accepts_ffpa_with_packing_and_names_the_rest(other_attention):
    from lightning_ffpa.callbacks import FFPAAttention
    from lightning_ffpa.validation import check_parallel_layout

    dm = TextDataModule(max_seq_length=32, batch_size=2, pack=True, val_fraction=0.0)
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False)
    check_parallel_layout(trainer, Gemma4LM(preset="tiny", attn_implementation="ffpa"), dm)
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False,
                        callbacks=[FFPAAttention(attn_implementation=other_attention)])
    with pytest.raises(ConfigError, match="data.pack"):
        check_parallel_layout(trainer, Gemma4LM(preset="tiny", attn_implementation="ffpa"), dm)
