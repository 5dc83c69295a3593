"""The product's compiled flex: its own dynamo cache, and a hard error (not unfused eager flex) past its limit.

Runs on CPU with a counting backend: what is checked is which calls dynamo compiles, not the kernel.
"""

import warnings

import pytest
import torch
from torch.nn.attention.flex_attention import flex_attention

from lightning_ffpa import compile_fallbacks
from lightning_ffpa.attention.flex import compiled_flex
from lightning_ffpa.compile_fallbacks import CompileFallbackWarning


def _counting_backend(calls: list[int]):
    def backend(gm, example_inputs):
        calls.append(example_inputs[0].shape[2] if example_inputs else -1)
        return gm.forward
    return backend


def _qkv(seq: int):
    return [torch.randn(1, 2, seq, 16) for _ in range(3)]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch.compiler.reset()
    yield
    torch.compiler.reset()


def test_a_full_cache_of_flex_attention_elsewhere_does_not_send_ours_to_eager():
    theirs_calls, our_calls = [], []
    theirs = torch.compile(flex_attention, backend=_counting_backend(theirs_calls), dynamic=False)
    with torch._dynamo.config.patch(recompile_limit=1):
        for seq in (32, 48, 64):  # past the limit dynamo runs flex_attention's frame eagerly from then on
            theirs(*_qkv(seq))
    assert len(theirs_calls) == 1
    ours = compiled_flex(_counting_backend(our_calls))
    def softcap(score, b, h, q_idx, kv_idx):
        return 30.0 * torch.tanh(score / 30.0)

    for seq in (80, 96):  # flex_attention's signature passes through, score_mod included (the rollout's softcap)
        q, k, v = _qkv(seq)
        torch.testing.assert_close(ours(q, k, v, score_mod=softcap, scale=0.5),
                                   flex_attention(q, k, v, score_mod=softcap, scale=0.5))
    assert len(our_calls) == 2  # each new shape compiled under the product's own code object


def test_past_the_recompile_limit_a_call_raises_instead_of_running_unfused():
    calls = []
    compile_fallbacks.reset()
    ours = compiled_flex(_counting_backend(calls))
    with torch._dynamo.config.patch(recompile_limit=2), warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        ours(*_qkv(32))
        ours(*_qkv(48))
        with pytest.raises(Exception, match="fullgraph") as info:
            ours(*_qkv(64))
    assert "recompile" in str(info.value.__cause__)
    assert len(calls) == 2
    # it raised: not a fallback to eager, so neither counted nor warned about as one
    assert not compile_fallbacks.counts() and not [w for w in seen if w.category is CompileFallbackWarning]


def test_the_cp_rings_call_traces_as_one_graph():
    """The Flex ring's call (cp/flex_blocks.py): a mask closing over tensors, GQA, log-sum-exp returned."""
    from lightning_ffpa.attention.masks import build_block_mask

    calls = []
    docs = torch.tensor([[0] * 40 + [1] * 24])  # two packed documents

    def document_causal(b, h, q_idx, kv_idx):
        return (docs[b, q_idx] == docs[b, kv_idx]) & (kv_idx <= q_idx)

    q, k, v = torch.randn(1, 4, 64, 16), torch.randn(1, 2, 64, 16), torch.randn(1, 2, 64, 16)
    mask = build_block_mask(document_causal, 1, 64, 64, "cpu", block_size=16)
    kwargs = dict(block_mask=mask, scale=0.25, enable_gqa=True, return_lse=True)
    out, lse = compiled_flex(_counting_backend(calls))(q, k, v, **kwargs)
    want_out, want_lse = flex_attention(q, k, v, **kwargs)
    torch.testing.assert_close(out, want_out)
    torch.testing.assert_close(lse, want_lse)
    assert len(calls) == 1
