"""`FSDP2Strategy(fp8=...)` on CPU through torchao's emulated float8 matmuls: which modules are converted, the SAC
rule (attention forwards and the casts' amax saved), a fit against the high-precision one, its checkpoint and
resume (with float8 all-gather), the HF export, and the refusals. The real strategy and module, one process."""

from __future__ import annotations

import math
import sys
from collections import Counter

import lightning as L
import pytest
import torch
import torch.distributed as dist
import transformers

from lightning_ffpa.data import MockDataModule
from lightning_ffpa.errors import ConfigError
from lightning_ffpa.module import Gemma4LM
from lightning_ffpa.parallel import FSDP2Strategy, parallelize
from lightning_ffpa.parallel import fp8 as fp8_mod
from lightning_ffpa.parallel.fp8 import Float8Training
from lightning_ffpa.presets import build_text_config

from ._steps import count_ops, run_steps

EMULATED = {r: Float8Training(r, emulate=True) for r in ("rowwise", "tensorwise")}
# torchao is the `fp8` extra, not in `dev` (pyproject says why): the tests that convert modules need it
needs_torchao = pytest.mark.skipif(not fp8_mod.torchao_available(),
                                   reason="torchao is not installed: pip install -e '.[fp8]'")


def _tiny(preset="tiny", attn="sdpa"):
    torch.manual_seed(0)
    cfg = build_text_config(preset)
    cfg._attn_implementation = attn
    return transformers.Gemma4ForCausalLM(cfg)


def _float8(module) -> bool:
    return type(module).__name__ == "Float8Linear"


@needs_torchao
@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
def test_decoder_linears_are_converted_and_the_head_and_embeddings_are_not(recipe):
    model = _tiny()
    linears = [n for n, m in model.model.layers.named_modules() if isinstance(m, torch.nn.Linear)]
    parallelize(model, None, activation_checkpointing="selective", fp8=EMULATED[recipe])
    converted = [n for n, m in model.named_modules() if _float8(m)]
    assert len(converted) == len(linears) == len(model.fp8_layout["converted"]) > 0
    assert all(".layers." in n for n in converted)
    assert type(model.lm_head) is torch.nn.Linear and not _float8(model.model.embed_tokens)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied, still high precision
    config = next(m for m in model.modules() if _float8(m)).config
    assert config.emulate and config.enable_fsdp_float8_all_gather == (recipe == "tensorwise")


@needs_torchao
def test_moe_routers_stay_high_precision_and_are_reported():
    model = _tiny("tiny-moe")
    parallelize(model, None, fp8=EMULATED["rowwise"])
    kept = model.fp8_layout["kept"]
    assert kept and all(k.endswith("router.proj") for k in kept)
    assert not any(_float8(m) for n, m in model.named_modules() if n.endswith("router.proj"))
    experts = model.fp8_layout["experts"]  # the 3-D stacks torchao leaves alone: said, never silent
    assert experts and all(n.endswith("experts") for n in experts)
    assert f"{len(experts)} MoE expert modules" in EMULATED["rowwise"].describe(model.fp8_layout)


@needs_torchao
def test_ffpa_forward_stays_must_save_under_fp8():
    """The FFPA op (its CPU reference) runs once per full layer under SAC with float8 layers, twice under full AC."""
    from lightning_ffpa import attention
    from lightning_ffpa.attention.kernels import forward_ops

    attention.register_ffpa()
    ref_ops = {op for op in forward_ops() if "lightning_ffpa" in str(op)}
    n_full = build_text_config("tiny").layer_types.count("full_attention")
    for mode, per_layer in (("selective", 1), ("full", 2)):
        model = _tiny(attn="ffpa")
        parallelize(model, None, activation_checkpointing=mode, fp8=EMULATED["rowwise"])
        with attention.force_kernel("reference"):
            counts = count_ops(model, ref_ops)
        assert sum(counts.values()) == per_layer * n_full, (mode, counts)


