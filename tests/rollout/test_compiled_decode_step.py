"""The compiled decode step's generated code: KV writes in place, RoPE tables computed once per step.

KV writes: functionalized `index_copy_` into a graph input made inductor rewrite every pool in full each
layer each step (the H200's compiled decode step was slower than the uncompiled one). The proof is the
generated code: it allocates no buffer shaped like a pool. The default write (`fuse_kv_write`) is a scatter
inside generated kernels, which launch fewer kernels than the other write (one in-place
`lightning_ffpa::kv_write` call per pool). CPU (dense attention, fast) and GPU (compiled flex).

RoPE: inductor inlined the cos/sin math into every layer's query and key norm + RoPE kernel. The proof is
that only the `lightning_ffpa::rope_table` kernels compute cos or sin, one per layer type.

Fused projections: the step issues one matmul per projection group (q/k/v, gate/up), counted in the code.
"""

import re

import pytest
import torch
from torch._inductor.utils import run_and_get_code
from transformers import Gemma4ForCausalLM

from lightning_ffpa.presets import build_text_config
from lightning_ffpa.rollout.engine import EngineConfig, RolloutEngine
from lightning_ffpa.rollout.kv_cache import kv_write

_ALLOC = re.compile(r"empty_strided_\w+\(\(([\d, ]*)\)")


def _model(dtype=torch.float32, device="cpu"):
    torch.manual_seed(0)
    cfg = build_text_config("tiny", num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"])
    return Gemma4ForCausalLM(cfg).to(device, dtype).eval()


def _prompts():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(2, 512, (n,), generator=g).tolist() for n in (5, 9, 3)]


def _record_code(eng: RolloutEngine, compiled) -> list[str]:
    """Route the engine's decode step through `compiled`, keeping the code inductor generates on first call."""
    codes: list[str] = []

    def step(*args):
        if codes:
            return compiled(*args)
        out, code = run_and_get_code(compiled, *args)
        codes.extend(code)
        return out

    eng._step = step
    return codes


_LAUNCH = re.compile(r"^\s+(?:cpp_fused\w+\(|\w+\.run\(|extern_kernels\.)", re.M)


def _launches(code: str) -> int:
    """Kernel calls in the generated code (generated C++ or Triton kernels, and extern kernels)."""
    return len(_LAUNCH.findall(code))


def _assert_writes_in_place(code: str, pools: list[torch.Tensor], fused: bool = True) -> None:
    # Fused: no write call of its own (no kv_write, no aten fallback); else one in-place op call per pool.
    assert code.count("torch.ops.lightning_ffpa.kv_write.default(") == (0 if fused else len(pools))
    assert not re.search(r"^[^#\n]*aten\.index_(put|copy)", code, re.M)  # no aten fallback call (comments name it)
    assert "auto_functionalized" not in code
    # No temporary shaped like a pool or a pool's head slab: nothing stages a copy of the KV cache.
    pool_shapes = {tuple(p.shape) for p in pools} | {tuple(p.shape[1:]) for p in pools}
    allocs = {tuple(int(x) for x in m.split(",") if x.strip()) for m in _ALLOC.findall(code)}
    assert allocs and not allocs & pool_shapes, sorted(allocs & pool_shapes)


def test_kv_write_op_matches_index_copy():
    pool = torch.randn(1, 2, 12, 3)
    index, rows = torch.tensor([7, 0, 4]), torch.randn(2, 3, 3)
    want = pool.clone()
    want[0].index_copy_(1, index, rows)
    ptr = pool.data_ptr()
    kv_write(pool, index, rows)
    assert pool.data_ptr() == ptr and torch.equal(pool, want)


def _compiled_run(model, cfg: EngineConfig) -> tuple[RolloutEngine, list, str]:
    eng = RolloutEngine(model, cfg)  # compile_decode is CUDA-only: compile its step by hand
    pools = [*eng.cache.k.values(), *eng.cache.v.values()]
    ptrs = [p.data_ptr() for p in pools]
    torch._dynamo.reset()
    codes = _record_code(eng, torch.compile(eng._decode_step, dynamic=False))
    got = [(s.output, s.logprobs) for s in eng.generate(_prompts(), 6)]
    assert [p.data_ptr() for p in pools] == ptrs and len(pools) == 4
    return eng, got, "\n".join(codes)


