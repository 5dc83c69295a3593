"""The one flex kernel-option table: training's forward tile and the rollout prefill tile are the same entry."""

import pytest
import torch

from lightning_ffpa.flex_options import flex_kernel_options


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_training_forward_equals_rollout_prefill_at_large_head_dims(dtype):
    for head_dim in (320, 512):
        train = flex_kernel_options(head_dim, "train", dtype)
        assert train["BACKEND"] == "TRITON"
        fwd = {k.removeprefix("fwd_"): v for k, v in train.items() if k.startswith("fwd_")}
        assert fwd == flex_kernel_options(head_dim, "prefill", dtype)
        assert train["fwd_num_stages"] == train["bwd_num_stages"] == 1  # the shared-memory limit at D > 256


def test_small_head_dims_keep_torch_defaults_except_tuned_decode_and_the_training_backend():
    assert [flex_kernel_options(d, "prefill") for d in (128, 256)] == [None] * 2
    # training never takes AUTO's decode kernel for short queries (no valid config on an H200)
    assert [flex_kernel_options(d, "train", t) for d in (32, 256) for t in (torch.bfloat16, torch.float32)] == [
        {"BACKEND": "TRITON"}] * 4
    assert flex_kernel_options(256, "decode")["BLOCK_N"] == 64  # swept, not needed to fit
    assert flex_kernel_options(256, "decode", torch.float32) is None
    assert flex_kernel_options(512, "decode", torch.float32) == {"num_stages": 1, "BLOCK_N": 16}
    with pytest.raises(ValueError, match="phase='backward'"):
        flex_kernel_options(512, "backward")
