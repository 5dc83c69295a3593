"""`EngineConfig.count_routed_experts`: per decode step and MoE layer, the union of experts the batch's rows routed
to equals the one HF's own router outputs give on the same tokens (fp32, CPU); the MoE roofline's routed weight bytes
on a hand-checked case."""

import pytest
import torch
from transformers import Gemma4ForCausalLM

from lightning_ffpa.errors import ConfigError
from lightning_ffpa.presets import build_text_config
from lightning_ffpa.rollout.engine import EngineConfig, RolloutEngine
from lightning_ffpa.rollout.routing import expert_bytes, moe_layers, routed_bytes

EXPERTS, TOP_K = 16, 2  # more experts than a 3-row batch can pick (3 x 2), so the union is not all of them


def _moe():
    torch.manual_seed(5)
    return Gemma4ForCausalLM(build_text_config("tiny-moe", num_experts=EXPERTS, top_k_experts=TOP_K)).eval()


@pytest.fixture(scope="module")
def moe():
    return _moe()


def _prompts(n, length, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 512, (length,), generator=g).tolist() for _ in range(n)]


def _cfg(**kw):
    base = dict(page_size=4, num_pages=64, max_batch_size=4, max_seq_len=64, attention="dense",
                count_routed_experts=True)
    return EngineConfig(**{**base, **kw})


def _hf_reference(model, prompts, outputs):
    """From HF's router probabilities over prompt + output: per MoE layer, the distinct experts per decode step
    (summed over steps) and the rows per expert. Decode step k feeds output[k-1] at position len(prompt) + k - 1."""
    plen, steps = len(prompts[0]), len(outputs[0]) - 1
    ids = torch.tensor([p + o[:-1] for p, o in zip(prompts, outputs)])
    with torch.no_grad():
        probs = model(ids, output_router_logits=True).router_logits  # per MoE layer: (B*S, E)
    union, rows = [], []
    for p in probs:
        picked = p.view(len(prompts), ids.shape[1], -1).topk(TOP_K, dim=-1).indices[:, plen:plen + steps]  # (B, T, K)
        hit = torch.zeros(len(prompts), steps, EXPERTS, dtype=torch.int64).scatter_(2, picked, 1)
        union.append(int(hit.amax(0).sum()))
        rows.append(hit.sum((0, 1)).tolist())
    return union, rows


def test_union_counts_match_hf_router_outputs(moe):
    prompts = _prompts(3, 9, seed=1)  # 3 rows: bucket 4, one padding row the counts must leave out
    eng = RolloutEngine(moe, _cfg())
    seqs = eng.generate(prompts, 7)
    routing = eng.routing
    assert routing.steps == eng.stats["decode_steps"] == 6  # prefill's routing is not a decode step's
    union, rows = _hf_reference(moe, prompts, [s.output for s in seqs])
    assert routing.hits.sum(1).tolist() == union
    assert routing.rows_routed.tolist() == rows
    assert routing.rows_routed.sum().item() == len(moe_layers(moe)) * 6 * 3 * TOP_K  # real rows only
    assert routing.mean_union() == [u / 6 for u in union]
    assert all(TOP_K <= u / 6 < 3 * TOP_K + 1 for u in union) and any(u / 6 < EXPERTS for u in union)
    routing.reset()
    assert routing.steps == 0 and not routing.hits.any()


def test_counting_traces_into_the_one_decode_graph(monkeypatch):
    """What `compile_decode` compiles on CUDA, traced by dynamo on CPU: the hooks add no graph break, and the
    traced step counts what the eager one does. Its own model: HF's `output_router_logits` (the reference above)
    leaves hooks on the routers that dynamo cannot trace."""
    import torch._dynamo.testing

    moe = _moe()
    prompts = _prompts(3, 6, seed=2)
    eager = RolloutEngine(moe, _cfg())
    plain = [s.output for s in eager.generate(prompts, 5)]
    eng = RolloutEngine(moe, _cfg())
    torch._dynamo.reset()
    counts = torch._dynamo.testing.CompileCounter()
    monkeypatch.setattr(eng, "_step", torch.compile(eng._decode_step, backend=counts, dynamic=False))
    assert [s.output for s in eng.generate(prompts, 5)] == plain
    assert counts.frame_count == 1
    assert torch.equal(eng.routing.hits, eager.routing.hits)
    assert torch.equal(eng.routing.rows_routed, eager.routing.rows_routed)


def test_off_by_default_and_refused_without_experts(moe):
    eng = RolloutEngine(moe, _cfg(count_routed_experts=False))
    assert eng.routing is None
    dense = Gemma4ForCausalLM(build_text_config("tiny")).eval()
    with pytest.raises(ConfigError, match="engine.count_routed_experts"):
        RolloutEngine(dense, _cfg())
    with pytest.raises(ConfigError, match="engine.count_routed_experts"):
        _cfg(count_routed_experts="yes").check()


def test_routed_bytes_hand_checked(moe):
    # tiny-moe layer: gate_up (16, 2*32, 64) + down (16, 64, 32) fp32 -> one expert = (64*64 + 64*32) * 4 bytes
    n, one = expert_bytes(moe_layers(moe)[0][2])
    assert (n, one) == (16, (64 * 64 + 64 * 32) * 4) == (16, 24576)
    # two layers of 10 experts of 100 bytes; 1000 bytes of weights in all (so 1000 - 2000 < 0 is impossible:
    # take 5000); the steps read 2 and 4 experts on average
    b = routed_bytes(5000, [(10, 100), (10, 100)], [2.0, 4.0])
    assert b.all_expert_bytes == 2000 and b.routed_expert_bytes == 600
    assert b.weight_bytes == 5000 - 2000 + 600 == 3600
    assert b.routed_fraction == 600 / 2000 == 0.3
    with pytest.raises(ValueError, match="2 MoE layers but 1"):
        routed_bytes(5000, [(10, 100), (10, 100)], [2.0])
