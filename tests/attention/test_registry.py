"""The kernel registry: its entries, what each takes, the FLOP formula, and the consumers that choose from it."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from lightning_ffpa.attention import kernels, registry
from lightning_ffpa.cp.plan import Block
from lightning_ffpa.cp.ring import BlockOps, ring_block_ops


def test_entries_and_roles():
    assert {"ffpa", "flex", "reference"} <= set(registry.names())
    assert {"ffpa", "flex", "reference"} <= set(registry.names("block_ops"))  # the ring's choices
    assert {"flex", "reference"} <= set(registry.names("masked"))  # the engine's choices
    assert "flex" not in registry.names("contract")  # no merged-lse backward: not a ring contract kernel


def test_why_not_names_the_first_mismatch():
    gpu_only = registry.Kernel(name="gpu_only", head_dims=(64, 256), head_dim_multiple=64, dtypes=(torch.bfloat16,),
                               features=frozenset({"causal"}),
                               unavailable=lambda d: "" if d is not None and d.type == "cuda" else "needs CUDA")
    cuda = torch.device("cuda")
    assert gpu_only.why_not(128, torch.bfloat16, torch.device("cpu")) == "unavailable: needs CUDA"
    assert gpu_only.why_not(96, torch.bfloat16, cuda) == "head_dim"
    assert gpu_only.why_not(512, torch.bfloat16, cuda) == "head_dim"
    assert gpu_only.why_not(128, torch.float32, cuda) == "dtype"
    assert gpu_only.why_not(128, torch.bfloat16, cuda, needs=("causal", "varlen")) == "feature:varlen"
    assert gpu_only.why_not(128, torch.bfloat16, cuda, needs=("causal",)) == ""
    assert registry.get("ffpa").why_not(512, torch.bfloat16, torch.device("cpu")).startswith("unavailable: ")
    assert registry.get("reference").why_not(64, torch.float32, torch.device("cpu"), needs=("varlen",)) == ""


def test_unknown_name_or_role_names_the_option():
    with pytest.raises(ValueError, match=r"`block_ops='nope'`: expected one of \[.*'ffpa'.*'flex'"):
        registry.get("nope", "block_ops", option="block_ops")
    with pytest.raises(ValueError, match=r"`kernel='ffpa'`"):
        registry.get("ffpa", "masked")  # FFPA takes no block masks
    with pytest.raises(ValueError, match="unknown features"):
        registry.register(registry.Kernel(name="bad", head_dims=(1, 8), features=frozenset({"telepathy"})))
    assert "bad" not in registry.names()


def test_flop_formula_is_the_registered_one():
    q, k, v = torch.randn(2, 6, 4, 8), torch.randn(2, 6, 2, 8), torch.randn(2, 6, 2, 8)
    kernels.register_flop_formulas()
    with FlopCounterMode(display=False) as counter, kernels.force_kernel("reference"):
        kernels.dense_fwd(q, k, v, 0.5, True)
    assert counter.get_total_flops() == registry.get("reference").flops(2, 6, 6, 4, 8) == 4 * 2 * 4 * 6 * 6 * 8


def test_ring_block_ops_run_the_chosen_kernels_contract():
    """A new entry with a contract is a ring choice at once; BlockOps calls its ops, not a hard-wired kernel."""
    calls = []
    ref = registry.get("reference").contract

    def counted(op):
        return lambda *a: calls.append(op.__name__) or op(*a)

    contract = registry.Contract(*(counted(getattr(ref, f)) for f in ("dense_fwd", "dense_bwd", "varlen_fwd",
                                                                        "varlen_bwd")))
    registry.register(registry.Kernel(name="counted", head_dims=(1, 64), features=frozenset({"causal", "lse"}),
                                      contract=contract, block_ops="contract"))
    try:
        ops = ring_block_ops(registry.get("counted", "block_ops"))  # as RingAttention(block_ops="counted") does
        q, k, v = (torch.randn(1, 4, 2, 8) for _ in range(3))
        blk = Block(0, 4, 0, 4, True, "dense")
        o, lse = ops.fwd(blk, q, k, v, 0.5)
        ops.bwd(blk, torch.ones_like(o), q, k, v, o, lse, 0.5)
        want_o, want_lse = ref.dense_fwd(q, k, v, 0.5, True)
        torch.testing.assert_close(o, want_o)
        assert calls == ["ref_dense_fwd", "ref_dense_bwd"] and "counted" in registry.names("block_ops")
    finally:
        registry._table.pop("counted")


def test_default_block_ops_is_the_ffpa_contract():
    assert BlockOps().contract is kernels.CONTRACT is registry.get("ffpa").contract
    ops = ring_block_ops(registry.get("ffpa", "block_ops"))
    assert isinstance(ops, BlockOps) and ops.contract is kernels.CONTRACT
