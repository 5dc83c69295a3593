"""`EngineConfig.compile_mode`: the decode step's torch.compile mode, refused where it could not apply."""

import pytest
from transformers import Gemma4ForCausalLM

from lightning_ffpa.errors import ConfigError
from lightning_ffpa.presets import build_text_config
from lightning_ffpa.rollout import engine as engine_mod
from lightning_ffpa.rollout.engine import EngineConfig, RolloutEngine

_SIZES = dict(page_size=8, num_pages=16, max_batch_size=2, max_seq_len=64, attention="dense")


@pytest.mark.parametrize("kwargs, why", [
    (dict(compile_mode="reduce-overhead"), "captures its own CUDA graphs"),
    (dict(compile_mode="max-autotune"), "captures its own CUDA graphs"),
    (dict(compile_mode="max-autotune-no-cudagraphs", compile_decode=False), "needs `RolloutCallback.engine.compile_decode`"),
])
def test_modes_that_cannot_apply_name_the_option(kwargs, why):
    with pytest.raises(ConfigError, match=r"^`RolloutCallback\.engine\.compile_mode=") as info:
        EngineConfig(**kwargs).check("RolloutCallback.engine")
    assert why in str(info.value)


def test_a_mode_on_an_eager_decode_step_is_refused_before_the_cache_is_allocated(monkeypatch):
    model = Gemma4ForCausalLM(build_text_config("tiny")).eval()
    monkeypatch.setattr(engine_mod, "PagedKVCache", lambda *a, **k: pytest.fail("cache allocated before the check"))
    with pytest.raises(ConfigError, match=r"^`engine\.compile_mode='max-autotune-no-cudagraphs'`: has no effect"):
        RolloutEngine(model, EngineConfig(**_SIZES, compile_mode="max-autotune-no-cudagraphs"))

