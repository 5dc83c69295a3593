"""GPU (bf16, real FFPA kernels): a packed batch's loss and gradients vs each document alone.

Run on the H200 with `pytest -m gpu tests/attention/test_packing_gpu.py`. The truth is fp32 eager attention
on each document alone, computed in the test; the packed bf16 run must be as close to it as the unpacked
bf16 run of the same kernels (its error floor). The counters must show FFPA varlen on the CuTeDSL kernel.
"""

import pytest
import torch

from lightning_ffpa.attention import backend, force_kernel, kernels
from lightning_ffpa.data import Document, PackedCollate, pack_documents
from lightning_ffpa.module import Gemma4LM

pytestmark = pytest.mark.gpu

LENGTHS = (300, 77, 140, 500, 33, 200)  # greedy rows of 512: [300, 77], [140], [500], [33, 200], padded


def _module(dtype: str, attn: str, state=None) -> Gemma4LM:
    torch.manual_seed(0)
    module = Gemma4LM(preset="tiny", dtype=dtype, attn_implementation=attn)
    module.configure_model()  # built on CPU: HF's init, then the same weights in every module
    if state is not None:
        module.model.load_state_dict(state)
    return module.cuda()


def _docs():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 500, (n,), generator=g).tolist() for n in LENGTHS]


def _grads(module):
    grads = {n: p.grad.float().clone() for n, p in module.named_parameters() if p.grad is not None}
    module.zero_grad(set_to_none=True)
    return grads


def _alone(module, docs):
    """Token-weighted loss of the documents run one at a time, and its grads."""
    total = sum(len(d) - 1 for d in docs)
    loss = 0.0
    for d in docs:
        ids = torch.tensor([d], device="cuda")
        loss_d, n_d = module.compute_loss({"input_ids": ids, "labels": ids.clone()})
        loss = loss + loss_d * n_d / total
    loss.backward()
    return loss.detach().float(), _grads(module)


def _packed(module, docs):
    rows = pack_documents([Document(d, d) for d in docs], max_seq_length=512, pad_id=0)
    batch = {k: v.cuda() for k, v in PackedCollate()(rows).items()}
    loss, _ = module.compute_loss(batch)
    loss.backward()
    return loss.detach().float(), _grads(module), len(rows)


def _rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


@pytest.mark.parametrize("attn", ["ffpa", "sdpa"])
def test_packed_bf16_is_as_close_to_fp32_documents_alone_as_unpacked_bf16(attn):
    if attn == "ffpa" and not kernels.ffpa_available():
        pytest.fail(f"FFPA CuTeDSL is not usable on this GPU: {kernels.ffpa_unavailable_reason()}")
    backend.register_ffpa()
    docs = _docs()
    truth_module = _module("float32", "eager")
    truth, truth_grads = _alone(truth_module, docs)
    state = {k: v.bfloat16() for k, v in truth_module.model.state_dict().items()}
    module = _module("bfloat16", attn, state)
    with force_kernel("cutedsl" if attn == "ffpa" else None):
        floor, floor_grads = _alone(module, docs)  # the same bf16 kernels, no packing
        backend.reset_dispatch_counts()
        loss, grads, n_rows = _packed(module, docs)
    if attn == "ffpa":
        counts = backend.dispatch_counts()
        assert counts["ffpa-varlen"] == 2 and counts["flex"] == 2, counts  # 2 full + 2 sliding layers, one forward
        assert kernels.kernel_counts() == {"cutedsl": 2, "reference": 0}, "the CuTeDSL kernel did not run"
        assert backend.fallback_counts() == {}
    assert n_rows < len(docs) and torch.isfinite(loss)
    print(f"{attn}: |packed-truth|={abs(loss - truth).item():.2e} |unpacked-truth|={abs(floor - truth).item():.2e}")
    assert abs(loss - truth) <= 2 * abs(floor - truth) + 5e-3
    assert grads.keys() == truth_grads.keys()
    for name in truth_grads:
        assert _rel(grads[name], truth_grads[name]) <= 2 * _rel(floor_grads[name], truth_grads[name]) + 1e-2, name
