"""Gemma4LM end to end under FSDP2Strategy: pretrained weights reach the shards, and cp=2 trains like cp=1."""

from pathlib import Path

import pytest
import torch
from transformers import Gemma4ForCausalLM

from lightning_ffpa.data import MockDataModule
from lightning_ffpa.presets import build_text_config

from ._launch import torchrun_json

_SCRIPT = Path(__file__).with_name("_fit_gemma4lm.py")


def _run(tmp_path, nproc, cp, pretrained, port):
    return torchrun_json(_SCRIPT, tmp_path / f"cp{cp}.json", nproc, port, cp, pretrained)


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_pretrained_fsdp2_cp2_matches_cp1(tmp_path):
    torch.manual_seed(0)
    ref = Gemma4ForCausalLM(build_text_config("tiny"))
    ref.save_pretrained(tmp_path / "tiny")
    # The first step's loss is computed before any update: it must be the checkpoint's own loss.
    data = MockDataModule(vocab_size=512, seq_length=32, num_samples=8, batch_size=2, seed=5)
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    ref.config._attn_implementation = "eager"
    want = ref(input_ids=batch["input_ids"], labels=batch["labels"]).loss.item()

    one = _run(tmp_path, 1, 1, tmp_path / "tiny", 29611)
    two = _run(tmp_path, 2, 2, tmp_path / "tiny", 29622)
    assert two["cp"] == 2 and len(one["losses"]) == 3
    assert one["losses"][0] == pytest.approx(want, abs=1e-4)
    for a, b in zip(one["losses"], two["losses"]):
        assert a == pytest.approx(b, abs=2e-4)