@needs_torchao
@pytest.mark.parametrize("recipe,amax", [("rowwise", "amax"), ("tensorwise", "max")])
def test_sac_saves_the_float8_casts_amax_and_recomputes_the_rest(recipe, amax):
    """The rule: a cast's amax reduction is saved (no reduction in the recompute pass), its elementwise work is
    recomputed. Counted per step against no AC (every reduction once) and full AC (the forward's twice)."""
    reduction = getattr(torch.ops.aten, amax).default
    elementwise = torch.ops.aten.abs.default
    counts = {}
    for mode in ("none", "selective", "full"):
        model = _tiny()
        parallelize(model, None, activation_checkpointing=mode, fp8=EMULATED[recipe])
        counts[mode] = count_ops(model, {reduction, elementwise})
    assert counts["none"][reduction] > 0
    assert counts["selective"][reduction] == counts["none"][reduction] < counts["full"][reduction]
    assert counts["none"][elementwise] < counts["selective"][elementwise] == counts["full"][elementwise]


@needs_torchao
@pytest.mark.timeout(240)
def test_compiled_fp8_layers_match_eager_without_breaks_or_recompiles(aot_eager_compile):
    """Per-layer compile (dynamo + AOT autograd, as tests/parallel/test_compile.py) of SAC-wrapped float8 layers:
    no graph break, no recompile after the first step, the eager float8 losses and gradients, and the FFPA op
    once per full layer per step."""
    import torch._dynamo.utils

    from lightning_ffpa import attention

    attention.register_ffpa()
    cfg = build_text_config("tiny", num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"])
    cfg._attn_implementation = "ffpa"
    torch.manual_seed(0)
    compiled, eager = transformers.Gemma4ForCausalLM(cfg), transformers.Gemma4ForCausalLM(cfg)
    eager.load_state_dict(compiled.state_dict())
    parallelize(compiled, None, activation_checkpointing="selective", compile=True, fp8=EMULATED["rowwise"])
    parallelize(eager, None, activation_checkpointing="selective", fp8=EMULATED["rowwise"])
    ids = torch.randint(0, cfg.vocab_size, (2, 48), generator=torch.Generator().manual_seed(1))

    stats = torch._dynamo.utils.counters
    stats.clear()
    run_steps(compiled, ids, 1)
    graphs = stats["stats"]["unique_graphs"]
    got_losses, got_grads, _, got_kernels = run_steps(compiled, ids, 2)
    assert not stats["graph_break"], dict(stats["graph_break"])
    assert stats["stats"]["unique_graphs"] == graphs, dict(stats["stats"])
    want_losses, want_grads, _, want_kernels = run_steps(eager, ids, 2)
    for got, want in zip(got_losses, want_losses):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for name, want in want_grads.items():
        torch.testing.assert_close(got_grads[name], want, atol=1e-5, rtol=1e-5, msg=name)
    assert got_kernels == want_kernels == {"cutedsl": 0, "reference": 2 * cfg.layer_types.count("full_attention")}
    assert any(_float8(m) for m in compiled.modules())


class _Record(L.Callback):
    """Per-step losses; at the end, the trained high-precision weights (plain tensors, HF names) and how the
    converted weights were held."""

    def __init__(self):
        self.losses, self.weights, self.weight_types = [], {}, set()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))

    def on_train_end(self, trainer, pl_module):
        model = pl_module.hf_model
        for name, p in [*model.named_parameters(), *model.named_buffers()]:
            local = p.to_local() if hasattr(p, "to_local") else p  # a mesh of one: the whole tensor
            self.weight_types.add(type(local).__name__)
            plain = torch.empty(local.shape, dtype=local.dtype)
            plain.copy_(local.detach())  # out of torchao's weight subclass, if it is one
            self.weights[name.replace("._checkpoint_wrapped_module", "")] = plain


