"""configs/tiny_fsdp2.yaml (FSDP2Strategy + FFPAAttention + TokenThroughput) parses and fits."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parents[2]
_CONFIG = _ROOT / "configs" / "tiny_fsdp2.yaml"


def test_yaml_parses_into_the_strategy_and_callbacks():
    import yaml
    from jsonargparse import ArgumentParser
    from lightning.pytorch.cli import LightningCLI  # noqa: F401  (registers the Trainer signature)
    from lightning.pytorch.strategies import Strategy

    cfg = yaml.safe_load(_CONFIG.read_text())
    parser = ArgumentParser()
    parser.add_subclass_arguments(Strategy, "strategy")
    parsed = parser.parse_object({"strategy": cfg["trainer"]["strategy"]})
    strategy = parser.instantiate_classes(parsed).strategy
    from lightning_ffpa.parallel import FSDP2Strategy

    assert isinstance(strategy, FSDP2Strategy)
    assert strategy.activation_checkpointing == "selective" and strategy.context_parallel_size == 1


def _cli(args, cwd):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(_ROOT), os.environ.get("PYTHONPATH")])), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "lightning_ffpa.cli", "fit", *args], env=env, capture_output=True,
                          text=True, timeout=200, cwd=cwd)
    assert proc.returncode == 0, proc.stderr[-4000:]  # Gemma4LM raises on a non-finite loss
    return proc.stdout + proc.stderr


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_yaml_fits_saves_a_sharded_checkpoint_and_resumes(tmp_path):
    """Meta-built Gemma4LM sharded by the strategy, FFPAAttention installed, DCP checkpoint, resume."""
    import yaml

    cfg = yaml.safe_load(_CONFIG.read_text())
    cfg["trainer"].update(max_steps=2, enable_checkpointing=True)
    cfg["trainer"]["callbacks"].append({"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                                        "init_args": {"dirpath": str(tmp_path / "ckpt"), "save_last": True}})
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    out = _cli(["--config", str(path)], tmp_path)
    # fp32 on CPU: the backend routes full layers to its visible sdpa fallback; what matters here is
    # that the callback installed "ffpa" and reports the counted paths.
    assert "FFPAAttention (attn_implementation=ffpa):" in out
    assert "no attention calls counted" not in out
    from torch.distributed.checkpoint import FileSystemReader

    keys = FileSystemReader(str(tmp_path / "ckpt" / "last.ckpt")).read_metadata().state_dict_metadata
    weights = [k for k in keys if k.startswith("state_dict.")]
    assert "state_dict.model.model.layers.0.self_attn.q_proj.weight" in weights  # HF names: no AC/compile prefixes
    assert not [k for k in weights if "_checkpoint_wrapped_module" in k or "_orig_mod" in k]
    out = _cli(["--config", str(path), "--trainer.max_steps=3", "--ckpt_path", str(tmp_path / "ckpt" / "last.ckpt")],
               tmp_path)
    assert "Restored all states" in out and "max_steps=3` reached" in out
