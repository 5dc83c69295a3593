"""Gemma4LM: tiny model forward/backward, pretrained loading, LoRA, and bad-input errors."""

import pytest
import torch
from transformers import Gemma4ForCausalLM

from lightning_ffpa.errors import ConfigError
from lightning_ffpa.module import Gemma4LM
from lightning_ffpa.presets import build_text_config


def _batch(vocab=512, b=2, s=48, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (b, s), generator=g)
    return {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}


def test_tiny_has_both_layer_types_head_dim_512_and_k_eq_v():
    lm = Gemma4LM(preset="tiny", dtype="float32")
    lm.configure_model()
    attns = [layer.self_attn for layer in lm.hf_model.model.layers]
    assert {a.head_dim for a in attns if a.sliding_window is None} == {512}
    assert any(a.sliding_window for a in attns)
    assert all(a.v_proj is None for a in attns if a.sliding_window is None)  # k_eq_v on full layers


@pytest.mark.parametrize("preset", ["tiny", "tiny-moe"])
def test_forward_backward_finite(preset):
    lm = Gemma4LM(preset=preset, dtype="float32")
    lm.configure_model()
    loss, n = lm.compute_loss(_batch())
    loss.backward()
    assert torch.isfinite(loss) and n == 2 * 47
    grads = [p.grad for p in lm.model.parameters() if p.requires_grad]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)


def test_loss_ignores_minus_100_and_matches_hf():
    lm = Gemma4LM(preset="tiny", dtype="float32", attn_implementation="eager")
    lm.configure_model()
    batch = _batch()
    batch["labels"][:, :10] = -100
    ours, n = lm.compute_loss(batch)
    hf = lm.model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
    torch.testing.assert_close(ours, hf, rtol=1e-5, atol=1e-5)
    assert n == 2 * 47 - 2 * 9


def test_pretrained_loads_local_checkpoint(tmp_path):
    torch.manual_seed(0)
    ref = Gemma4ForCausalLM(build_text_config("tiny"))
    ref.save_pretrained(tmp_path / "tiny")
    lm = Gemma4LM(pretrained=str(tmp_path / "tiny"), dtype="float32", attn_implementation="eager")
    lm.configure_model()
    batch = _batch()
    ref.config._attn_implementation = "eager"
    want = ref(input_ids=batch["input_ids"]).logits
    got = lm.model(input_ids=batch["input_ids"]).logits
    torch.testing.assert_close(got, want)
    assert all(m.training for m in lm.model.modules())  # trains with dropout, as a preset-built model does


def _multimodal_checkpoint(path):
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    text = build_text_config("tiny")
    Gemma4ForConditionalGeneration(Gemma4Config(text_config=text.to_dict(), vision_config=None,
                                                audio_config=None)).save_pretrained(path)


def test_a_checkpoint_that_model_class_cannot_load_is_refused_by_name(tmp_path):
    """A multimodal checkpoint's weights do not load into Gemma4ForCausalLM (HF would initialise them all at
    random), and a text-only one's not into the multimodal class: one error naming `model.model_class`."""
    _multimodal_checkpoint(tmp_path / "mm")
    Gemma4ForCausalLM(build_text_config("tiny")).save_pretrained(tmp_path / "text")
    with pytest.raises(ConfigError, match=r"^`model\.model_class='causal_lm'`: .*multimodal.*conditional_generation"):
        Gemma4LM(pretrained=str(tmp_path / "mm"))
    with pytest.raises(ConfigError, match=r"^`model\.model_class='conditional_generation'`: .*text-only.*causal_lm$"):
        Gemma4LM(pretrained=str(tmp_path / "text"), model_class="conditional_generation")
    lm = Gemma4LM(pretrained=str(tmp_path / "mm"), model_class="conditional_generation", dtype="float32")
    lm.configure_model()
    assert torch.isfinite(lm.compute_loss(_batch())[0])


