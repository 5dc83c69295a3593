"""`model.save_frozen_weights: false`: a LoRA run's checkpoints hold the adapters and their optimizer state, not
the frozen base; a resume rebuilds the base as the fit built it, checks its digest, and goes on exactly as the
uninterrupted run (the real module, Trainer and strategies on CPU, in-process: a plain single-device fit and
a one-process FSDP2Strategy fit, DCP folder and single file). Another base is refused naming `ckpt_path`.
"""

from __future__ import annotations

import shutil

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from transformers import Gemma4ForCausalLM

from lightning_ffpa.checkpoint.frozen import FROZEN_BASE_KEY, fingerprint, frozen_names
from lightning_ffpa.data import MockDataModule
from lightning_ffpa.errors import ConfigError
from lightning_ffpa.module import Gemma4LM
from lightning_ffpa.parallel import FSDP2Strategy
from lightning_ffpa.presets import build_text_config

LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "o_proj", "down_proj"]}
N = 2  # steps before the stop; the resume and the straight run go to 2N


class Snapshot(L.Callback):
    """At the end of fit: every weight (whole) and the optimizer's moments, by parameter name."""

    def on_train_end(self, trainer, pl_module):
        def whole(t):
            return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().cpu().clone()

        params = dict(pl_module.named_parameters())
        self.weights = {n: whole(p) for n, p in params.items()}
        state = trainer.optimizers[0].state
        self.moments = {f"{n}.{k}": whole(v) for n, p in params.items() if p in state
                        for k, v in state[p].items() if torch.is_tensor(v)}


def _module(**kw) -> Gemma4LM:
    kw.setdefault("preset", "tiny")
    kw.setdefault("save_frozen_weights", False)
    return Gemma4LM(dtype="float32", lora=LORA, config_overrides={"num_hidden_layers": 2},
                    learning_rate=1e-2, warmup_steps=0, min_lr_ratio=1.0, **kw)  # a constant rate: N and 2N agree


def _fit(root, steps, *, seed=0, ckpt_path=None, strategy="auto", devices=1, accelerator="cpu",
         **module_kw) -> tuple[Snapshot, L.Trainer]:
    L.seed_everything(seed)  # what the CLI's seed_everything does before the model is built
    snap = Snapshot()
    trainer = L.Trainer(accelerator=accelerator, devices=devices, strategy=strategy, max_steps=steps, logger=False,
                        callbacks=[snap, ModelCheckpoint(dirpath=root / "ckpt", save_last=True)],
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        default_root_dir=root)
    data = MockDataModule(vocab_size=512, seq_length=32, num_samples=16, batch_size=2, seed=5)
    trainer.fit(_module(**module_kw), data, ckpt_path=None if ckpt_path is None else str(ckpt_path))
    return snap, trainer


def _assert_same(got: Snapshot, want: Snapshot) -> None:
    assert got.weights.keys() == want.weights.keys() and got.moments.keys() == want.moments.keys()
    assert got.moments, "no optimizer state compared"
    for name in want.weights:
        torch.testing.assert_close(got.weights[name], want.weights[name], rtol=0, atol=0, msg=name)
    for name in want.moments:
        torch.testing.assert_close(got.moments[name], want.moments[name], rtol=0, atol=0, msg=name)


def test_a_full_fine_tune_is_refused_naming_the_option():
    with pytest.raises(ConfigError, match=r"^`model\.save_frozen_weights=False`: .*without `model\.lora`"):
        Gemma4LM(preset="tiny", dtype="float32", save_frozen_weights=False)


def test_the_digest_is_the_whole_tensors_and_sees_another_base():
    torch.manual_seed(0)
    a = Gemma4ForCausalLM(build_text_config("tiny", num_hidden_layers=1))
    for p in a.parameters():
        p.requires_grad_(False)
    digest = fingerprint(a)
    assert set(digest) == frozen_names(a) and "lm_head.weight" in digest  # the tie's both names
    with torch.no_grad():
        a.model.norm.weight[0] += 1e-3
    changed = fingerprint(a)
    assert [n for n in digest if digest[n] != changed[n]] == ["model.norm.weight"]


