"""TokenThroughput helpers: real-token counting, peak table, analytic FLOPs against a hand count."""

import pytest
import torch
import transformers

from lightning_ffpa.callbacks.throughput import (
    BF16_PEAK_FLOPS,
    _keys_per_query,
    count_real_tokens,
    forward_flops_per_batch,
    train_flops_per_batch,
)
from lightning_ffpa.presets import build_text_config


def test_count_real_tokens():
    labels = torch.tensor([[1, 2, -100], [-100, -100, 5]])
    assert count_real_tokens({"labels": labels, "input_ids": labels}) == 2  # the shifted targets: 2 and 5
    assert count_real_tokens({"attention_mask": torch.tensor([[1, 1, 0]])}) == 2
    assert count_real_tokens({"input_ids": torch.zeros(2, 5)}) == 10
    with pytest.raises(TypeError, match="count_real_tokens"):
        count_real_tokens("text")


def test_real_tokens_are_the_targets_the_loss_averages_over():
    """The loss scores position t against label t + 1, so a row's first label is never a target: counting
    `labels != -100` before the shift counted one token per row too many (1217 where the loss saw 1201)."""
    from types import SimpleNamespace

    from lightning_ffpa.data.collate import PadCollate
    from lightning_ffpa.data.packing import pack_documents
    from lightning_ffpa.module import Gemma4LM

    docs = [_doc(5), _doc(3), _doc(4)]
    padded = PadCollate(pad_id=0)([{"input_ids": torch.tensor(d.input_ids), "labels": torch.tensor(d.labels)}
                                   for d in docs])
    packed = pack_documents(docs, max_seq_length=8, pad_id=0)  # each document's first label is ignored already
    packed = {k: torch.stack([r[k] for r in packed]) for k in ("input_ids", "labels")}
    module = SimpleNamespace(context_parallel=lambda: None, _model_inputs=lambda b: {},
                             _nll_sum=lambda inputs, labels, n: torch.zeros(()))
    for batch in (padded, packed):
        assert count_real_tokens(batch) == int(Gemma4LM._loss_terms(module, batch)[1]) == 4 + 2 + 3


def _doc(n: int):
    from lightning_ffpa.data.documents import Document

    return Document(input_ids=list(range(1, n + 1)), labels=list(range(1, n + 1)))


def test_keys_per_query():
    assert _keys_per_query(4, None, True) == pytest.approx((1 + 2 + 3 + 4) / 4)
    assert _keys_per_query(4, 2, True) == pytest.approx((1 + 2 + 2 + 2) / 4)
    assert _keys_per_query(4, None, False) == 4


def test_flops_match_a_hand_count():
    cfg = build_text_config("tiny")
    model = transformers.Gemma4ForCausalLM(cfg)
    b, s = 2, 64
    linear = sum(p.numel() for layer in model.model.layers for p in layer.parameters() if p.dim() == 2)
    attn = 0
    for layer in model.model.layers:
        a = layer.self_attn
        heads = a.q_proj.out_features // a.head_dim
        attn += 4 * b * heads * s * _keys_per_query(s, a.sliding_window, True) * a.head_dim
    expected = 3 * (2 * (linear + model.lm_head.weight.numel()) * b * s + attn)
    assert train_flops_per_batch(model, b, s) == pytest.approx(expected)
    assert BF16_PEAK_FLOPS["H200"] == 989e12


def test_flops_of_a_wrapped_multimodal_moe_equal_its_text_model():
    """Gemma4ForConditionalGeneration keeps its layers (and `top_k_experts`) in the text part; with each layer
    wrapped for activation checkpointing the count must still find them and count top_k of the experts."""
    from lightning_ffpa.parallel import parallelize

    text = build_text_config("tiny-moe")
    causal = transformers.Gemma4ForCausalLM(text)
    multimodal = transformers.Gemma4ForConditionalGeneration(
        transformers.Gemma4Config(text_config=text.to_dict(), vision_config=None, audio_config=None))
    parallelize(multimodal, None, activation_checkpointing="selective")
    assert text.top_k_experts < text.num_experts
    assert train_flops_per_batch(multimodal, 2, 32) == pytest.approx(train_flops_per_batch(causal, 2, 32))


def test_a_context_parallel_rank_counts_its_share_of_the_batch():
    """CP peers are handed the same full batch and each does 1/cp of it: counting it whole on every rank
    multiplied samples, tokens and FLOPs by cp."""
    from lightning_ffpa.callbacks.throughput import TokenThroughput

    monitor = TokenThroughput()
    batch = {"input_ids": torch.zeros(4, 16, dtype=torch.long), "labels": torch.zeros(4, 16, dtype=torch.long)}
    whole = (monitor.batch_size_fn(batch), monitor.length_fn(batch))
    monitor._cp = 2
    assert (monitor.batch_size_fn(batch), monitor.length_fn(batch)) == (whole[0] / 2, whole[1] / 2) == (2, 30)  # 4 x 15 targets