def _fit(pretrained, root, fp8, steps=3, ckpt_path=None, single_file=False):
    record = _Record()
    strategy = FSDP2Strategy(param_dtype="fp32", reduce_dtype="fp32", fp8=fp8, fp8_emulate=fp8 != "none",
                             save_distributed_checkpoint=not single_file)
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=steps, logger=False,
                        callbacks=[record, L.pytorch.callbacks.ModelCheckpoint(dirpath=f"{root}/ckpt", save_last=True)],
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        default_root_dir=root)
    module = Gemma4LM(pretrained=str(pretrained), dtype="float32", learning_rate=1e-2, warmup_steps=0,
                      min_lr_ratio=1.0)
    try:
        trainer.fit(module, MockDataModule(vocab_size=512, seq_length=32, num_samples=16, batch_size=2, seed=5),
                    ckpt_path=ckpt_path)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return record, module


@needs_torchao
@pytest.mark.timeout(400)
def test_fp8_fit_tracks_the_fp32_fit_resumes_and_exports_plain_weights(one_process, pretrained, tmp_path,
                                                                       monkeypatch):
    import torchao.float8

    from lightning_ffpa.export import run

    precomputed = Counter()
    original = torchao.float8.precompute_float8_dynamic_scale_for_fsdp
    monkeypatch.setattr(torchao.float8, "precompute_float8_dynamic_scale_for_fsdp",
                        lambda m: (precomputed.update(["calls"]), original(m))[1])
    plain, _ = _fit(pretrained, tmp_path / "fp32", "none")
    rowwise, _ = _fit(pretrained, tmp_path / "rowwise", "rowwise")
    assert precomputed["calls"] == 0  # rowwise has no float8 all-gather
    tensorwise, _ = _fit(pretrained, tmp_path / "tensorwise", "tensorwise")
    assert precomputed["calls"] == 3  # one scale precompute after each optimizer step
    # Under FSDP2 the tensorwise weights are torchao's float8-all-gather subclass; rowwise ones plain tensors
    assert "WeightWithDynamicFloat8CastTensor" in tensorwise.weight_types
    assert "WeightWithDynamicFloat8CastTensor" not in rowwise.weight_types
    # Tolerance at tiny size (loss ~6.2, weights of std 0.02, 3 SGD-like steps): e4m3 keeps ~2 significant
    # digits per operand; the losses measured within 0.031 of fp32 (both recipes), and 0.1 is the bound
    for run_ in (rowwise, tensorwise):
        assert all(math.isfinite(x) for x in run_.losses) and len(run_.losses) == 3
        assert run_.losses == pytest.approx(plain.losses, abs=0.1), (run_.losses, plain.losses)
        assert run_.losses != plain.losses  # the float8 casts ran: emulation rounds to e4m3
    # The DCP checkpoint resumes with float8 all-gather and goes on as an uninterrupted run does
    straight, _ = _fit(pretrained, tmp_path / "straight", "tensorwise", steps=4)
    resumed, _ = _fit(pretrained, tmp_path / "tensorwise", "tensorwise", steps=4,
                      ckpt_path=str(tmp_path / "tensorwise" / "ckpt" / "last.ckpt"))
    assert straight.losses[:3] == tensorwise.losses and resumed.losses == straight.losses[3:]
    # So does a single-file checkpoint, which holds plain tensors (no torchao class: it loads with weights_only)
    single, _ = _fit(pretrained, tmp_path / "single", "tensorwise", single_file=True)
    last = tmp_path / "single" / "ckpt" / "last.ckpt"
    assert {type(v) for v in torch.load(last, weights_only=True)["state_dict"].values()} == {torch.Tensor}
    resumed_single, _ = _fit(pretrained, tmp_path / "single", "tensorwise", steps=4, ckpt_path=str(last),
                             single_file=True)
    assert single.losses == tensorwise.losses and resumed_single.losses == straight.losses[3:]
    # Export writes the high-precision weights as plain HF safetensors; from_pretrained gives their logits
    run([str(tmp_path / "straight" / "ckpt" / "last.ckpt"), str(tmp_path / "hf")])
    from safetensors import safe_open

    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.float32}
    hf = transformers.Gemma4ForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ref = transformers.Gemma4ForCausalLM(build_text_config("tiny")).eval()
    keys = ref.state_dict().keys()  # parameters and persistent buffers
    missing, _ = ref.load_state_dict({k: v for k, v in straight.weights.items() if k in keys}, strict=False)
    assert set(missing) <= {"lm_head.weight"}  # tied to the embedding
    ids = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(hf(input_ids=ids).logits, ref(input_ids=ids).logits)
    assert not any(_float8(m) for m in hf.modules())
    run([str(last), str(tmp_path / "hf_single")])  # the resumed single-file run's last checkpoint: 4 steps
    with torch.no_grad():
        single_logits = transformers.Gemma4ForCausalLM.from_pretrained(tmp_path / "hf_single")(input_ids=ids).logits
        assert torch.equal(single_logits, hf(input_ids=ids).logits)


