"""RolloutCallback.setup checks the longest prompt of a PromptDataModule against `engine.max_seq_len`."""

from types import SimpleNamespace

import pytest
import torch

from lightning_ffpa.callbacks.rollout import RolloutCallback, _longest_prompt
from lightning_ffpa.errors import ConfigError
from lightning_ffpa.rl.prompts import PromptDataModule
from lightning_ffpa.rl.rewards import token_range_reward
from lightning_ffpa.rollout.engine import EngineConfig
from lightning_ffpa.rollout.sampler import SamplingParams


def test_longest_prompt_reads_the_prompt_datamodule_rows():
    dm = PromptDataModule(num_random_prompts=4, prompt_len=5, batch_size=2)
    assert _longest_prompt(dm) is None  # before setup: no rows yet
    dm.setup("fit")
    assert _longest_prompt(dm) == 5


def test_setup_refuses_prompts_longer_than_the_engine_allows():
    dm = PromptDataModule(num_random_prompts=4, prompt_len=5, batch_size=2)
    dm.setup("fit")
    cb = RolloutCallback([token_range_reward], engine=EngineConfig(page_size=8, num_pages=8, max_seq_len=8),
                         sampling=SamplingParams(max_new_tokens=4), num_generations=2)
    trainer = SimpleNamespace(datamodule=dm, strategy=SimpleNamespace(root_device=torch.device("cpu")))
    with pytest.raises(ConfigError, match=r"engine\.max_seq_len=8.*5 \+ 4.*longest prompt of the datamodule"):
        cb.setup(trainer, object(), "fit")