def test_a_context_parallel_batch_rate_counts_each_batch_once():
    """At CP=2 on 2 ranks `train/batches_per_sec` was twice the real rate: Lightning multiplies the device rate by
    the world size, and the two CP ranks share one batch. It is over the data-parallel size (world / cp) now."""
    from types import SimpleNamespace

    from lightning.pytorch.plugins.precision import Precision
    from lightning.pytorch.trainer.states import RunningStage

    from lightning_ffpa.callbacks.throughput import TokenThroughput

    monitor = TokenThroughput(window_size=2)
    trainer = SimpleNamespace(precision_plugin=Precision(), world_size=2, enable_validation=False, callbacks=[],
                              state=SimpleNamespace(stage=RunningStage.TRAINING),
                              strategy=SimpleNamespace(root_device=torch.device("cpu"), context_parallel_size=2))
    monitor.setup(trainer, SimpleNamespace(), "fit")
    tp = monitor._throughputs[RunningStage.TRAINING]
    for step in (1, 2):  # one batch a second on each rank, 2 of its 4 samples (its CP share)
        tp.update(time=float(step), batches=step, samples=2 * step)
    got = tp.compute()
    assert got["device/batches_per_sec"] == 1.0 and got["batches_per_sec"] == 1.0  # dp = 1: one batch a second
    assert got["samples_per_sec"] == 4.0  # the whole batch of 4, once


