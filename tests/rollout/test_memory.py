"""The GRPO memory arithmetic against known sizes: parameter counts derived by hand from the 31B shapes, real
models, peft's adapters, the KV pool the engine allocates, the float8 base as `quantize_lora_bases` stores it, the
bytes autograd saves per layer, the bytes the product's SAC policy saves, and the chunked log-probs' live buffers."""

import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import transformers
from _live_peak import LivePeak

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
    assert est.activations == est.layer_transient == est.logprob_chunks == 0


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
                       "--engine.max_seq_len", "16", "--train_tokens", "32", "--max_tokens_per_microbatch", "16",
                       "--logprob_chunk_size", "8", "--base_dtype", "fp8"])
    out = capsys.readouterr().out
    assert "kv_pool" in out and "logprob_chunks" in out and f"{est.total / memory.GIB:8.1f} GiB" in out
    assert est == memory.estimate("tiny", lora_r=2, engine=EngineConfig(page_size=4, num_pages=8, max_seq_len=16),
                                  train_tokens=32, max_tokens_per_microbatch=16, logprob_chunk_size=8, base_dtype="fp8")
    assert est.logprob_chunks == 8 * build_text_config("tiny").vocab_size * 10  # 16 tokens: two chunks of 8, one alive
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


ROOT = Path(__file__).resolve().parents[2]
LORA16 = {"r": 16, "target_modules": list(memory.LORA_TARGETS)}
# SAC keeps per token of a 31B layer with LoRA r=16 on every target (by hand): its input, the attention's o (bf16)
# and lse (fp32), the high-K matmuls' outputs (o_proj, down_proj: back to H) and their LoRA A outputs (r wide)
SAC_SLIDING = H * 2 + 32 * 256 * 2 + 32 * 4 + 2 * H * 2 + 2 * 16 * 2
SAC_FULL = H * 2 + 32 * 512 * 2 + 32 * 4 + 2 * H * 2 + 2 * 16 * 2


@pytest.mark.parametrize("lora", [None, LORA16])
def test_sac_bytes_per_token_are_what_the_products_policy_saves(lora):
    """benchmarks/sac_accounting.py runs the product's `parallelize(activation_checkpointing="selective")` on a meta
    31B slice and sums the outputs its policy answers MUST_SAVE for; the estimate's per-layer bytes are those plus
    the layer input, which checkpoint itself keeps."""
    sys.path.insert(0, str(ROOT))
    from benchmarks.sac_accounting import account

    seq = 64
    counted = account("gemma4-31b", seq, ("high_k",), lora)["high_k"]
    ours, dequant = memory.slice_terms("gemma4-31b", memory.meta_model("gemma4-31b").config, lora)
    assert dequant == 0 and {c["layer_type"] for c in counted} == set(ours)
    for layer in counted:
        assert ours[layer["layer_type"]] * seq == layer["saved_bytes"] + seq * H * 2
    if lora:
        assert ours == {"sliding_attention": SAC_SLIDING, "full_attention": SAC_FULL}


def test_activations_scale_with_the_microbatch_not_the_batch():
    kw = dict(num_hidden_layers=12, logprob_chunk_size=1024, engine=EngineConfig(page_size=128, num_pages=64))
    one = memory.estimate("gemma4-31b", train_tokens=4608, **kw)
    four = memory.estimate("gemma4-31b", train_tokens=4 * 4608, max_tokens_per_microbatch=4608, **kw)
    whole = memory.estimate("gemma4-31b", train_tokens=4 * 4608, **kw)  # null budget: one forward over the batch
    assert (four.activations, four.layer_transient, four.logprob_chunks) == \
        (one.activations, one.layer_transient, one.logprob_chunks)
    assert whole.activations == 4 * one.activations
    # 10 sliding + 2 full layers keep their SAC bytes; the last layer's output, the final norm's and the
    # completion rows gathered for the log-probs stay too
    assert one.activations == 4608 * (10 * SAC_SLIDING + 2 * SAC_FULL + 3 * H * 2)
    # the recompute re-makes what a layer without checkpointing keeps (less what SAC kept), plus two gradients
    assert one.layer_transient == 4608 * ((memory.ACTIVATION_BYTES_PER_HIDDEN * H - SAC_SLIDING) + 2 * H * 2)
    none = memory.estimate("gemma4-31b", train_tokens=4608, activation_checkpointing="none", **kw)
    assert none.activations == 4608 * (12 * H * memory.ACTIVATION_BYTES_PER_HIDDEN + 3 * H * 2)
    assert none.layer_transient == 4608 * 2 * H * 2 < one.layer_transient and none.activations > one.activations


