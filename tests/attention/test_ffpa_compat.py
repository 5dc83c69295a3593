"""`_compat/ffpa.py` on CPU: the import guard says why not, and the four ops are called in the argument orders
its docstring documents.

ffpa-attn does not run on CPU, so a stand-in `ffpa_attn` op library is registered here with those orders
(note `out, dout` in the varlen backward against `dout, ..., out` in the dense one), computing through the CPU
reference of the contract. The real ops are checked on the GPU (`tests/attention/test_gpu_parity.py`).
"""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode, flop_registry, register_flop_formula

from lightning_ffpa._compat import ffpa as ffpa_compat
from lightning_ffpa.attention import kernels

REF = torch.ops.lightning_ffpa
_STAND_IN: list = []  # keeps the stand-in library registered for the session


def test_unavailable_on_cpu_says_why_and_offers_no_ops():
    if torch.cuda.is_available():
        pytest.skip("a CUDA device may have the real ffpa-attn")
    assert ffpa_compat.unavailable_reason() == "no CUDA device"
    assert not kernels.ffpa_available() and kernels.ffpa_unavailable_reason() == "no CUDA device"
    assert ffpa_compat.forward_ops() == ()
    assert ffpa_compat.flop_formulas(*kernels.FLOP_FORMULAS) == []


@pytest.fixture(scope="module")
def stand_in():
    if torch.cuda.is_available() or hasattr(torch.ops.ffpa_attn, "_fwd_cute"):
        pytest.skip("the real ffpa_attn ops may be registered here")
    lib = torch.library.Library("ffpa_attn", "DEF")
    lib.define("_fwd_cute(Tensor q, Tensor k, Tensor v, float scale, int causal, int return_lse) -> (Tensor, Tensor)")
    lib.define("_bwd_cute(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, float scale, "
               "int causal, int flag) -> (Tensor, Tensor, Tensor)")
    lib.define("_varlen_fwd_cute(Tensor q, Tensor k, Tensor v, Tensor cu_q, Tensor cu_k, int max_q, int max_k, "
               "float scale, bool causal, int window_left, int window_right, float softcap, bool flag) "
               "-> (Tensor, Tensor)")
    lib.define("_varlen_bwd_cute(Tensor q, Tensor k, Tensor v, Tensor out, Tensor dout, Tensor lse, Tensor cu_q, "
               "Tensor cu_k, int max_q, int max_k, float scale, bool causal, int window_left, int window_right, "
               "float softcap, Tensor? extra) -> (Tensor, Tensor, Tensor)")

    def fwd(q, k, v, scale, causal, return_lse):
        assert return_lse == 1 and isinstance(causal, int)
        return REF.ref_dense_fwd(q, k, v, scale, bool(causal))

    def bwd(do, q, k, v, o, lse, scale, causal, flag):
        assert flag == 0
        return REF.ref_dense_bwd(do, q, k, v, o, lse, scale, bool(causal))

    def varlen_fwd(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, wl, wr, softcap, flag):
        assert (wl, wr, softcap, flag) == (-(2**31), -(2**31), 0.0, q.shape[1] > k.shape[1])
        return REF.ref_varlen_fwd(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal)

    def varlen_bwd(q, k, v, o, do, lse, cu_q, cu_k, max_q, max_k, scale, causal, wl, wr, softcap, extra):
        assert (wl, wr, softcap, extra) == (-(2**31), -(2**31), 0.0, None)
        return REF.ref_varlen_bwd(do, q, k, v, o, lse, cu_q, cu_k, max_q, max_k, scale, causal)

    for name, fn in [("_fwd_cute", fwd), ("_bwd_cute", bwd), ("_varlen_fwd_cute", varlen_fwd),
                     ("_varlen_bwd_cute", varlen_bwd)]:
        lib.impl(name, fn, "CompositeExplicitAutograd")
    _STAND_IN.append(lib)
    return torch.ops.ffpa_attn


