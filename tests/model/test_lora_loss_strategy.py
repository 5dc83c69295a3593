"""LoRA x loss x strategy: every loss_impl, with and without LoRA, with no strategy, FSDP2 and FSDP2 + CP=2,
fits through a real Trainer and matches the plain loss of the same setup.

The model is a saved tiny checkpoint, so every case starts from the same weights; LoRA's B starts at zero,
so before the first update a LoRA model computes the base model's loss. Hence (fp32, CPU):
- the first-step loss of every case equals the plain, full-fine-tune, no-strategy loss (FIRST_TOL);
- the second-step loss (after one AdamW step) equals the plain loss of the same strategy and LoRA choice
  (SECOND_TOL): the gradients through the chunked/liger path, the peft wrapper and the FSDP root hook agree.
FSDP2 cases run under torchrun with gloo (one launch per strategy runs all its cases).
"""

import importlib.util
from pathlib import Path

import pytest
import torch
from parallel._launch import torchrun_json  # tests/parallel (tests/ is on sys.path under pytest)

from lightning_ffpa.presets import build_text_config

from ._fit_matrix import STEPS, fit_losses

_SCRIPT = Path(__file__).with_name("_fit_matrix.py")
FIRST_TOL = 1e-5  # fp32: summation order only (chunking, CP reduction)
# fp32, after one AdamW step (Adam divides by |g|: near-zero gradients amplify rounding; chunked at CP=2 lands
# 1.25e-4 from plain, while both paths' gradients match the exact step's within 7e-5: tests/parallel/test_token_weights)
SECOND_TOL = 2e-4
LIGER = importlib.util.find_spec("liger_kernel") is not None
IMPLS = ["plain", "chunked", pytest.param("liger", marks=pytest.mark.skipif(
    not (LIGER and torch.cuda.is_available()), reason="liger-kernel not installed, or no CUDA for its Triton kernels"))]
STRATEGIES = {"none": (0, 1, 0), "fsdp2": (1, 1, 29731), "fsdp2_cp2": (2, 2, 29742)}  # cp, processes, port


def _cases(gpu: bool) -> str:
    impls = ["plain", "chunked"] + (["liger"] if LIGER and torch.cuda.is_available() else [])
    return ",".join(f"{impl}:{lora}" for impl in impls for lora in (0, 1))


@pytest.fixture(scope="module")
def matrix(pretrained, tmp_path_factory):
    """Runs each strategy's cases once, on first use: {strategy: {"impl:lora": (losses, n_trainable)}}."""
    cache: dict[str, dict] = {}

    def get(strategy: str, accelerator: str = "cpu", dtype: str = "float32") -> dict:
        key = f"{strategy}-{accelerator}-{dtype}"
        if key not in cache:
            cp, nproc, port = STRATEGIES[strategy]
            cases = _cases(accelerator == "gpu")
            if cp == 0:
                cache[key] = {c: fit_losses(str(pretrained), c.split(":")[0], c.endswith(":1"), 0, accelerator, dtype)
                              for c in cases.split(",")}
            else:
                out = tmp_path_factory.mktemp(key) / "out.json"
                port += 100 if accelerator == "gpu" else 0
                cache[key] = torchrun_json(_SCRIPT, out, nproc, port, pretrained, cp, accelerator, dtype, cases,
                                           timeout=400)
        return cache[key]

    return get


def _strategies(gpu: bool = False):
    cp2 = pytest.mark.slow if not gpu else pytest.mark.skipif(
        torch.cuda.device_count() < 2, reason="CP=2 needs 2 GPUs")
    return ["none", "fsdp2", pytest.param("fsdp2_cp2", marks=cp2)]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("strategy", _strategies())
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("loss_impl", IMPLS)
def test_fit_matches_the_plain_loss(loss_impl, lora, strategy, matrix):
    runs = matrix(strategy)
    losses, trainable, total, kernel_calls = runs[f"{loss_impl}:{int(lora)}"]
    plain = runs[f"plain:{int(lora)}"][0]
    reference = matrix("none")["plain:0"][0]
    print(f"{strategy} {loss_impl} lora={lora}: {losses} (plain {plain}, reference {reference})")
    assert len(losses) == STEPS and all(torch.isfinite(torch.tensor(losses)))
    assert kernel_calls.get("reference", 0) > 0  # the full-attention layers ran the FFPA op (CPU reference)
    assert losses[0] == pytest.approx(reference[0], abs=FIRST_TOL)
    assert losses[1] == pytest.approx(plain[1], abs=SECOND_TOL)
    if lora:  # only adapters train: A and B of each targeted Linear (5 per layer in the tiny model)
        n_layers = len(build_text_config("tiny").layer_types)
        assert trainable == 2 * 5 * n_layers - 2 * (n_layers // 2), (trainable, total)  # full layers: no v_proj
    else:
        assert trainable == total


@pytest.mark.gpu
@pytest.mark.timeout(900)
@pytest.mark.parametrize("strategy", _strategies(gpu=True))
def test_gpu_bf16_every_loss_and_lora_matches_plain(strategy, matrix):
    """bf16 on CUDA with the real FFPA kernels: each case's first-step loss is within the plain bf16 loss's own
    error against the fp32 reference (x3, at least 5e-3), and its second-step loss within 2e-2 of plain's."""
    runs = matrix(strategy, "gpu", "bfloat16")
    fp32 = matrix("none", "gpu", "float32")["plain:0"][0][0]
    for lora in (0, 1):
        plain = runs[f"plain:{lora}"][0]
        tol = max(3 * abs(plain[0] - fp32), 5e-3)
        for case, (losses, _, _, kernel_calls) in runs.items():
            if case.endswith(f":{lora}"):
                print(f"{strategy} {case}: {losses} (plain {plain}, fp32 ref {fp32:.6f}), kernels {kernel_calls}")
                assert kernel_calls.get("cutedsl", 0) > 0 and kernel_calls.get("reference", 0) == 0, kernel_calls
                assert abs(losses[0] - plain[0]) <= tol, (case, losses, plain, fp32)
                assert abs(losses[1] - plain[1]) <= 2e-2, (case, losses, plain)