def test_compiled_decode_step_writes_pools_in_place():
    model = _model()
    cfg = EngineConfig(page_size=4, num_pages=64, max_batch_size=4, max_seq_len=64, max_prefill_tokens=64,
                       attention="dense")
    want = [(s.output, s.logprobs) for s in RolloutEngine(model, cfg).generate(_prompts(), 6)]
    launches = {}
    for fused in (True, False):
        eng, got, code = _compiled_run(model, EngineConfig(**{**vars(cfg), "fuse_kv_write": fused}))
        # Same tokens as eager; logprobs to fp32 rounding (inductor fuses the norms/softmax differently).
        assert [o for o, _ in got] == [o for o, _ in want]
        torch.testing.assert_close(torch.tensor([lp for _, lp in got]), torch.tensor([lp for _, lp in want]),
                                   rtol=0, atol=1e-4)
        _assert_writes_in_place(code, [*eng.cache.k.values(), *eng.cache.v.values()], fused)
        launches[fused] = _launches(code)
    assert launches[True] < launches[False], launches  # the scatter rides in kernels that run anyway


def _assert_one_matmul_per_group(code: str, eng: RolloutEngine) -> None:
    linears = sum(isinstance(m, torch.nn.Linear) for m in eng.model.modules())  # lm_head included
    saved = sum(g.num_members - 1 for g in eng.walker.groups)
    assert saved > 0 and len(re.findall(r"extern_kernels\.(?:mm|addmm)\(", code)) == linears - saved


def _cos_kernels(code: str) -> list[str]:
    """Names of the generated kernels that compute cos (C++ `cpp_fused_*` or Triton `triton_*_fused_*`)."""
    return sorted({n for n in re.findall(r"\b((?:cpp|triton_\w+?)_fused\w*)\(", code) if "_cos_" in n})


def _assert_rope_once_per_type(code: str, layer_types: list[str]) -> None:
    assert code.count("torch.ops.lightning_ffpa.rope_table.default(") == len(set(layer_types))
    kernels = _cos_kernels(code)
    assert kernels and all("rope_table" in k for k in kernels), kernels  # no layer kernel recomputes them


def test_compiled_decode_step_computes_rope_tables_once_per_layer_type_and_one_matmul_per_group():
    model = _model()
    cfg = EngineConfig(page_size=4, num_pages=64, max_batch_size=4, max_seq_len=64, max_prefill_tokens=64,
                       attention="dense")
    eng = RolloutEngine(model, cfg)
    torch._dynamo.reset()
    codes = _record_code(eng, torch.compile(eng._decode_step, dynamic=False))
    eng.generate(_prompts(), 6)
    _assert_rope_once_per_type("\n".join(codes), model.config.layer_types)
    _assert_one_matmul_per_group("\n".join(codes), eng)


def test_rope_tables_are_made_in_layer_order_whatever_the_string_hashing(monkeypatch):
    """A set's order of layer types follows the process's string hashing, so a traced step (and inductor's cache
    key) would differ between runs; the walker makes the tables in first-appearance order."""
    torch.manual_seed(0)
    cfg = build_text_config("tiny", num_hidden_layers=3, layer_types=["sliding_attention", "full_attention",
                                                                      "sliding_attention"])
    model = Gemma4ForCausalLM(cfg).eval()
    rotary, made = model.model.rotary_emb, []

    def spy(x, pos, layer_type=None):
        made.append(layer_type)
        return type(rotary).forward(rotary, x, pos, layer_type)

    monkeypatch.setattr(rotary, "forward", spy)
    eng = RolloutEngine(model, EngineConfig(page_size=4, num_pages=64, max_batch_size=4, max_seq_len=64,
                                            max_prefill_tokens=64, attention="dense"))
    eng.generate(_prompts(), 2)
    assert made and made == ["sliding_attention", "full_attention"] * (len(made) // 2)


@pytest.mark.gpu
@pytest.mark.timeout(600)
def test_compiled_decode_step_writes_in_place_ropes_once_and_fuses_projections_gpu():
    model = _model(torch.bfloat16, "cuda")
    cfg = EngineConfig(page_size=16, num_pages=32, max_batch_size=4, max_seq_len=128)
    eng = RolloutEngine(model, EngineConfig(**{**vars(cfg), "compile_decode": True, "cuda_graphs": False}))
    assert eng.decode_path == "compiled" and eng.attention_path == "flex_compiled"
    torch._dynamo.reset()
    codes = _record_code(eng, eng._step)
    seqs = eng.generate(_prompts(), 6)
    assert all(len(s.output) == 6 and all(torch.isfinite(torch.tensor(s.logprobs))) for s in seqs)
    _assert_writes_in_place("\n".join(codes), [*eng.cache.k.values(), *eng.cache.v.values()])
    _assert_rope_once_per_type("\n".join(codes), model.config.layer_types)
    _assert_one_matmul_per_group("\n".join(codes), eng)
