"""FA4 against Flex at the sliding op: the document split, the calls each row times, the summary, the CPU refusal."""

import sys
from pathlib import Path

import pytest
import torch

_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(_ROOT))
from benchmarks import sliding_kernels as sk  # noqa: E402
from lightning_ffpa.errors import ConfigError  # noqa: E402


@pytest.mark.parametrize("seq", [256, 8192, 32768])
def test_documents_are_unequal_sum_to_seq_and_give_their_cu_seqlens(seq):
    lengths = sk.document_lengths(seq)
    assert sum(lengths) == seq and len(lengths) == sk.DOCS and len(set(lengths)) == sk.DOCS and min(lengths) > 0
    assert lengths == sk.document_lengths(seq)  # seeded: every run packs the same split
    packed = sk.packed_documents(seq, "cpu")
    bounds = torch.tensor([0, *lengths]).cumsum(0)
    assert packed.cu_seqlens.tolist() == bounds.tolist() and packed.cu_seqlens.dtype == torch.int32
    assert packed.max_seqlen == max(lengths)


@pytest.mark.parametrize("layout", sk.LAYOUTS)
def test_fa4_and_flex_calls_agree_on_cpu(layout):
    """The calls the rows time: FA4's (its CPU reference through the stand-in) and the product's Flex (eager on CPU)
    give the same output at a tiny size; varlen keeps documents apart, so it differs from dense."""
    from lightning_ffpa.attention import fa4

    seq, window, d = 256, 64, 16
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, seq, h, d, generator=gen) for h in (4, 2, 2))  # (B, S, H, D), GQA 2:1
    flex = sk.attention_call("flex", layout, seq, window, "cpu")(q, k, v)
    with fa4.cpu_stand_in():
        out = sk.attention_call("fa4", layout, seq, window, "cpu")(q, k, v)
    assert out.shape == flex.shape == (1, seq, 4, d)
    torch.testing.assert_close(out, flex, rtol=1e-5, atol=1e-5)
    if layout == "varlen":
        dense = sk.attention_call("flex", "dense", seq, window, "cpu")(q, k, v)
        first = sk.document_lengths(seq)[0]
        torch.testing.assert_close(out[:, :first], dense[:, :first])  # the first document sees no other
        assert not torch.allclose(out[:, first:], dense[:, first:])


def _row(kernel, layout, seq, fwd, fwdbwd):
    return dict(kernel=kernel, layout=layout, seq=seq, fwd=dict(ms=fwd), fwdbwd=dict(ms=fwdbwd))


def test_summary_ratios_and_reasons_for_missing_rows():
    rows = [_row("flex", "dense", 8192, 1.2, 7.0), _row("fa4", "dense", 8192, 0.5, 3.5),
            _row("flex", "varlen", 8192, 1.0, 6.0), _row("fa4", "varlen", 8192, 0.5, 2.0),
            _row("flex", "dense", 16384, 2.2, 14.0),
            dict(kernel="fa4", layout="dense", seq=16384, error="RuntimeError: FA4 cannot take this call here"),
            dict(kernel="flex_flash_backend", layout="dense", seq=8192, error="block size")]
    s = sk.summarize(rows)
    assert s["fa4_vs_flex_sliding_fwd_8k"] == pytest.approx(2.4)
    assert s["fa4_vs_flex_sliding_fwdbwd_8k"] == pytest.approx(2.0)
    assert s["fa4_vs_flex_sliding_varlen_fwd_8k"] == pytest.approx(2.0)
    assert s["fa4_vs_flex_sliding_varlen_fwdbwd_8k"] == pytest.approx(3.0)
    assert s["fa4_vs_flex_sliding_fwdbwd_16k"] is None
    assert "FA4 cannot take this call" in s["missing"]["fa4_vs_flex_sliding_fwdbwd_16k"]
    assert s["fa4_vs_flex_sliding_varlen_fwdbwd_32k"] is None
    assert "not in this result" in s["missing"]["fa4_vs_flex_sliding_varlen_fwdbwd_32k"]
    assert "fa4_vs_flex_sliding_fwd_8k" not in s["missing"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_without_a_gpu_main_refuses_before_any_row(tmp_path):
    out = tmp_path / "s.json"
    with pytest.raises(ConfigError, match="CUDA"):
        sk.main(["--out", str(out)])
    assert not out.exists()