def test_the_conversion_is_said_in_one_line():
    """What the strategy logs after parallelize (a run, and benchmarks/fp8_loss.py reading its log, see FP8 ran)."""
    layout = {"converted": [f"{i}.mlp.up_proj" for i in range(7)], "kept": [f"{i}.router.proj" for i in range(4)]}
    line = Float8Training("tensorwise", emulate=True).describe(layout)
    assert line == ("fp8 tensorwise: 7 decoder Linear layers train in torchao float8 (emulated in high precision), "
                    "4 kept in high precision (0.router.proj, 1.router.proj, 2.router.proj, ...); the lm_head and "
                    "embeddings stay in high precision")
    moe = Float8Training("rowwise").describe({**layout, "experts": ["0.mlp.experts", "1.mlp.experts"]})
    assert "; 2 MoE expert modules (0.mlp.experts, ...) stay in high precision (torchao converts nn.Linear only" in moe
    assert Float8Training("rowwise").describe({"converted": ["0.q_proj"], "kept": []}).startswith(
        "fp8 rowwise: 1 decoder Linear layers train in torchao float8, 0 kept in high precision;")


# Bad input: one ConfigError naming `fp8`, before any process group or model work


def test_an_unknown_value_is_refused():
    with pytest.raises(ConfigError, match=r"^`fp8='fp4'`: is not one of 'none', 'rowwise', 'tensorwise'$"):
        FSDP2Strategy(fp8="fp4")


def test_cpu_without_emulate_is_refused_before_the_process_group(tmp_path):
    from lightning_ffpa.validation import check_parallel_layout

    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=FSDP2Strategy(fp8="rowwise"), max_steps=1,
                        logger=False, enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    module = Gemma4LM(preset="tiny", dtype="float32")
    with pytest.raises(ConfigError, match=r"^`fp8='rowwise'`: needs a CUDA GPU with FP8 .* this run's device is cpu"):
        check_parallel_layout(trainer, module)  # the CLI's pre-flight
    with pytest.raises(ConfigError, match=r"^`fp8='rowwise'`: needs a CUDA GPU"):
        trainer.fit(module, MockDataModule(vocab_size=512, seq_length=16, num_samples=4, batch_size=2))
    assert not dist.is_initialized()


def test_a_gpu_below_sm89_is_refused(monkeypatch):
    monkeypatch.setattr(fp8_mod, "torchao_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA A100-SXM4-80GB")
    cuda = torch.device("cuda", 0)
    for cap in ((8, 0), (8, 6)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None, cap=cap: cap)
        with pytest.raises(ConfigError, match=r"`fp8='tensorwise'`: needs FP8 tensor cores \(CUDA capability >= 8.9"):
            Float8Training("tensorwise").check_device(cuda)
        Float8Training("none").check_device(cuda)  # fp8 off: nothing to refuse
    for cap in ((8, 9), (9, 0), (10, 0)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None, cap=cap: cap)
        Float8Training("tensorwise").check_device(cuda)