def test_pretrained_that_is_no_gemma4_checkpoint_is_refused_by_name(tmp_path):
    from transformers import LlamaConfig

    LlamaConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                vocab_size=64).save_pretrained(tmp_path / "llama")
    Gemma4ForCausalLM(build_text_config("tiny")).config.save_pretrained(tmp_path / "config_only")
    cases = {tmp_path / "llama": "is a llama model", tmp_path / "config_only": "holds a config but no weights",
             tmp_path / "config_only" / "config.json": "is a file"}
    for path, message in cases.items():
        with pytest.raises(ConfigError, match=rf"^`model\.pretrained='{path}'`: {message}"):
            Gemma4LM(pretrained=str(path))


def test_conditional_generation_class_builds():
    lm = Gemma4LM(preset="tiny", model_class="conditional_generation", dtype="float32")
    lm.configure_model()
    loss, _ = lm.compute_loss(_batch())
    assert torch.isfinite(loss)


def test_lora_trains_only_adapters():
    lm = Gemma4LM(preset="tiny", dtype="float32", lora={"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "o_proj"]})
    lm.configure_model()
    trainable = [n for n, p in lm.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)


@pytest.mark.parametrize(
    "kwargs, option",
    [
        ({"attn_implementation": "flash_magic"}, "model.attn_implementation"),
        ({"pretrained": "/nonexistent/gemma4"}, "model.pretrained"),
        ({"preset": "gemma4-999b"}, "model.preset"),
        ({"max_seq_length": 10**7}, "model.max_seq_length"),
    ],
)
def test_bad_input_names_the_option(kwargs, option):
    with pytest.raises((ValueError, FileNotFoundError), match=option.replace(".", r"\.")):
        Gemma4LM(**kwargs)


@pytest.mark.parametrize(
    "kwargs, option",
    [
        ({"warmup_steps": -10}, "model.warmup_steps"),
        ({"learning_rate": 0.0}, "model.learning_rate"),
        ({"loss_chunk_size": 0}, "model.loss_chunk_size"),
        ({"min_lr_ratio": 1.5}, "model.min_lr_ratio"),
        ({"weight_decay": -0.1}, "model.weight_decay"),
        ({"lora": {"r": 0}}, "model.lora.r"),
        ({"lora": {"r": 4, "lora_alpha": 0}}, "model.lora.lora_alpha"),
        ({"lora": {"r": 4, "lora_dropout": 1.0}}, "model.lora.lora_dropout"),
        ({"lora": {"r": 4}}, "model.lora.target_modules"),  # CausalLM: peft has no default for gemma4_text
        ({"dtype": "bf17"}, "model.dtype"),
    ],
)
def test_out_of_range_options_are_config_errors(kwargs, option):
    with pytest.raises(ConfigError, match=f"^`{option.replace('.', '[.]')}="):
        Gemma4LM(**kwargs)


def test_lora_without_targets_is_kept_where_peft_has_a_default():
    Gemma4LM(preset="tiny", model_class="conditional_generation", lora={"r": 4})  # peft's gemma4 default


@pytest.mark.parametrize("pretrained", [False, True])
def test_unknown_config_override_names_the_key_and_the_closest_field(pretrained, tmp_path):
    kwargs = {"config_overrides": {"num_hidden_laers": 2}}
    if pretrained:
        Gemma4ForCausalLM(build_text_config("tiny")).save_pretrained(tmp_path)
        kwargs["pretrained"] = str(tmp_path)
    with pytest.raises(ConfigError, match=r"^`model\.config_overrides\.num_hidden_laers=2`: .*`num_hidden_layers`"):
        Gemma4LM(**kwargs)


def test_pretrained_config_overrides_reach_the_text_config(tmp_path):
    Gemma4ForCausalLM(build_text_config("tiny")).save_pretrained(tmp_path)
    lm = Gemma4LM(pretrained=str(tmp_path), config_overrides={"num_hidden_layers": 2, "sliding_window": 8})
    assert lm.config.num_hidden_layers == 2 and lm.config.sliding_window == 8


@pytest.mark.parametrize("layers", [3, 6])
def test_pretrained_depth_override_gives_each_layer_its_types_shapes(layers, tmp_path):
    """A checkpoint's depth cut or grown: transformers' per-layer config (the full layers' head_dim 512) stayed
    on the checkpoint's indices, and building the grown model failed in transformers ("not homogeneous")."""
    from lightning_ffpa.validation import _meta_model

    Gemma4ForCausalLM(build_text_config("tiny")).save_pretrained(tmp_path)
    lm = Gemma4LM(pretrained=str(tmp_path), config_overrides={"num_hidden_layers": layers})
    layer_types = lm.config.layer_types
    assert len(layer_types) == layers
    model = _meta_model(lm)
    for kind, layer in zip(layer_types, model.model.layers, strict=True):
        assert layer.self_attn.head_dim == (512 if kind == "full_attention" else 32), kind


def test_lora_with_the_chunked_loss_matches_plain():
    """Under peft, `model.model` is the whole CausalLM: the chunked loss must find the decoder beneath it."""
    losses, grads = {}, {}
    for impl in ("plain", "chunked"):
        torch.manual_seed(0)
        lm = Gemma4LM(preset="tiny", dtype="float32", loss_impl=impl, loss_chunk_size=24,
                      lora={"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "o_proj"]})
        lm.configure_model()
        with torch.no_grad():  # B starts at 0; give it values so A's gradients are not all zero
            for name, p in lm.model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.02)
        loss, _ = lm.compute_loss(_batch())
        loss.backward()
        losses[impl] = loss.detach()
        grads[impl] = {n: p.grad for n, p in lm.model.named_parameters() if p.requires_grad}
    torch.testing.assert_close(losses["chunked"], losses["plain"], rtol=1e-6, atol=1e-6)
    assert grads["plain"].keys() == grads["chunked"].keys() and grads["plain"]
    for name, g in grads["plain"].items():
        torch.testing.assert_close(grads["chunked"][name], g, rtol=1e-4, atol=1e-5)  # fp32 summation order


def test_lora_option_parses_from_the_cli_as_typed_fields(capsys):
    from pathlib import Path

    from lightning_ffpa.cli import main

    tiny = Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml"
    with pytest.raises(SystemExit):
        main(["fit", "--config", str(tiny), "--model.init_args.lora",
              "{r: 16, lora_alpha: 32, target_modules: [q_proj, v_proj]}", "--print_config"])
    out = capsys.readouterr().out
    assert "r: 16" in out and "lora_alpha: 32.0" in out and "- v_proj" in out and "use_rslora: false" in out


def test_lora_targets_matching_nothing():
    lm = Gemma4LM(preset="tiny", lora={"r": 4, "target_modules": ["no_such_proj"]})
    with pytest.raises(ValueError, match=r"model\.lora\.target_modules"):
        lm.configure_model()


def test_build_adamw_groups_and_fused_choice():
    import transformers

    from lightning_ffpa.module import build_adamw
    from lightning_ffpa.presets import build_text_config

    model = transformers.Gemma4ForCausalLM(build_text_config("tiny"))
    opt = build_adamw(model, lr=1e-3, weight_decay=0.1)
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.ndim >= 2 for p in decay["params"]) and no_decay["params"]
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))
    assert opt.defaults["fused"] is None  # CPU parameters: torch's default implementation