def test_plain_resume_equals_the_straight_run_and_the_file_holds_no_base(tmp_path):
    straight, _ = _fit(tmp_path / "straight", 2 * N)
    _fit(tmp_path / "cut", N)
    cut = tmp_path / "cut" / "ckpt" / "last.ckpt"
    saved = torch.load(cut, map_location="cpu", weights_only=True)
    module = _module()
    module.configure_model()
    frozen = frozen_names(module)
    assert frozen and not frozen & saved["state_dict"].keys()  # no frozen tensor in the file
    assert set(saved[FROZEN_BASE_KEY]["tensors"]) == frozen and saved[FROZEN_BASE_KEY]["seed"] == 0
    assert saved["state_dict"].keys() == module.state_dict().keys() - frozen  # adapters and buffers
    # the same run's checkpoint with the base is larger by the base's bytes (tied tensors are stored once)
    _fit(tmp_path / "full", 1, save_frozen_weights=True)
    full_bytes, cut_bytes = (tmp_path / "full" / "ckpt" / "last.ckpt").stat().st_size, cut.stat().st_size
    base_bytes = sum(p.numel() * p.element_size() for p in module.parameters() if not p.requires_grad)
    assert base_bytes <= full_bytes - cut_bytes < 1.01 * base_bytes and cut_bytes * 5 < full_bytes
    # its export (the base rebuilt, digest-checked) is tests/hardening/test_export_adapter_only.py's

    resumed, trainer = _fit(tmp_path / "cut", 2 * N, ckpt_path=cut)
    assert trainer.global_step == 2 * N
    _assert_same(resumed, straight)


def test_plain_resume_over_another_base_is_refused_before_training(tmp_path):
    _fit(tmp_path, N)
    with pytest.raises(ConfigError) as err:
        _fit(tmp_path, 2 * N, seed=1, ckpt_path=tmp_path / "ckpt" / "last.ckpt")  # another seed: another base
    message = str(err.value)
    assert message.startswith("`ckpt_path=") and "`model.save_frozen_weights=false`" in message
    assert "frozen weights differ" in message and "\n" not in message
    assert "(the fit ran under `seed_everything=0`, this run under 1)" in message


def _drop_a_trained_weight(path, part: str) -> str:
    """Delete the first `part` (an adapter's name part) tensor from the single-file checkpoint at `path`; its key."""
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    lost = next(k for k in ckpt["state_dict"] if part in k)
    del ckpt["state_dict"][lost]
    torch.save(ckpt, path)
    return lost


def test_a_missing_trained_weight_is_still_an_error(tmp_path):
    _fit(tmp_path, N)
    path = tmp_path / "ckpt" / "last.ckpt"
    lost = _drop_a_trained_weight(path, "lora_A")
    with pytest.raises(RuntimeError, match=f"Missing key.*{lost}"):
        _fit(tmp_path, 2 * N, ckpt_path=path)


# ---- FSDP2Strategy (one process, gloo) ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    """Two tiny pretrained folders with different weights."""
    out = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        path = tmp_path_factory.mktemp("base") / "tiny"
        Gemma4ForCausalLM(build_text_config("tiny", num_hidden_layers=2)).save_pretrained(path)
        out.append(path)
    return out


def _fsdp2(dcp: bool, replicate) -> FSDP2Strategy:
    return FSDP2Strategy(param_dtype="fp32", reduce_dtype="fp32", activation_checkpointing="none",
                         replicate_frozen=replicate, save_distributed_checkpoint=dcp)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("dcp, replicate", [(True, False), (False, "auto")], ids=["dcp-sharded-base", "file-whole-base"])