@pytest.mark.parametrize("rows", [32, 96])
def test_chunked_logprob_buffers_are_the_bytes_the_function_keeps_alive(rows):
    """Count the live bytes of `chunked_token_logprobs` forward and backward (softcapped, frozen head as under LoRA):
    10 bytes per row per vocabulary entry of one chunk (fp32 logits, tanh, bf16 d-logits), however many chunks:
    the loop frees a chunk's buffers before it makes the next one's."""
    per_vocab = 4 + 4 + 2
    from lightning_ffpa.rl.logprobs import chunked_token_logprobs

    chunk, vocab = 32, 8192
    torch.manual_seed(0)
    h = torch.randn(rows, 16, dtype=torch.bfloat16, requires_grad=True)
    w, labels = torch.randn(vocab, 16, dtype=torch.bfloat16), torch.randint(0, vocab, (rows,))
    with LivePeak(exclude=(h, w, labels)) as live:
        logp, _ = chunked_token_logprobs(h, w, labels, softcap=30.0, chunk_size=chunk)
        logp.sum().backward()
    assert chunk * vocab * per_vocab <= live.peak <= 1.01 * chunk * vocab * per_vocab
    est = memory.estimate("tiny", lora_r=2, train_tokens=rows, logprob_chunk_size=chunk)
    assert est.logprob_chunks == chunk * build_text_config("tiny").vocab_size * per_vocab


def test_logprob_chunks_are_bounded_by_the_chunk_not_the_tokens():
    kw = dict(num_hidden_layers=2, logprob_chunk_size=1024, engine=EngineConfig(page_size=128, num_pages=8))
    a = memory.estimate("gemma4-31b", train_tokens=4608, **kw)
    b = memory.estimate("gemma4-31b", train_tokens=8 * 4608, **kw)
    assert a.logprob_chunks == b.logprob_chunks == 1024 * V * 10  # one chunk's buffers at a time
    assert b.logprob_chunks < 8 * 4608 * V  # under a byte per (token x vocab entry) of the batch


def test_fp8_policy_bytes_are_what_quantize_lora_bases_stores():
    """A real tiny model in bf16 with LoRA on every target (peft keeps the adapters fp32), its bases converted."""
    from lightning_ffpa.fp8_base import quantize_lora_bases
    from lightning_ffpa.lora import apply_lora

    torch.manual_seed(0)
    peft = apply_lora(transformers.Gemma4ForCausalLM(build_text_config("tiny")).to(torch.bfloat16),
                      {"r": 4, "target_modules": list(memory.LORA_TARGETS)})
    quantize_lora_bases(peft)
    assert {p.dtype for p in peft.parameters()} == {torch.float8_e4m3fn, torch.float32, torch.bfloat16}
    fp8 = memory.estimate("tiny", lora_r=4, base_dtype="fp8")
    assert fp8.policy == sum(p.numel() * p.element_size() for p in peft.parameters())
    assert fp8.lora_optimizer == 12 * sum(p.numel() for p in peft.parameters() if p.requires_grad)
    bf16 = memory.estimate("tiny", lora_r=4)
    assert fp8.policy < bf16.policy and fp8.lora_optimizer == bf16.lora_optimizer