@pytest.mark.gpu
def test_build_adamw_is_fused_on_cuda_and_steps():
    import transformers

    from lightning_ffpa.module import build_adamw
    from lightning_ffpa.presets import build_text_config

    model = transformers.Gemma4ForCausalLM(build_text_config("tiny")).cuda()
    opt = build_adamw(model, lr=1e-3)
    assert opt.defaults["fused"] is True
    ids = torch.randint(0, 512, (2, 64), device="cuda")
    before = model.lm_head.weight.detach().clone()
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    opt.step()
    assert not torch.equal(before, model.lm_head.weight)


def test_liger_loss_without_liger_kernel_is_refused_at_construction(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "liger_kernel" else real(name, *a))
    with pytest.raises(ConfigError, match=r"^`model\.loss_impl='liger'`: needs liger-kernel"):
        Gemma4LM(preset="tiny", loss_impl="liger")


@pytest.mark.parametrize("overrides, option, message", [
    ({"num_hidden_layers": "two"}, "model.config_overrides", "expected int"),
    ({"num_hidden_layers": -1}, "model.config_overrides.num_hidden_layers", "must be >= 1"),  # was HF's jargon
    ({"top_k_experts": 8}, "model.config_overrides.top_k_experts", "between 1 and num_experts=4"),
])
def test_bad_override_values_are_one_error_before_any_model(overrides, option, message):
    with pytest.raises(ConfigError, match=message) as err:
        Gemma4LM(preset="tiny-moe", config_overrides=overrides)
    assert err.value.option == option


