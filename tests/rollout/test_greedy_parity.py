"""Greedy generation through the paged engine equals HF `generate` token for token (fp32, CPU).

Pages of 4 tokens and 24 new tokens cross many pages and the tiny Gemma4's 16-token window; a small
page pool forces recompute-style preemption. The Gemma4 test runs flex's eager path; the walker tests
(KV-shared layers, MoE layers, Llama, Qwen2) use the dense reference over the same mask mods to stay fast, and
one test checks dense and flex agree token for token.
"""

import pytest
import torch
from transformers import Gemma4ForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from lightning_ffpa.presets import build_text_config
from lightning_ffpa.rollout.engine import EngineConfig, RolloutEngine

NEW = 24


def _hf_greedy(model, prompt, new):
    model.generation_config.eos_token_id = None  # the engine is run without EOS too
    out = model.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _prompts(vocab, lens, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (n,), generator=g).tolist() for n in lens]


def _check(model, prompts, engine_cfg, expect_preemption=False, new=NEW):
    eng = RolloutEngine(model, engine_cfg)
    out = eng.generate(prompts, new)
    for p, seq in zip(prompts, out):
        assert seq.output == _hf_greedy(model, p, new), f"prompt {seq.seq_id} diverged"
        assert seq.finish_reason == "length" and len(seq.logprobs) == new
    if expect_preemption:
        assert eng.stats["preemptions"] > 0
    eng.page_table.flush()
    eng.page_table.check_invariants()
    assert eng.page_table.num_free_pages == engine_cfg.num_pages - 1  # every page came back
    return eng


@pytest.fixture(scope="module")
def gemma():
    torch.manual_seed(0)
    return Gemma4ForCausalLM(build_text_config("tiny")).eval()


def test_gemma4_greedy_matches_hf_with_preemption(gemma):
    prompts = _prompts(512, (7, 12, 3))
    # each sequence needs 7-9 pages of 4 tokens; 17 usable pages cannot hold all three at once
    cfg = EngineConfig(page_size=4, num_pages=18, max_batch_size=4, max_seq_len=64, max_prefill_tokens=64)
    eng = _check(gemma, prompts, cfg, expect_preemption=True)
    assert eng.stats["prefill_steps"] > 1


def test_gemma4_kv_shared_layers_and_per_layer_inputs_match_hf():
    torch.manual_seed(1)
    cfg = build_text_config("tiny", num_kv_shared_layers=2, hidden_size_per_layer_input=8)
    model = Gemma4ForCausalLM(cfg).eval()
    eng = _check(model, _prompts(512, (5, 11), seed=1),
                 EngineConfig(page_size=4, num_pages=64, max_batch_size=2, max_seq_len=64, attention="dense"), new=20)
    assert sum(s.shared for s in eng.walker.specs) == 2 and len(eng.cache.k) == 2


def test_gemma4_moe_layers_match_hf():
    """The 26B-A4B layout (router + experts beside the dense MLP) decodes through the same walker; the experts'
    3-D weights stay as HF runs them, only the attention and dense-MLP projections fuse."""
    torch.manual_seed(4)
    model = Gemma4ForCausalLM(build_text_config("tiny-moe")).eval()
    eng = _check(model, _prompts(512, (7, 12), seed=4),
                 EngineConfig(page_size=4, num_pages=64, max_batch_size=2, max_seq_len=64, attention="dense"), new=20)
    assert model.config.enable_moe_block and eng.projection_path == "fused (8 groups)"


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_llama_qwen_through_the_same_walker(family):
    torch.manual_seed(2)
    common = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    model = (LlamaForCausalLM(LlamaConfig(**common)) if family == "llama"
             else Qwen2ForCausalLM(Qwen2Config(**common))).eval()
    _check(model, _prompts(256, (6, 9), seed=2),
           EngineConfig(page_size=4, num_pages=48, max_batch_size=2, max_seq_len=64, attention="dense"), new=20)


def test_dense_reference_path_matches_flex(gemma):
    prompts = _prompts(512, (5, 9), seed=3)
    outs = {}
    for attention in ("flex", "dense"):
        eng = RolloutEngine(gemma, EngineConfig(page_size=4, num_pages=32, max_batch_size=2, max_seq_len=64,
                                                attention=attention))
        outs[attention] = [s.output for s in eng.generate(prompts, 12)]
        assert eng.attention_path == {"flex": "flex_eager", "dense": "dense_reference"}[attention]
    assert outs["flex"] == outs["dense"]
