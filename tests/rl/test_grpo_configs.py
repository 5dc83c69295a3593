"""Every shipped GRPO YAML parses and instantiates through the project CLI (`cli.build`, as the console
script builds it); bad reward paths fail early."""

from pathlib import Path

import pytest

from lightning_ffpa.callbacks.rollout import RolloutCallback
from lightning_ffpa.cli import build
from lightning_ffpa.rl.module import GRPOModule

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*grpo*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_grpo_config_instantiates(path):
    cli = build(["--config", str(path), "--trainer.logger=false", "--trainer.accelerator=cpu"], run=False)
    assert isinstance(cli.model, GRPOModule)  # built lazily in configure_model: parsing stays cheap
    assert any(isinstance(c, RolloutCallback) for c in cli.trainer.callbacks)


def test_bad_reward_path_names_the_option(tmp_path):
    """A dotted path that does not import fails while parsing, as one ConfigError naming the option and
    the path."""
    import yaml

    from lightning_ffpa.errors import ConfigError

    cfg = yaml.safe_load(next(p for p in CONFIGS if p.name == "tiny_grpo.yaml").read_text())
    cfg["trainer"]["callbacks"][-1]["init_args"]["reward_funcs"] = ["my.rewards.missing"]  # RolloutCallback: last
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    with pytest.raises(ConfigError) as err:
        build(["--config", str(path), "--trainer.logger=false"], run=False)
    assert err.value.option.endswith("reward_funcs") and "my.rewards.missing" in str(err.value.value)