def test_pretrained_refuses_overrides_that_reshape_its_weights(tmp_path):
    Gemma4ForCausalLM(build_text_config("tiny")).save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match=r"^`model\.config_overrides\.hidden_size=32`: changes the shape"):
        Gemma4LM(pretrained=str(tmp_path), config_overrides={"hidden_size": 32})
    with pytest.raises(ConfigError, match=r"^`model\.config_overrides\.num_hidden_layers='two'`"):
        Gemma4LM(pretrained=str(tmp_path), config_overrides={"num_hidden_layers": "two"})
    assert Gemma4LM(pretrained=str(tmp_path), config_overrides={"hidden_size": 64}).config.hidden_size == 64


def test_a_chunk_size_the_loss_does_not_use_is_said():
    with pytest.warns(UserWarning, match=r"`model.loss_chunk_size=1024` has no effect with `model.loss_impl=plain`"):
        Gemma4LM(preset="tiny", loss_impl="plain", loss_chunk_size=1024)


def test_data_beyond_the_vocabulary_is_refused_at_setup_for_a_python_trainer():
    """Only the CLI checked the data's vocabulary: a Python user's Trainer met an IndexError inside the embedding
    at the sanity check (a fresh trial's finding). `setup` names the data option now."""
    import lightning as L

    from lightning_ffpa.data import MockDataModule

    trainer = L.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(ConfigError, match=r"^`data.init_args.vocab_size=100000`: exceeds the model's vocab_size=512"):
        trainer.fit(Gemma4LM(preset="tiny"), MockDataModule(vocab_size=100_000, seq_length=16, batch_size=2))


def test_a_pretrained_folder_with_a_missing_shard_or_other_weights_is_refused_before_the_fit(tmp_path):
    """Both failed inside transformers' load, after the fit had written its files: a missing shard as a bare
    file-not-found line, another model's weights beside a config.json as a traceback (exit 1)."""
    import json
    import shutil

    torch.manual_seed(0)
    Gemma4ForCausalLM(build_text_config("tiny")).save_pretrained(tmp_path / "sharded", max_shard_size="300KB")
    shards = sorted((tmp_path / "sharded").glob("model-*.safetensors"))
    assert len(shards) > 2
    shards[1].unlink()
    with pytest.raises(ConfigError, match=rf"^`model.pretrained='.*sharded'`: is missing 1 of the {len(shards)} "
                                          rf"weight files its model.safetensors.index.json lists, e.g. {shards[1].name}"):
        Gemma4LM(pretrained=str(tmp_path / "sharded"))
    Gemma4ForCausalLM(build_text_config("tiny")).save_pretrained(tmp_path / "other")
    config = json.loads((tmp_path / "other" / "config.json").read_text())
    (tmp_path / "mixed").mkdir()
    (tmp_path / "mixed" / "config.json").write_text(json.dumps({**config, "vocab_size": 300}))
    shutil.copy(tmp_path / "other" / "model.safetensors", tmp_path / "mixed")
    with pytest.raises(ConfigError, match=r"^`model.pretrained='.*mixed'`: holds weights that do not fit its "
                                          r"config.json: model.embed_tokens.weight is \[512, \d+\], the config's "
                                          r"\(vocab_size, hidden_size\) is \[300, \d+\]"):
        Gemma4LM(pretrained=str(tmp_path / "mixed"))


