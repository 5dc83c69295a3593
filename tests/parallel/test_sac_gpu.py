"""SAC on the GPU: the real FFPA forward op runs once per full-attention layer under selective AC.

Counts `ffpa_attn::_fwd_cute` calls in one forward+backward at the real head dims (512 on the full
layers), eager and compiled, without a mesh and under FSDP2 on a one-GPU mesh: once per full-attention
layer under selective AC (the forward is must-save), twice under eager full AC (it is replayed); compiled
full AC runs it once too (inductor's partitioner never replays an opaque custom op). Eager calls are
counted with a TorchDispatchMode, compiled ones with the profiler (see `_calls`).
"""

from __future__ import annotations

import os
from collections import Counter

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]

_FWD = "ffpa_attn::_fwd_cute"


def _require_ffpa():
    from lightning_ffpa.attention import kernels

    assert kernels.ffpa_available(), f"FFPA CuTeDSL is not importable: {kernels.ffpa_unavailable_reason()}"


def _model(num_layers: int = 6):
    import torch
    import transformers

    from lightning_ffpa import attention
    from lightning_ffpa.presets import build_text_config

    attention.register_ffpa()
    # Real Gemma4-31B head dims (256 sliding, 512 full) at a small width: 1 full layer in every 6.
    cfg = build_text_config("gemma4-31b", num_hidden_layers=num_layers, hidden_size=1024,
                            intermediate_size=2048, vocab_size=4096)
    torch.manual_seed(0)
    model = transformers.Gemma4ForCausalLM(cfg).cuda().bfloat16()
    model.set_attn_implementation("ffpa")
    n_full = cfg.layer_types.count("full_attention")
    assert n_full >= 1
    return model, n_full


def _calls(model, ids, how: str) -> int:
    """FFPA forward calls in one forward+backward.

    `dispatch_mode` counts what reaches the dispatcher in eager code, the way users count ops. Inside an
    eager checkpoint region SAC's own dispatch mode re-dispatches ops, so the profiler sees one call more
    than once there. `profiler` counts compiled code (no dispatch mode runs the compiled graph's ops).
    """
    import torch
    from torch.profiler import ProfilerActivity, profile
    from torch.utils._python_dispatch import TorchDispatchMode

    calls = Counter()

    class _Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            calls[str(func)] += 1
            return func(*args, **(kwargs or {}))

    if how == "dispatch_mode":
        with _Count():
            model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        torch.cuda.synchronize()
        return calls["ffpa_attn._fwd_cute.default"]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.name == _FWD)


def _ids():
    import torch

    return torch.randint(0, 4096, (1, 2048), device="cuda", generator=torch.Generator("cuda").manual_seed(0))


@pytest.mark.parametrize("mode,per_layer", [("none", 1), ("selective", 1), ("full", 2)])
def test_ffpa_forward_count_eager_no_mesh(mode, per_layer):
    from lightning_ffpa.parallel import parallelize

    _require_ffpa()
    model, n_full = _model()
    parallelize(model, None, activation_checkpointing=mode)
    ids = _ids()
    _calls(model, ids, "dispatch_mode")  # warm-up: the kernels JIT-compile on their first call
    model.zero_grad(set_to_none=True)
    assert _calls(model, ids, "dispatch_mode") == per_layer * n_full


# Compiled full AC also runs the FFPA forward once: inductor's partitioner never replays an opaque custom op.
@pytest.mark.parametrize("mode,per_layer", [("selective", 1), ("full", 1)])
def test_ffpa_forward_count_compiled_no_mesh(mode, per_layer):
    from lightning_ffpa.parallel import parallelize

    _require_ffpa()
    model, n_full = _model()
    parallelize(model, None, activation_checkpointing=mode, compile=True)
    ids = _ids()
    _calls(model, ids, "profiler")  # compiles
    model.zero_grad(set_to_none=True)
    assert _calls(model, ids, "profiler") == per_layer * n_full


@pytest.fixture
def one_gpu_group():
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("mode,per_layer", [("selective", 1), ("full", 2)])
def test_ffpa_forward_count_fsdp2(one_gpu_group, mode, per_layer, compile):
    per_layer = 1 if compile else per_layer  # see test_ffpa_forward_count_compiled_no_mesh
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from lightning_ffpa.parallel import parallelize

    _require_ffpa()
    model, n_full = _model()
    model.float()  # fp32 masters, bf16 compute: the product's FSDP2 recipe
    mesh = init_device_mesh("cuda", (1,))
    parallelize(model, mesh, activation_checkpointing=mode, compile=compile,
                mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    ids = _ids()
    how = "profiler" if compile else "dispatch_mode"
    _calls(model, ids, how)
    model.zero_grad(set_to_none=True)
    assert _calls(model, ids, how) == per_layer * n_full
