"""`model.lora.base_dtype: fp8` with checkpoints and FSDP2Strategy: a full checkpoint holds the float8 base and its
scales and resumes as the uninterrupted run; an adapter-only checkpoint (`save_frozen_weights: false`) resumes over
the rebuilt, re-quantised base (its digest checked) and exports; under FSDP2Strategy (one process, gloo) the float8
base stays whole, out of FSDP2 (the real module, Trainer and strategies on CPU, in-process)."""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from transformers import Gemma4ForCausalLM

from lightning_ffpa.checkpoint.frozen import FROZEN_BASE_KEY
from lightning_ffpa.data import MockDataModule
from lightning_ffpa.errors import ConfigError
from lightning_ffpa.export import export
from lightning_ffpa.fp8_base import FP8_DTYPE, Float8BaseLinear, path_counts
from lightning_ffpa.module import Gemma4LM
from lightning_ffpa.parallel import FSDP2Strategy
from lightning_ffpa.presets import build_text_config

LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "o_proj", "down_proj"], "base_dtype": "fp8"}
N = 2  # steps before the stop; the resume and the straight run go to 2N


class Snapshot(L.Callback):
    """At the end of fit: every weight (whole) by name, and the modules the LoRA bases are."""

    def on_train_end(self, trainer, pl_module):
        self.weights = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().cpu().clone()
                        for n, p in pl_module.named_parameters()}
        self.bases = [m for m in pl_module.modules() if isinstance(m, Float8BaseLinear)]


def _fit(root, steps, *, ckpt_path=None, strategy="auto", **module_kw) -> tuple[Snapshot, L.Trainer]:
    L.seed_everything(0)
    snap = Snapshot()
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=steps, logger=False,
                        callbacks=[snap, ModelCheckpoint(dirpath=root / "ckpt", save_last=True)],
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        default_root_dir=root)
    data = MockDataModule(vocab_size=512, seq_length=32, num_samples=16, batch_size=2, seed=5)
    module = Gemma4LM(preset="tiny", dtype="float32", lora=LORA, config_overrides={"num_hidden_layers": 2},
                      learning_rate=1e-2, warmup_steps=0, min_lr_ratio=1.0, **module_kw)
    trainer.fit(module, data, ckpt_path=None if ckpt_path is None else str(ckpt_path))
    return snap, trainer


def _assert_same(got: Snapshot, want: Snapshot) -> None:
    assert got.weights.keys() == want.weights.keys()
    for name in want.weights:
        assert torch.equal(got.weights[name].view(torch.uint8) if got.weights[name].dtype == FP8_DTYPE
                           else got.weights[name], want.weights[name].view(torch.uint8)
                           if want.weights[name].dtype == FP8_DTYPE else want.weights[name]), name


@pytest.mark.parametrize("save_frozen", [True, False], ids=["full", "adapter-only"])
def test_resume_equals_the_straight_run_and_the_checkpoint_exports(tmp_path, save_frozen):
    straight, _ = _fit(tmp_path / "straight", 2 * N, save_frozen_weights=save_frozen)
    assert len(straight.bases) == 6 and all(m.weight.dtype == FP8_DTYPE for m in straight.bases)
    _fit(tmp_path / "cut", N, save_frozen_weights=save_frozen)
    cut = tmp_path / "cut" / "ckpt" / "last.ckpt"
    saved = torch.load(cut, map_location="cpu", weights_only=True)
    fp8 = {k: v for k, v in saved["state_dict"].items() if v.dtype == FP8_DTYPE}
    scales = [k for k in saved["state_dict"] if k.endswith(".base_layer.weight_scale")]
    if save_frozen:  # the float8 bytes and their scales are what the file holds for the base
        assert len(fp8) == len(scales) == 6 and FROZEN_BASE_KEY not in saved
    else:  # left out, and digested as stored: float8 bytes and fp32 scales
        assert not fp8 and not scales
        digested = saved[FROZEN_BASE_KEY]["tensors"]
        assert sum(v[1] == "float8_e4m3fn" for v in digested.values()) == 6
        assert sum(k.endswith(".weight_scale") for k in digested) == 6
    resumed, trainer = _fit(tmp_path / "cut", 2 * N, ckpt_path=cut, save_frozen_weights=save_frozen)
    assert trainer.global_step == 2 * N
    _assert_same(resumed, straight)
    result = export(cut, tmp_path / "hf", merge_lora=True)
    assert len(result.dequantized) == 6 and result.merged == result.dequantized and result.dtype == torch.float32


@pytest.mark.parametrize("dcp", [False, True], ids=["file", "dcp"])
def test_fsdp2_keeps_the_float8_base_whole_and_resumes(one_process, tmp_path, dcp):
    torch.manual_seed(0)
    base = tmp_path / "base"
    Gemma4ForCausalLM(build_text_config("tiny", num_hidden_layers=2)).save_pretrained(base)

    def fit(root, steps, ckpt_path=None):
        strategy = FSDP2Strategy(param_dtype="fp32", reduce_dtype="fp32", activation_checkpointing="none",
                                 compile=False, save_distributed_checkpoint=dcp)
        out = _fit(root, steps, ckpt_path=ckpt_path, strategy=strategy, pretrained=str(base))
        dist.destroy_process_group()
        return out + (strategy,)

    before = path_counts().get("dequantize", 0)
    straight, _, strategy = fit(tmp_path / "straight", 2 * N)
    assert path_counts()["dequantize"] > before  # the CPU path ran, counted
    placed = strategy.frozen_placement
    assert placed["replicated"] and placed["reason"] == "auto: model.lora.base_dtype fp8 keeps the float8 base whole"
    for m in straight.bases:  # plain float8 tensors, whole on the rank (no DTensor shard of them)
        assert type(m.weight.data) is torch.Tensor and m.weight.dtype == FP8_DTYPE
    loaded = Gemma4ForCausalLM.from_pretrained(base).state_dict()  # the base is the pretrained one, quantised
    q = straight.weights["model.base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"].float()
    s = straight.weights["model.base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight_scale"]
    w = loaded["model.layers.0.self_attn.q_proj.weight"]
    assert (q * s[:, None] - w).abs().max() <= w.abs().max() / 16
    fit(tmp_path / "cut", N)
    cut = tmp_path / "cut" / "ckpt" / f"epoch=0-step={N}.ckpt"
    assert cut.is_dir() == dcp
    resumed, trainer, _ = fit(tmp_path / "cut", 2 * N, ckpt_path=cut)
    assert trainer.global_step == 2 * N
    _assert_same(resumed, straight)
    result = export(cut, tmp_path / "hf", merge_lora=True)  # a DCP folder or a file: the float8 base dequantised
    assert len(result.dequantized) == 6 and result.merged == result.dequantized


def test_fsdp2_that_shards_the_base_is_refused_naming_the_option(one_process, tmp_path):
    strategy = FSDP2Strategy(param_dtype="fp32", reduce_dtype="fp32", replicate_frozen=False)
    with pytest.raises(ConfigError, match=r"^`model\.lora\.base_dtype='fp8'`: .*replicate_frozen=false"):
        _fit(tmp_path, 1, strategy=strategy)