def test_the_logged_gradient_norm_is_taken_in_fp32():
    """bf16 gradients' norm came out in bf16 (31.25, 28.125, ... on an H100): the sum of squares runs in fp32."""
    from lightning_ffpa.metrics import total_grad_norm

    params = [torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16)) for _ in range(2)]
    params[0].grad = torch.tensor([1.0, 2.0, 2.0], dtype=torch.bfloat16)
    params[1].grad = torch.tensor([0.0, 0.0, 0.01], dtype=torch.bfloat16)
    want = (9 + float(params[1].grad[2]) ** 2) ** 0.5  # 3.0000166: bf16 holds 3.0 or 3.015625
    got = total_grad_norm(params)
    assert got.dtype == torch.float32 and float(got) == pytest.approx(want, rel=1e-6)


def test_val_and_test_loss_are_means_per_token_as_perplexity_is():
    import math

    import lightning as L
    from torch.utils.data import DataLoader

    torch.manual_seed(0)
    lm = Gemma4LM(preset="tiny", dtype="float32", attn_implementation="eager")
    short, long = _batch(seed=1), _batch(seed=2)
    short["labels"][:, :44] = -100  # a short answer: 2 x 3 labelled tokens against 2 x 47
    batches = [short, long]
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False)
    val = trainer.validate(lm, DataLoader(batches, batch_size=None), verbose=False)[0]
    test = trainer.test(lm, DataLoader(batches, batch_size=None), verbose=False)[0]
    with torch.no_grad():
        terms = [lm.compute_loss(b) for b in batches]
    per_token = sum(loss * n for loss, n in terms) / sum(n for _, n in terms)
    per_batch = sum(loss for loss, _ in terms) / len(terms)
    assert abs(per_token - per_batch) > 1e-3  # the two means differ here, so the test can tell them apart
    assert val["val/loss"] == pytest.approx(float(per_token), rel=1e-5)
    assert val["val/loss"] == pytest.approx(math.log(val["val/ppl"]), rel=1e-5)
    assert test["test/loss"] == pytest.approx(float(per_token), rel=1e-5)


@torch.no_grad()
def test_predict_keeps_the_documents_of_a_packed_row_apart():
    """`predict_step` dropped `document_ids`, so "ffpa" never got the documents its varlen kernels take."""
    torch.manual_seed(0)
    lm = Gemma4LM(preset="tiny", dtype="float32", attn_implementation="ffpa")
    lm.configure_model()
    lm.eval()
    first, second = _batch(b=1, s=20, seed=1)["input_ids"], _batch(b=1, s=28, seed=2)["input_ids"]
    row = torch.cat([first, second], dim=1)
    packed = {"input_ids": row, "document_ids": torch.tensor([[0] * 20 + [1] * 28]),
              "position_ids": torch.cat([torch.arange(20), torch.arange(28)])[None]}
    seen = []
    forward = lm.model.forward
    lm.model.forward = lambda **kw: seen.append(kw) or forward(**kw)
    got = lm.predict_step(packed, 0)
    assert "documents" in seen[0]  # the varlen kernels' input, as the loss passes it (on CPU both paths agree)
    alone = torch.cat([lm.predict_step({"input_ids": first}, 0), lm.predict_step({"input_ids": second}, 0)], dim=1)
    assert torch.equal(got, alone)
