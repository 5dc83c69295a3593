"""MoE experts that would wait on the host inside a captured decode step are refused before the engine builds
anything, naming `cuda_graphs` (the CUDA rule is checked from the device alone; no GPU needed)."""

import pytest
import torch
from transformers import Gemma4ForCausalLM

from lightning_ffpa.errors import ConfigError
from lightning_ffpa.presets import build_text_config
from lightning_ffpa.rollout.capture import capture_blockers, check_capture
from lightning_ffpa.rollout.engine import EngineConfig, RolloutEngine

CUDA = torch.device("cuda")


@pytest.fixture(scope="module")
def moe():
    torch.manual_seed(0)
    return Gemma4ForCausalLM(build_text_config("tiny-moe")).eval()


def test_dense_model_has_nothing_to_refuse():
    model = Gemma4ForCausalLM(build_text_config("tiny")).eval()
    assert capture_blockers(model) == []
    check_capture(model, CUDA, cuda_graphs=True)


def test_grouped_mm_needs_bf16_weights_compiled_or_eager(moe):
    """Not bf16: a host loop compiled (transformers) and eager (torch's `_grouped_mm` fallback copies the offsets to
    the CPU; a float32 decode step with `compile_decode: false` failed mid-capture on an H100)."""
    assert moe.config._experts_implementation == "grouped_mm"  # transformers' default
    blockers = capture_blockers(moe)
    assert len(blockers) == 4 and "grouped_mm with torch.float32 weights falls back to a host loop" in blockers[0]
    with pytest.raises(ConfigError, match=r"`engine\.cuda_graphs=True`: .*torch\.float32 weights.*cuda_graphs: false"):
        check_capture(moe, CUDA, cuda_graphs=True)  # what the engine checks, `compile_decode` or not
    assert capture_blockers(moe.to(torch.bfloat16)) == []
    moe.float()


def test_eager_experts_are_refused_by_name_on_cuda_only(moe):
    moe.set_experts_implementation("eager")
    try:
        assert all("experts_implementation='eager'" in b for b in capture_blockers(moe))
        with pytest.raises(ConfigError, match=r"`rollout\.cuda_graphs=True`: the decode step cannot be captured: "
                                              r"model\.layers\.0\.experts: .*\(and 3 more\).*cuda_graphs: false"):
            check_capture(moe, CUDA, cuda_graphs=True, option="rollout")
        check_capture(moe, CUDA, cuda_graphs=False)  # no capture: nothing to refuse
        check_capture(moe, torch.device("cpu"), cuda_graphs=True)  # CPU runs eagerly
        eng = RolloutEngine(moe, EngineConfig(page_size=4, num_pages=16, max_batch_size=2, max_seq_len=32,
                                              attention="dense"))
        assert len(eng.generate([[3, 4, 5]], 4)[0].output) == 4  # the same model decodes on CPU
    finally:
        moe.set_experts_implementation("grouped_mm")