def _rand(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_dense_ops_are_called_in_the_documented_order(stand_in):
    q, k, v, do = _rand(2, 6, 4, 8, seed=0), _rand(2, 6, 2, 8, seed=1), _rand(2, 6, 2, 8, seed=2), _rand(
        2, 6, 4, 8, seed=3)
    o, lse = ffpa_compat.dense_fwd(q, k, v, 0.5, True)
    ref_o, ref_lse = REF.ref_dense_fwd(q, k, v, 0.5, True)
    torch.testing.assert_close((o, lse), (ref_o, ref_lse))
    grads = ffpa_compat.dense_bwd(do, q, k, v, o, lse, 0.5, True)
    torch.testing.assert_close(grads, REF.ref_dense_bwd(do, q, k, v, o, lse, 0.5, True))


def test_varlen_backward_takes_do_first_and_passes_out_then_dout(stand_in):
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    q, k, v, do = _rand(8, 4, 8, seed=0), _rand(8, 2, 8, seed=1), _rand(8, 2, 8, seed=2), _rand(8, 4, 8, seed=3)
    o, lse = ffpa_compat.varlen_fwd(q, k, v, cu, cu, 5, 5, 0.5, True)
    torch.testing.assert_close((o, lse), REF.ref_varlen_fwd(q, k, v, cu, cu, 5, 5, 0.5, True))
    grads = ffpa_compat.varlen_bwd(do, q, k, v, o, lse, cu, cu, 5, 5, 0.5, True)
    torch.testing.assert_close(grads, REF.ref_varlen_bwd(do, q, k, v, o, lse, cu, cu, 5, 5, 0.5, True))
    swapped = REF.ref_varlen_bwd(o, q, k, v, do, lse, cu, cu, 5, 5, 0.5, True)  # what swapping o/do would give
    assert not torch.allclose(grads[0], swapped[0])


def test_forward_ops_and_flop_formulas_follow_the_op_orders(stand_in, monkeypatch):
    monkeypatch.setattr(ffpa_compat, "_load", lambda: (stand_in, ""))
    assert ffpa_compat.forward_ops() == (stand_in._fwd_cute.default, stand_in._varlen_fwd_cute.default)
    kernels.register_flop_formulas()  # the reference ops' formulas, in the project's order
    for packet, formula in ffpa_compat.flop_formulas(*kernels.FLOP_FORMULAS):
        if packet not in flop_registry:
            register_flop_formula(packet, get_raw=True)(formula)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    q, k, v = _rand(8, 4, 8, seed=0), _rand(8, 2, 8, seed=1), _rand(8, 2, 8, seed=2)
    dq, dk, dv = (_rand(2, 6, 4, 8, seed=4), _rand(2, 6, 2, 8, seed=5), _rand(2, 6, 2, 8, seed=6))

    def total(run):
        with FlopCounterMode(display=False) as fc:
            run()
        return fc.get_total_flops()

    def varlen(fwd, bwd):
        o, lse = fwd(q, k, v, cu, cu, 5, 5, 0.5, True)
        bwd(q, q, k, v, o, lse, cu, cu, 5, 5, 0.5, True)

    def dense(fwd, bwd):
        o, lse = fwd(dq, dk, dv, 0.5, True)
        bwd(dq, dq, dk, dv, o, lse, 0.5, True)

    expected_varlen = total(lambda: varlen(REF.ref_varlen_fwd, REF.ref_varlen_bwd))
    assert expected_varlen == 3 * kernels._varlen_flops(q, cu, cu, 5) > 0
    assert total(lambda: varlen(ffpa_compat.varlen_fwd, ffpa_compat.varlen_bwd)) == expected_varlen
    expected_dense = total(lambda: dense(REF.ref_dense_fwd, REF.ref_dense_bwd))
    assert expected_dense == 3 * kernels._dense_flops(dq, dk) > 0
    assert total(lambda: dense(ffpa_compat.dense_fwd, ffpa_compat.dense_bwd)) == expected_dense