def _tiny_lora():
    """A two-layer tiny Gemma4 on meta (no weights needed to count) and the same model under a peft LoRA."""
    from peft import LoraConfig, get_peft_model

    cfg = build_text_config("tiny", num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"])
    with torch.device("meta"):
        base = transformers.Gemma4ForCausalLM(cfg)
    full = train_flops_per_batch(base, 2, 32)
    matmul = sum(p.numel() for layer in base.model.layers for p in layer.parameters() if p.dim() == 2)
    matmul += base.lm_head.weight.numel()
    peft = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    adapters = sum(p.numel() for p in peft.parameters() if p.requires_grad)
    return peft, full, matmul, adapters


def test_a_lora_step_counts_no_weight_gradient_for_the_frozen_base():
    """A frozen weight's backward computes the input gradient only (2 of its 4 backward FLOPs per weight and
    token): the LoRA count is the full fine-tune's less 2 x frozen matmul params x tokens, plus the adapters' 6 x."""
    peft, full, matmul, adapters = _tiny_lora()
    tokens = 2 * 32
    lora = train_flops_per_batch(peft.get_base_model(), 2, 32)
    assert lora == pytest.approx(full - 2 * matmul * tokens + 6 * adapters * tokens)
    assert lora < full
    # the forward is the same work either way (plus the adapters' own matmuls)
    assert forward_flops_per_batch(peft.get_base_model(), 2, 32) == pytest.approx(full / 3 + 2 * adapters * tokens)


def test_token_throughput_logs_the_lora_count():
    """TokenThroughput hands Lightning the count the benchmarks use: a LoRA module's step is not counted as a
    full fine-tune's (which logged 52% MFU where the benchmark computed 36%)."""

    import lightning as L

    from lightning_ffpa.callbacks.throughput import TokenThroughput

    peft, full, _, _ = _tiny_lora()
    module = L.LightningModule()
    module.model = peft
    monitor = TokenThroughput()
    monitor._auto_flops = True
    batch = {"input_ids": torch.zeros(2, 32, dtype=torch.long)}
    with monitor._flops_of(module, monitor._batch_flops(module, batch, backward=True)):
        assert module.flops_per_batch == train_flops_per_batch(peft.get_base_model(), 2, 32) < full


def _tiny_moe_lora():
    """A two-layer tiny-moe Gemma4 on meta and the same model under the 26B-A4B recipe's LoRA (Linears and the
    3-D expert stacks through peft's `target_parameters`)."""
    from peft import LoraConfig, get_peft_model

    cfg = build_text_config("tiny-moe", num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"])
    with torch.device("meta"):
        base = transformers.Gemma4ForCausalLM(cfg)
    peft = get_peft_model(base, LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        target_parameters=["experts.gate_up_proj", "experts.down_proj"]))
    return cfg, peft.get_base_model()


def test_expert_adapters_count_only_the_routed_experts():
    """peft's adapters on a 3-D expert stack are 2-D (A: (r*E, in), B: (out, r*E)) but a token runs only its
    top_k experts' slices: top_k / num_experts of them per token, trained (6 x), like the stack itself."""
    from lightning_ffpa.callbacks.throughput import _attention_flops, _flops_split

    cfg, model = _tiny_moe_lora()
    b, s = 1, 16
    stacks = {n: p for n, p in model.named_parameters() if ".experts." in n and "lora_" in n}
    assert len(stacks) == 4 * cfg.num_hidden_layers  # A and B of gate_up_proj and down_proj
    routed = sum(p.numel() for p in stacks.values()) * cfg.top_k_experts / cfg.num_experts
    others = sum(p.numel() for n, p in model.named_parameters() if p.requires_grad and n not in stacks)
    fwd, frozen = _flops_split(model, b, s)
    attn = sum(_attention_flops(layer, b, s) for layer in model.model.layers)  # no weight: never frozen
    assert fwd - frozen == pytest.approx(2 * (routed + others) * b * s + attn)


def test_active_params_and_flops_of_a_moe_match_a_hand_count():
    """26B-A4B's MFU count: attention projections (the full layers share K and V), dense MLP, router, top_k of
    num_experts experts (gate_up and down), lm_head; 6 x that x tokens plus 3 x the attention matmuls."""
    from lightning_ffpa.callbacks.throughput import active_params, active_train_flops_per_batch
    from lightning_ffpa.presets import PRESETS

    _, model = _tiny_moe_lora()
    c = PRESETS["tiny-moe"]  # the shapes (the config holds head_dim per layer)
    h, heads, b, s = c["hidden_size"], c["num_attention_heads"], 2, 32
    sliding = h * heads * c["head_dim"] * 2 + 2 * h * c["num_key_value_heads"] * c["head_dim"]  # q, o, k, v
    full = h * heads * c["global_head_dim"] * 2 + h * c["num_global_key_value_heads"] * c["global_head_dim"]  # k = v
    per_layer = 3 * h * c["intermediate_size"] + c["num_experts"] * h  # dense MLP, router
    per_layer += c["top_k_experts"] * 3 * h * c["moe_intermediate_size"]  # gate, up, down of top_k experts
    expected = sliding + full + 2 * per_layer + c["vocab_size"] * h
    assert active_params(model) == pytest.approx(expected)
    attn = sum(4 * b * heads * s * _keys_per_query(s, w, True) * d
               for w, d in ((c["sliding_window"], c["head_dim"]), (None, c["global_head_dim"])))
    assert active_train_flops_per_batch(model, b, s) == pytest.approx(6 * expected * b * s + 3 * attn)


def test_the_experts_and_float8_base_paths_are_logged_once_they_ran():
    """`experts.path_counts()` and `fp8_base.path_counts()` (the loop a compiled fp32 MoE falls back to, the
    dequantizing base) reached no logger: the start-up line was all a run showed of them."""
    from lightning_ffpa.attention import counters
    from lightning_ffpa.callbacks.throughput import matmul_path_metrics

    counters.reset()
    assert matmul_path_metrics() == {}
    anchor = torch.zeros(1)
    counters.count("expert_lora", "loop", anchor)
    counters.count("fp8_base", "dequantize", anchor)
    counters.count("fp8_base", "dequantize", anchor)
    assert matmul_path_metrics() == {"experts/loop": 1.0, "fp8_base/dequantize": 2.0}
    counters.reset()


def test_the_job_totals_are_the_sum_over_the_ranks(tmp_path):
    """On 2 ranks `train/samples` and `train/lengths` were rank 0's counts and the job's rates rank 0's times the
    world size; with ranks holding different batches they are the sum of every rank's (one all-reduce a logging
    step). Rank 0: 2 rows x 3 targets, 100 FLOPs a batch; rank 1: 3 rows x 7 targets, 300 FLOPs."""
    from pathlib import Path

    from parallel._launch import torchrun_json  # tests/ is on sys.path under pytest

    rows = torchrun_json(Path(__file__).with_name("_fit_throughput_ranks.py"), tmp_path / "out.json", 2, 29617)
    logged = [m for _, m in rows if "train/samples" in m]
    assert [(m["train/samples"], m["train/lengths"]) for m in logged] == [(5, 27), (10, 54), (15, 81)]
    rated = [m for m in logged if "train/items_per_sec" in m]
    assert len(rated) == 2  # a window of 2 batches: from the second step
    for m in rated:  # the same window's time: the job's rate over rank 0's is the ratio of their counts
        assert m["train/items_per_sec"] / m["train/device/items_per_sec"] == pytest.approx(27 / 6)
        assert m["train/flops_per_sec"] / m["train/device/flops_per_sec"] == pytest.approx(400 / 100)
