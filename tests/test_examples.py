"""The examples run: drop-in Callback (tiny Gemma4, CPU), GRPO with a custom reward, the SLURM launch line."""

from __future__ import annotations

import importlib.util
import re
import shlex
import sys
from pathlib import Path

import pytest
import torch
from lightning.fabric.plugins.environments import SLURMEnvironment

from lightning_ffpa.cli import FFPACLI, build

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
SBATCH = EXAMPLES / "slurm" / "gemma4_ffpa.sbatch"


def _load(name: str):
    """Import an example file as module `name` (so import-path strings like `name:func` resolve)."""
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(120)
def test_drop_in_callback_routes_full_layers_to_ffpa(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    report = _load("drop_in_callback").main(["--max-steps", "2", "--seq-len", "32"])
    # tiny preset: 2 full (head_dim 512) + 2 sliding layers; 2 steps -> 4 full-layer forwards on FFPA
    assert report["dispatch"]["ffpa-dense"] == 4, report
    assert report["kernels"]["reference"] == 4 and report["kernels"]["cutedsl"] == 0, report
    # sliding layers carry a BlockMask; on CPU with grad it runs through SDPA (counted, never silent)
    assert report["dispatch"]["sdpa"] == 4, report
    assert "ffpa-dense=4" in report["summary"]
    assert report["loss"] == report["loss"] and report["loss"] < 10


@pytest.mark.timeout(120)
def test_drop_in_callback_from_a_saved_checkpoint_draws_ids_in_its_vocabulary(tmp_path, monkeypatch):
    """`--pretrained DIR` of a model whose vocabulary is not the 31B's 262,144 (a tiny one saved here): the random
    ids came from 262,144 and the embedding raised IndexError; they now come from the checkpoint's config."""
    from transformers import Gemma4ForCausalLM

    from lightning_ffpa.presets import build_text_config

    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    Gemma4ForCausalLM(build_text_config("tiny")).save_pretrained(tmp_path / "tiny")
    report = _load("drop_in_callback").main(["--pretrained", str(tmp_path / "tiny"), "--max-steps", "2",
                                             "--seq-len", "32"])
    assert report["dispatch"]["ffpa-dense"] == 4 and report["loss"] < 10, report


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_drop_in_callback_runs_cutedsl_on_gpu(tmp_path, monkeypatch):
    """On an H100/H200 with ffpa-attn: the same example, bf16, full layers on the CuTeDSL kernel."""
    monkeypatch.chdir(tmp_path)
    report = _load("drop_in_callback").main(["--accelerator", "gpu", "--precision", "bf16-true", "--kernel", "auto",
                                              "--max-steps", "3", "--seq-len", "256"])
    assert report["kernels"]["cutedsl"] == report["dispatch"]["ffpa-dense"] == 6, report
    assert report["kernels"]["reference"] == 0 and report["dispatch"]["flex"] > 0, report
    assert report["loss"] == report["loss"]


@pytest.mark.timeout(120)
def test_drop_in_callback_with_the_fsdp2_strategy(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    report = _load("drop_in_callback").main(["--max-steps", "2", "--seq-len", "32", "--strategy", "fsdp2"])
    assert report["model_class"].startswith("FSDP"), report  # fully_shard swapped in its FSDP subclass
    # 2 steps x 2 full layers; the forward that selective checkpointing re-runs in backward is not counted again
    assert report["dispatch"]["ffpa-dense"] == 4 and report["kernels"]["reference"] == 4, report


@pytest.mark.timeout(120)
def test_grpo_example_custom_reward_and_lora_refresh(tmp_path, monkeypatch, capfd):
    monkeypatch.chdir(tmp_path)
    example = _load("grpo_tiny")
    calls = []
    reward = example.even_token_reward
    monkeypatch.setattr(example, "even_token_reward", lambda **kw: calls.append(kw) or reward(**kw))
    report = example.main(["--steps", "2", "--num-generations", "2", "--max-new-tokens", "3", "--lora-rank", "4"])
    assert len(calls) == 2 and all(len(c["completion_ids"]) == 2 * 2 for c in calls)  # 2 prompts x G=2
    assert all(len(ids) == 3 for c in calls for ids in c["completion_ids"])
    assert 0.0 <= report["reward"] <= 1.0
    assert set(report["drift"]) == {"base_sha256", "inference_sha256", "base_sha256_at_end"}
    assert report["drift"]["base_sha256_at_end"] == report["drift"]["base_sha256"]  # W0 unchanged over the fit
    screen = "".join(capfd.readouterr())
    assert "step" in screen and "/-2" not in screen and "-0.000" not in screen, screen[-2000:]  # the step bar


# ----------------------------------------------------------------------------------------- SLURM


def _srun_args() -> list[str]:
    """The arguments the sbatch file passes to `lightning-ffpa` (line continuations joined)."""
    text = SBATCH.read_text().replace("\\\n", " ")
    line = next(ln for ln in text.splitlines() if ln.strip().startswith("srun "))
    words = shlex.split(line)
    assert words[:2] == ["srun", "lightning-ffpa"], words
    return [w for w in words[2:] if w != "$@"]


def _slurm_env(monkeypatch, ntasks: int, nodes: int, procid: int, nodelist: str = "node[001-002]") -> None:
    per_node = ntasks // nodes
    env = {"SLURM_NTASKS": ntasks, "SLURM_NNODES": nodes, "SLURM_NTASKS_PER_NODE": per_node,
           "SLURM_PROCID": procid, "SLURM_LOCALID": procid % per_node, "SLURM_NODEID": procid // per_node,
           "SLURM_JOB_ID": 4242, "SLURM_JOB_NAME": "gemma4-ffpa", "SLURM_NODELIST": nodelist,
           "SLURM_JOB_NUM_NODES": nodes}
    for key, value in env.items():
        monkeypatch.setenv(key, str(value))
    for key in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK"):
        monkeypatch.delenv(key, raising=False)


def _expand(args: list[str], subcommand: bool = True) -> list[str]:
    """Substitute $SLURM_* the way bash would; drop `fit` for `run=False` (the config is a recipe name)."""
    import os

    out = [re.sub(r"\$(\w+)", lambda m: os.environ[m.group(1)], a) for a in args]
    return out if subcommand else [a for a in out if a != "fit"]


def _cli(args: list[str]) -> FFPACLI:
    """Instantiate (not run) the CLI from the sbatch arguments plus `args` (CPU so the Trainer builds here)."""
    return build([*_expand(_srun_args(), subcommand=False), "--trainer.accelerator=cpu", "--trainer.logger=false",
                  *args], run=False)


def test_sbatch_matches_lightning_slurm_rules():
    text = SBATCH.read_text()
    sb = dict(re.findall(r"^#SBATCH --([\w-]+)(?:=(\S+))?", text, re.M))
    assert sb["signal"] == "SIGUSR1@90" and "requeue" in sb
    assert int(sb["ntasks-per-node"]) == int(sb["gpus-per-node"])  # one task per GPU
    args = _srun_args()
    assert "--trainer.devices=$SLURM_NTASKS_PER_NODE" in args and "--trainer.num_nodes=$SLURM_NNODES" in args


def test_sbatch_submits_from_any_folder():
    """Nothing in the job depends on the folder sbatch runs in: the log goes into that folder itself (a
    `logs/` folder would have to exist before the job starts), the config is a packaged recipe name, and
    the script is valid bash."""
    import subprocess

    from lightning_ffpa import recipes

    text = SBATCH.read_text()
    sb = dict(re.findall(r"^#SBATCH --([\w-]+)(?:=(\S+))?", text, re.M))
    assert "/" not in sb["output"], sb["output"]
    config = _srun_args()[_srun_args().index("--config") + 1]
    assert recipes.find(config) is not None and "/" not in config, config
    assert "configs/" not in text.replace("\\\n", " ").split("srun ", 1)[1]
    assert subprocess.run(["bash", "-n", str(SBATCH)], capture_output=True, text=True).returncode == 0


def test_sbatch_marks_every_site_specific_line():
    """Partition, account, the environment, cores, memory and time limit differ per cluster: each is marked
    `SITE:` on the line above, partition and account off (`##SBATCH`) until the user turns them on."""
    lines = SBATCH.read_text().splitlines()
    marked = {i for i, line in enumerate(lines) if line.startswith("# SITE:")}
    assert len(marked) >= 4

    def marked_above(i: int) -> bool:  # a SITE comment above `i`, with only #SBATCH lines between
        while i > 0 and lines[i - 1].startswith(("#SBATCH", "##SBATCH")):
            i -= 1
        return i - 1 in marked

    for pattern in (r"^##SBATCH --partition=", r"^##SBATCH --account=", r"^source .*activate",
                    r"^#SBATCH --cpus-per-task=", r"^#SBATCH --mem=", r"^#SBATCH --time="):
        found = [i for i, line in enumerate(lines) if re.match(pattern, line)]
        assert len(found) == 1 and marked_above(found[0]), pattern


def test_sbatch_line_parses_for_16_ranks(monkeypatch):
    """2 nodes x 8 tasks, this process rank 11: Lightning picks SLURMEnvironment with SLURM's ranks (no launch)."""
    _slurm_env(monkeypatch, ntasks=16, nodes=2, procid=11)
    trainer = _cli([]).trainer
    env = trainer.strategy.cluster_environment
    assert isinstance(env, SLURMEnvironment) and env.auto_requeue
    assert (env.world_size(), env.global_rank(), env.local_rank(), env.node_rank()) == (16, 11, 3, 1)
    assert (trainer.num_nodes, trainer.num_devices, trainer.world_size, trainer.global_rank) == (2, 8, 16, 11)
    # requeue at a step boundary (the config's callback), exactly once
    assert sum(type(c).__name__ == "DeferredRequeue" for c in trainer.callbacks) == 1
    env.validate_settings(trainer.num_devices, trainer.num_nodes)  # the launcher's check passes


def test_sbatch_devices_must_match_ntasks_per_node(monkeypatch):
    _slurm_env(monkeypatch, ntasks=16, nodes=2, procid=0)
    trainer = _cli(["--trainer.devices=4"]).trainer
    with pytest.raises(ValueError, match="ntasks-per-node"):  # what the launcher checks before starting
        trainer.strategy.cluster_environment.validate_settings(trainer.num_devices, trainer.num_nodes)


@pytest.mark.timeout(120)
def test_cli_fits_under_slurm_with_one_task(tmp_path, monkeypatch, request):
    """The sbatch line's arguments, tiny config, world size 1: a real fit under SLURMEnvironment."""
    _slurm_env(monkeypatch, ntasks=1, nodes=1, procid=0, nodelist="localhost")
    monkeypatch.chdir(tmp_path)
    args = _expand(_srun_args())
    args[args.index("--config") + 1] = "tiny"  # the sbatch line, CPU-sized
    logger = {"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": str(tmp_path)}}
    request.addfinalizer(lambda: torch.distributed.is_initialized() and torch.distributed.destroy_process_group())
    cli = build([*args, f"--trainer.default_root_dir={tmp_path}", f"--trainer.logger={logger}",
                "--trainer.strategy=ddp",  # one process, but the multi-process path (process group from SLURM's variables)
                "--trainer.max_steps=2", "--trainer.limit_val_batches=0",
                "--trainer.enable_progress_bar=false", "--data.init_args.batch_size=2",
                "--data.init_args.max_seq_length=32"])
    trainer = cli.trainer
    env = trainer.strategy.cluster_environment
    assert isinstance(env, SLURMEnvironment) and env.main_address == "localhost"
    assert trainer.world_size == 1 and trainer.global_step == 2
