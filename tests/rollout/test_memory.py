"""The GRPO memory arithmetic against known sizes: parameter counts derived by hand from the 31B shapes, real
models, peft's adapters, the KV pool the engine allocates, and the bytes autograd saves per layer."""

from dataclasses import replace

import pytest
import torch
import transformers

from lightning_ffpa.presets import build_text_config
from lightning_ffpa.rollout import memory
from lightning_ffpa.rollout.engine import EngineConfig
from lightning_ffpa.rollout.kv_cache import PagedKVCache
from lightning_ffpa.rollout.walker import DecoderWalker

H, INTER, V = 5376, 21504, 262_144  # Gemma4-31B hidden, MLP and vocabulary sizes
SLIDING = H * (32 * 256 + 2 * 16 * 256 + 32 * 256) + 3 * H * INTER + 2 * 256 + 4 * H  # q, k, v, o; MLP; norms
FULL = H * (32 * 512 + 4 * 512 + 32 * 512) + 3 * H * INTER + 2 * 512 + 4 * H  # k_eq_v: no v_proj
KV_SLIDING, KV_FULL = 2 * 16 * 256, 2 * 4 * 512  # K+V elements per token per layer


def test_31b_at_12_layers_by_hand():
    est = memory.estimate("gemma4-31b", num_hidden_layers=12, lora_r=16,
                          engine=EngineConfig(page_size=128, num_pages=64, max_seq_len=384), train_tokens=0,
                          weights="merged")
    params = V * H + H + 10 * SLIDING + 2 * FULL  # 5:1 sliding:full, tied embeddings, final norm
    assert params == 7_266_902_272
    adapters = (est.policy - params * 2) // 4
    assert est.engine_weights == params * 2 and est.lora_optimizer == adapters * 12
    assert est.kv_pool == 64 * 128 * 2 * (10 * KV_SLIDING + 2 * KV_FULL)
    assert est.activations == 0 and est.logits == 0


def test_full_depth_31b_policy_and_merged_copy_alone_fill_an_h200_and_shared_weights_do_not():
    est = memory.estimate("gemma4-31b", lora_r=16, engine=EngineConfig(page_size=128, num_pages=1024),
                          weights="merged")
    assert est.engine_weights == 2 * (V * H + H + 50 * SLIDING + 10 * FULL)  # 30.7e9 parameters in bf16
    assert est.policy + est.engine_weights > 114 * memory.GIB
    shared = memory.estimate("gemma4-31b", lora_r=16, engine=EngineConfig(page_size=128, num_pages=1024))
    # by hand: per layer (q, k, v) and (gate, up) fused with block-diagonal B; o and down alone; 16 = r
    sliding = (48 * H + (32 + 16 + 16) * 256 * 48) + (32 * H + 2 * INTER * 32) + 16 * (32 * 256 + H) + 16 * (INTER + H)
    full = (32 * H + (32 + 4) * 512 * 32) + (32 * H + 2 * INTER * 32) + 16 * (32 * 512 + H) + 16 * (INTER + H)
    assert shared.engine_weights == 2 * (50 * sliding + 10 * full)
    assert shared.engine_weights < 0.5 * memory.GIB and shared.policy + shared.engine_weights < 58 * memory.GIB
    # 64 slots' windows of 1024 tokens span 9 pages each: the sliding layers' pool is 577 pages, not 1024
    assert est.kv_pool == 128 * 2 * (577 * 50 * KV_SLIDING + 1024 * 10 * KV_FULL)


def test_31b_sliding_pool_is_sized_by_the_window_not_the_length():
    """16 sequences of 4.5k tokens at the 31B shapes: the pages the sliding layers would keep without recycling
    (every page, like the full layers: ~62 GiB) against their windows (~20 GiB in all)."""
    engine = EngineConfig(page_size=128, num_pages=16 * 36 + 1, max_batch_size=16, max_seq_len=36 * 128)
    est = memory.estimate("gemma4-31b", lora_r=16, engine=engine)
    kept = memory.estimate("gemma4-31b", lora_r=16, engine=replace(engine, num_sliding_pages=0))
    assert kept.kv_pool == 577 * 128 * 2 * (50 * KV_SLIDING + 10 * KV_FULL)
    assert est.kv_pool == 128 * 2 * ((16 * 9 + 1) * 50 * KV_SLIDING + 577 * 10 * KV_FULL)
    assert 61 < kept.kv_pool / memory.GIB < 63 and 19 < est.kv_pool / memory.GIB < 21


