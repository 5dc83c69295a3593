"""Per-layer compile + SAC with the "ffpa" backend: no graph breaks, no recompiles, eager parity, true counts.

The full layers take the backend's real dispatch into the CPU reference ops (`force_kernel("reference")`);
the sliding layers take the flex_cpu fallback. The Gemma4 tests compile with dynamo + AOT autograd
(`aot_eager`): that is where graph breaks, guards, the SAC partition and dead-code elimination happen;
inductor adds only codegen and is covered by the small counter test below.
"""

import pytest
import torch
import torch._dynamo
import torch._dynamo.utils
import transformers

from lightning_ffpa import attention
from lightning_ffpa.attention import counters
from lightning_ffpa.parallel import parallelize
from lightning_ffpa.parallel.checkpointing import sac_context_fn
from lightning_ffpa.presets import build_text_config

from ._steps import run_steps

STEPS = 3


@pytest.mark.timeout(240)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_compiled_sac_ffpa_layers_match_eager_without_breaks_or_recompiles(aot_eager_compile, dtype):
    attention.register_ffpa(sliding="flex")  # process state: an earlier test may have set another
    # One layer of each kind keeps compile time down (4 layers compile 4 variants: Gemma4's shared-KV dict grows).
    cfg = build_text_config("tiny", num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"])
    cfg._attn_implementation = "ffpa"
    torch.manual_seed(0)
    compiled = transformers.Gemma4ForCausalLM(cfg).to(dtype)
    eager = transformers.Gemma4ForCausalLM(cfg).to(dtype)
    eager.load_state_dict(compiled.state_dict())
    parallelize(compiled, None, activation_checkpointing="selective", compile=True)
    parallelize(eager, None, activation_checkpointing="selective")
    ids = torch.randint(0, cfg.vocab_size, (2, 48), generator=torch.Generator().manual_seed(1))

    stats = torch._dynamo.utils.counters
    stats.clear()
    run_steps(compiled, ids, 1)  # compiles every layer variant
    graphs_after_first_step = stats["stats"]["unique_graphs"]
    got_losses, got_grads, got_dispatch, got_kernels = run_steps(compiled, ids, STEPS)
    assert not stats["graph_break"], dict(stats["graph_break"])
    # A counter read while tracing becomes a guard on its value and recompiles the layer every call.
    assert stats["stats"]["unique_graphs"] == graphs_after_first_step, dict(stats["stats"])

    want_losses, want_grads, want_dispatch, want_kernels = run_steps(eager, ids, STEPS)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    for got, want in zip(got_losses, want_losses):
        torch.testing.assert_close(got, want, **tol)
    for name, want in want_grads.items():
        torch.testing.assert_close(got_grads[name], want, **tol, msg=name)

    n_full = cfg.layer_types.count("full_attention")
    n_sliding = cfg.num_hidden_layers - n_full
    # One count per layer forward: the SAC recompute is neither counted in eager nor in compiled code.
    assert want_dispatch["ffpa-dense"] == STEPS * n_full and want_dispatch["sdpa"] == STEPS * n_sliding
    assert got_dispatch == want_dispatch
    assert got_kernels == want_kernels == {"cutedsl": 0, "reference": STEPS * n_full}


def test_eager_counts_skip_the_checkpoint_recompute():
    attention.register_ffpa(sliding="flex")  # the backend's sliding choice is process state an earlier test may set
    cfg = build_text_config("tiny")
    cfg._attn_implementation = "ffpa"  # transformers 5.25 drops `_attn_implementation` as a config kwarg
    model = transformers.Gemma4ForCausalLM(cfg)
    parallelize(model, None, activation_checkpointing="full")
    ids = torch.randint(0, 512, (1, 24))
    *_, dispatch, kernel = run_steps(model, ids, 2)
    assert dispatch["ffpa-dense"] == 2 * 2 and kernel["reference"] == 2 * 2
    assert attention.fallback_counts() == {"flex_cpu": 2 * 2}


@pytest.mark.timeout(240)
def test_count_op_survives_inductor_and_sac_once_per_forward():
    """The compiled count is an op with no outputs: inductor and the SAC partition must keep it in forward only."""
    layer = torch.nn.Linear(8, 8)

    def body(x):
        counters.count("path", "probe", x)
        return layer(x).relu()

    context_fn = sac_context_fn()

    def step(x):
        return torch.utils.checkpoint.checkpoint(body, x, use_reentrant=False, context_fn=context_fn)

    torch._dynamo.reset()
    compiled = torch.compile(step, dynamic=False)
    counters.reset()
    torch._dynamo.utils.counters.clear()
    x = torch.randn(4, 8, requires_grad=True)
    for _ in range(3):
        compiled(x).sum().backward()
    assert counters.counts("path") == {"probe": 3}
    assert not torch._dynamo.utils.counters["graph_break"]
    counters.reset()


def test_flex_forward_traces_without_graph_breaks():
    from torch.nn.attention.flex_attention import create_block_mask

    from lightning_ffpa.attention.flex import flex_forward

    q = torch.randn(1, 4, 128, 32)
    kv = torch.randn(1, 2, 128, 32)
    bm = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None, 128, 128, device="cpu")
    explained = torch._dynamo.explain(lambda q, k, v: flex_forward(q, k, v, bm, 1.0) * 2)(q, kv, kv)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert "flex_attention" in str(explained.graphs[0].code)