def test_fsdp2_resume_equals_the_straight_run_and_another_base_is_refused(one_process, bases, tmp_path, dcp,
                                                                          replicate):
    base = tmp_path / "base"  # one `model.pretrained` path; its weights are replaced below (a moved hub revision)

    def fit(root, steps, ckpt_path=None):
        out = _fit(root, steps, ckpt_path=ckpt_path, strategy=_fsdp2(dcp, replicate), pretrained=str(base))
        dist.destroy_process_group()
        return out

    def use(source):
        shutil.rmtree(base, ignore_errors=True)
        shutil.copytree(source, base)

    use(bases[0])
    straight, _ = fit(tmp_path / "straight", 2 * N)
    fit(tmp_path / "cut", N)
    cut = tmp_path / "cut" / "ckpt" / f"epoch=0-step={N}.ckpt"
    assert cut.is_dir() == dcp
    if dcp:  # the folder's tensors: no frozen one
        from lightning_ffpa._compat.torch import read_dcp_metadata

        keys = [k.removeprefix("state_dict.") for k in read_dcp_metadata(str(cut)).state_dict_metadata
                if k.startswith("state_dict.")]
    else:
        keys = list(torch.load(cut, map_location="cpu", weights_only=True)["state_dict"])
    assert keys and all(".lora_" in k or k.endswith(".layer_scalar") for k in keys), keys  # adapters and buffers

    use(bases[1])
    with pytest.raises(ConfigError, match=r"^`ckpt_path=.*`model\.save_frozen_weights=false`.*frozen weights differ"):
        fit(tmp_path / "other", 2 * N, ckpt_path=cut)
    use(bases[0])
    resumed, trainer = fit(tmp_path / "cut", 2 * N, ckpt_path=cut)
    assert trainer.global_step == 2 * N
    _assert_same(resumed, straight)


@pytest.mark.timeout(300)
def test_fsdp2_single_file_missing_a_trained_weight_is_still_an_error(one_process, bases, tmp_path):
    def fit(steps, ckpt_path=None):
        try:
            return _fit(tmp_path, steps, ckpt_path=ckpt_path, strategy=_fsdp2(False, False), pretrained=str(bases[0]))
        finally:
            dist.destroy_process_group()

    fit(N)
    path = tmp_path / "ckpt" / "last.ckpt"
    lost = _drop_a_trained_weight(path, "lora_B")
    with pytest.raises(KeyError, match=f"{lost}.*missing besides the frozen weights"):
        fit(2 * N, ckpt_path=path)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_fsdp2_two_ranks_resume_over_a_sharded_base_and_its_digest_is_the_whole_bases(bases, tmp_path):
    """2 gloo ranks, each holding half of every frozen tensor: the saved digest is the one a single process
    computes over the whole base, and the resume ends where the straight run does."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "parallel"))
    from _launch import torchrun_json

    got = torchrun_json(Path(__file__).with_name("_fit_frozen_ranks.py"), tmp_path / "out.json", 2, 29823,
                        bases[0], timeout=380)
    assert got["shards"] == ["__0_0.distcp", "__1_0.distcp"]
    assert got["equal"], got["differ"]
    module = _module(pretrained=str(bases[0]))
    module.configure_model()
    assert got["record"]["tensors"] == fingerprint(module)


def test_a_strategy_that_loads_checkpoints_itself_is_refused_naming_the_option():
    from lightning.pytorch.strategies import ModelParallelStrategy

    module = _module()
    module.trainer = L.Trainer(accelerator="cpu", devices=1, strategy=ModelParallelStrategy(), logger=False)
    with pytest.raises(ConfigError, match=r"^`model\.save_frozen_weights=False`: is not supported with "
                                          r"ModelParallelStrategy"):
        module.configure_model()
    assert module.model is None


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_fsdp2_on_one_gpu_the_digest_is_the_cpu_one_and_the_dcp_resume_runs(bases, tmp_path):
    """NCCL, CUDA shards: the saved digest equals a CPU process's over the same base; the DCP resume reaches 2N
    over the same base and is refused over another (one process: Lightning starts and ends the NCCL group)."""
    def fit(root, steps, base, ckpt_path=None):
        try:
            return _fit(root, steps, ckpt_path=ckpt_path, strategy=_fsdp2(True, False), accelerator="gpu",
                        pretrained=str(base))
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()

    fit(tmp_path, N, bases[0])
    cut = tmp_path / "ckpt" / f"epoch=0-step={N}.ckpt"
    module = _module(pretrained=str(bases[0]))
    module.configure_model()
    from lightning_ffpa.checkpoint.frozen import read_frozen_record

    assert read_frozen_record(cut)["tensors"] == fingerprint(module)
    with pytest.raises(ConfigError, match=r"frozen weights differ"):
        fit(tmp_path / "other", 2 * N, bases[1], ckpt_path=cut)
    _, trainer = fit(tmp_path, 2 * N, bases[0], ckpt_path=cut)
    assert trainer.global_step == 2 * N