def test_kv_pool_estimate_is_what_the_engine_allocates_with_a_sliding_pool():
    from lightning_ffpa.rollout.engine import RolloutEngine

    engine = EngineConfig(page_size=8, num_pages=32, max_batch_size=2, max_seq_len=128, attention="dense")
    torch.manual_seed(0)
    eng = RolloutEngine(transformers.Gemma4ForCausalLM(build_text_config("tiny")), engine)
    assert 0 < eng.num_sliding_pages < engine.num_pages  # two 16-token windows: 2 * 3 pages of 8, plus page 0
    allocated = sum(t.numel() * t.element_size() for t in (*eng.cache.k.values(), *eng.cache.v.values()))
    assert memory.estimate("tiny", lora_r=4, inference_bytes=4, engine=engine).kv_pool == allocated


def test_tiny_against_real_model_peft_and_kv_cache():
    from peft import LoraConfig, get_peft_model

    engine = EngineConfig(page_size=8, num_pages=16, max_seq_len=64)
    est = memory.estimate("tiny", lora_r=4, weight_bytes=4, inference_bytes=2, engine=engine, weights="merged")
    torch.manual_seed(0)
    model = transformers.Gemma4ForCausalLM(build_text_config("tiny"))
    params = sum(p.numel() for p in model.parameters())
    cache = PagedKVCache(DecoderWalker(model).specs, 16, 8, torch.bfloat16, "cpu")
    peft = get_peft_model(model, LoraConfig(r=4, target_modules=list(memory.LORA_TARGETS)))
    adapters = sum(p.numel() for n, p in peft.named_parameters() if "lora_" in n)
    assert est.engine_weights == params * 2 and est.policy == params * 4 + adapters * 4
    assert est.lora_optimizer == adapters * 12
    assert est.kv_pool == sum(t.numel() * t.element_size() for t in (*cache.k.values(), *cache.v.values()))


def test_activation_coefficient_matches_the_bytes_autograd_saves():
    """Count unique storages saved for backward by a 31B-shaped layer stack at 1/8 width (bf16, CPU)."""
    scale, tokens, layers = 8, 64, 6
    cfg = build_text_config("gemma4-31b", num_hidden_layers=layers, hidden_size=H // scale,
                            intermediate_size=INTER // scale, num_attention_heads=32 // scale,
                            num_key_value_heads=16 // scale, num_global_key_value_heads=1, vocab_size=512)
    torch.manual_seed(0)
    model = transformers.Gemma4ForCausalLM(cfg).to(torch.bfloat16)
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in weights:
            saved[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.model(input_ids=torch.randint(0, 512, (1, tokens)), use_cache=False)
    per_hidden = sum(saved.values()) / (tokens * layers * cfg.hidden_size)
    assert 0.8 * memory.ACTIVATION_BYTES_PER_HIDDEN <= per_hidden <= memory.ACTIVATION_BYTES_PER_HIDDEN, per_hidden


def test_cli_prints_the_table(capsys):
    est = memory.main(["--preset", "tiny", "--lora_r", "2", "--engine.num_pages", "8", "--engine.page_size", "4",
                       "--engine.max_seq_len", "16", "--train_tokens", "32"])
    out = capsys.readouterr().out
    assert "kv_pool" in out and f"{est.total / memory.GIB:8.1f} GiB" in out
    with pytest.raises(ValueError, match="lora_r"):
        memory.estimate("tiny", lora_r=0)


def test_shared_engine_weights_equal_what_the_engine_allocates():
    """The estimate's adapter buffers against a real shared engine's own bytes (tiny, LoRA on every target)."""
    from peft import LoraConfig, get_peft_model

    from lightning_ffpa.rollout.shared_weights import WeightsPlan

    est = memory.estimate("tiny", lora_r=4, inference_bytes=4, engine=EngineConfig(page_size=8, num_pages=16,
                                                                                 max_seq_len=64))
    torch.manual_seed(0)
    peft = get_peft_model(transformers.Gemma4ForCausalLM(build_text_config("tiny")),
                          LoraConfig(r=4, target_modules=list(memory.LORA_TARGETS)))
    plan = WeightsPlan(peft, "shared", torch.float32, torch.device("cpu"))
    assert est.engine_weights == plan.own_bytes == sum(g.adapter_bytes for g in plan.build().groups)
    with pytest.raises(ValueError, match="weights='copy'"):
        memory.estimate("tiny", weights="copy")