def test_lora_is_refused_in_preflight_and_in_parallelize():
    from peft import LoraConfig, get_peft_model

    from lightning_ffpa.validation import check_parallel_layout

    lora = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=FSDP2Strategy(fp8="rowwise", fp8_emulate=True),
                        logger=False, enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(ConfigError, match=r"^`fp8='rowwise'`: .*LoRA.*`model\.lora\.base_dtype: fp8`"):
        check_parallel_layout(trainer, Gemma4LM(preset="tiny", dtype="float32", lora=lora))
    peft = get_peft_model(_tiny(), LoraConfig(**lora))
    with pytest.raises(ConfigError, match=r"`fp8='rowwise'`: .*frozen"):
        parallelize(peft, None, fp8=EMULATED["rowwise"])
    assert not any(_float8(m) for m in peft.modules())


def test_emulate_without_a_recipe_is_refused_by_name():
    """`fp8_emulate: true` with `fp8: none` emulated nothing, exit 0."""
    with pytest.raises(ConfigError, match=r"^`fp8_emulate=True`: emulates the float8 matmuls of `fp8`, which is 'none'"):
        FSDP2Strategy(fp8="none", fp8_emulate=True)
    assert Float8Training("rowwise", emulate=True).enabled


def test_missing_torchao_is_one_line_before_any_work(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao.float8", None)  # `import torchao.float8` raises ImportError
    message = r"^`fp8='rowwise'`: needs torchao: pip install 'lightning-ffpa\[fp8\]'$"
    with pytest.raises(ConfigError, match=message):
        Float8Training("rowwise").config()
    monkeypatch.setattr(fp8_mod, "torchao_available", lambda: False)
    with pytest.raises(ConfigError, match=message):  # the pre-flight and setup_environment check
        Float8Training("rowwise", emulate=True).check_device(torch.device("cpu"))


def test_torchao_is_needed_only_when_fp8_is_on(monkeypatch):
    """With torchao unimportable, fp8 "none" builds the strategy and parallelizes (transformers itself imports
    torchao when it is installed, so the import is blocked here rather than looked for in sys.modules)."""
    for name in ("torchao", "torchao.float8"):
        monkeypatch.setitem(sys.modules, name, None)
    FSDP2Strategy()
    model = _tiny()
    parallelize(model, None, activation_checkpointing="selective", fp8=Float8Training("none"))
    assert not any(_float8(m) for m in model.modules()) and not hasattr(model, "fp8_layout")


@pytest.mark.gpu
@pytest.mark.timeout(300)
@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
def test_fp8_steps_on_cuda(recipe, tmp_path, one_process):
    """A few real FP8 steps (no emulation) of the tiny model under FSDP2Strategy, bf16, SAC and per-layer
    compile, beside the bf16 run: finite and close."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs a CUDA GPU with FP8 (capability >= 8.9)")

    def fit(fp8):
        record = _Record()
        strategy = FSDP2Strategy(fp8=fp8, compile=True)
        trainer = L.Trainer(accelerator="gpu", devices=1, strategy=strategy, max_steps=4, logger=False,
                            callbacks=[record], enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, limit_val_batches=0, default_root_dir=tmp_path)
        module = Gemma4LM(preset="tiny", dtype="bfloat16", learning_rate=1e-2, warmup_steps=0)
        torch.manual_seed(0)
        try:
            trainer.fit(module, MockDataModule(vocab_size=512, seq_length=256, num_samples=16, batch_size=2, seed=5))
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
        return record, module

    base, _ = fit("none")
    fp8, module = fit(recipe)
    assert len(module.hf_model.fp8_layout["converted"]) > 0
    assert all(math.isfinite(x) for x in fp8.losses)
    assert fp8.losses == pytest.approx(base.losses, abs=0.15), (fp8.losses, base.losses)