def test_bad_values_name_the_option():
    from lightning_ffpa.errors import ConfigError

    for kw, option in [({"activation_checkpointing": "full"}, "activation_checkpointing"),
                       ({"base_dtype": "int8"}, "base_dtype"), ({"max_tokens_per_microbatch": 0},
                                                               "max_tokens_per_microbatch"),
                       ({"logprob_chunk_size": 0}, "logprob_chunk_size"), ({"train_tokens": -1}, "train_tokens")]:
        with pytest.raises(ConfigError, match=f"`{option}="):
            memory.estimate("tiny", **kw)


def test_recipe_options_are_the_recipe_with_the_commands_overrides():
    """The recorded command of the float8-base H100 run over configs/gemma4_grpo.yaml: 16 rows of 512 + 1024
    tokens, three a micro-batch within 4608, the engine's 200 pages."""
    import yaml

    from lightning_ffpa.rollout.memory_recipe import apply_overrides, recipe_options, split_command

    command = ("fit --config /x/configs/gemma4_grpo.yaml --trainer.max_steps 4 "
               "--trainer.callbacks.init_args.sampling.max_new_tokens 1024 "
               "--trainer.callbacks.init_args.engine.max_seq_len 1536 --model.init_args.lora {r: 16, base_dtype: fp8} "
               "--trainer.callbacks.init_args.engine.num_pages 200 --model.init_args.max_tokens_per_microbatch 4608")
    config = apply_overrides(yaml.safe_load((ROOT / "configs" / "gemma4_grpo.yaml").read_text()),
                             split_command(command))
    opts = recipe_options(config)
    assert opts["engine"] == EngineConfig(page_size=128, num_pages=200, max_batch_size=16, max_seq_len=1536)
    assert (opts["train_tokens"], opts["max_tokens_per_microbatch"]) == (16 * 1536, 3 * 1536)
    assert (opts["preset"], opts["num_hidden_layers"], opts["lora_r"], opts["base_dtype"]) == \
        ("gemma4-31b", None, 16, "fp8")
    assert opts["lora_targets"] == tuple(memory.LORA_TARGETS)  # the YAML's, kept under the dict override
    assert (opts["logprob_chunk_size"], opts["activation_checkpointing"], opts["weight_bytes"]) == (1024, "selective", 2)
    assert recipe_options(yaml.safe_load((ROOT / "configs" / "gemma4_grpo.yaml").read_text()))[
        "max_tokens_per_microbatch"] == 2 * 4608  # as shipped: two of the 16 (512 + 4096)-token rows


def test_moe_expert_lora_is_counted_as_peft_builds_it_and_what_is_not_counted_is_said():
    from lightning_ffpa.lora import apply_lora

    stacks = ["experts.gate_up_proj", "experts.down_proj"]
    torch.manual_seed(0)
    peft = apply_lora(transformers.Gemma4ForCausalLM(build_text_config("tiny-moe")),
                      {"r": 4, "target_modules": list(memory.LORA_TARGETS), "target_parameters": stacks})
    est = memory.estimate("tiny-moe", lora_r=4, weight_bytes=4, lora_target_parameters=tuple(stacks),
                          train_tokens=64, max_tokens_per_microbatch=32)
    assert est.policy == sum(p.numel() * p.element_size() for p in peft.parameters())
    assert est.lora_optimizer == 12 * sum(p.numel() for p in peft.parameters() if p.requires_grad)
    assert est.activations > 0 and len(est.caveats) == 1 and "caveat" in est.table()
    # the shared engine's buffers, the expert stacks' A and s*B included, as a real engine allocates them
    from lightning_ffpa.rollout.shared_weights import WeightsPlan

    shared = memory.estimate("tiny-moe", lora_r=4, inference_bytes=4, lora_target_parameters=tuple(stacks))
    plan = WeightsPlan(peft, "shared", torch.float32, torch.device("cpu"))
    assert plan.stacks and shared.engine_weights == plan.own_bytes
