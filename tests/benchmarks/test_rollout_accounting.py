"""The rollout benchmark's roofline bytes: KV needed per decode step against a dense count of the mask."""

import sys
from pathlib import Path

import torch
from transformers import Gemma4ForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # `benchmarks` is a folder of scripts
from benchmarks.rollout_rows import kv_bytes_per_step  # noqa: E402
from lightning_ffpa.attention.masks import generate_causal  # noqa: E402
from lightning_ffpa.presets import build_text_config  # noqa: E402
from lightning_ffpa.rollout.engine import EngineConfig, RolloutEngine  # noqa: E402


def test_kv_bytes_needed_and_read_per_step():
    torch.manual_seed(0)
    model = Gemma4ForCausalLM(build_text_config("tiny")).eval()  # window 16, sliding + full layers
    eng = RolloutEngine(model, EngineConfig(page_size=4, num_pages=32, max_batch_size=2, max_seq_len=64))
    plen, new = 10, 14
    need, read = kv_bytes_per_step(eng, plen, new)
    expect = 0
    for i, spec in enumerate(eng.walker.specs):
        mask_mod = generate_causal(window=spec.window)
        kv = torch.arange(64)
        for p in range(plen, plen + new - 1):
            expect += eng.cache.layer_bytes_per_token(i) * int(mask_mod(0, 0, torch.tensor(p), kv).sum())
    assert need == expect / (new - 1)
    # flex reads whole pages, and never fewer bytes than the step needs
    assert need < read <= need + sum(eng.cache.layer_bytes_per_token(i) for i in range(len(eng.walker.specs))) * 2 * 4
