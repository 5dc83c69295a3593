"""`console_entry` and the folding of jsonargparse's nested errors into one line, in-process."""

from __future__ import annotations

import errno
import json
import os
import socket
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from lightning_ffpa import cli
from lightning_ffpa.checkpoint.lock import LOCK_NAME
from lightning_ffpa.errors import (
    DEBUG_ENV,
    ConfigError,
    InputError,
    TrainingDiverged,
    console_entry,
    describe_parse_error,
)

ROOT = Path(__file__).resolve().parents[2]


def _raises(exc):
    def body(argv):
        raise exc
    return body


def test_config_error_is_one_line_and_exit_2(capfd):
    assert console_entry(_raises(ConfigError("model.lora.r", 0, "must be >= 1")), argv=[]) == 2
    out, err = capfd.readouterr()
    assert out == "" and err == "error: `model.lora.r=0`: must be >= 1\n"


def test_output_before_a_user_error_is_dropped_and_kept_on_success(capfd):
    def noisy(fail):
        def body(argv):
            print("warning from a library", file=sys.stderr, flush=True)
            os.write(2, b"C-level line\n")
            if fail:
                raise FileNotFoundError("`data.train_file='x'` does not exist")
            return 0
        return body

    assert console_entry(noisy(True), argv=[]) == 2
    assert capfd.readouterr().err == "error: `data.train_file='x'` does not exist\n"
    assert console_entry(noisy(False), argv=[]) == 0
    assert capfd.readouterr().err == "warning from a library\nC-level line\n"


def test_bugs_keep_their_traceback_and_their_output(capfd):
    def body(argv):
        print("context", file=sys.stderr, flush=True)
        raise KeyError("a bug")

    with pytest.raises(KeyError):
        console_entry(body, argv=[])
    assert "context" in capfd.readouterr().err


def test_debug_flag_and_env_show_the_traceback(monkeypatch, capfd):
    monkeypatch.setenv(DEBUG_ENV, "0")  # restored (unset) after the test, though --debug sets it
    seen = []
    body = _raises(ConfigError("a", 1, "b"))
    assert console_entry(lambda argv: (seen.append(argv), body(argv)), argv=["x", "--debug"]) == 2
    assert seen == [["x"]] and os.environ[DEBUG_ENV] == "1"  # child processes inherit it
    err = capfd.readouterr().err
    assert "Traceback (most recent call last)" in err and err.endswith("error: `a=1`: b\n")
    assert console_entry(_raises(InputError("bad")), argv=[]) == 2  # the env var alone
    assert "Traceback" in capfd.readouterr().err


def test_disk_full_is_a_user_error(capfd):
    err = OSError(errno.ENOSPC, "No space left on device", "/ckpt/last.ckpt")
    assert console_entry(_raises(err), argv=[]) == 2
    assert capfd.readouterr().err == "error: no space left on device: /ckpt/last.ckpt\n"


def test_a_diverged_run_is_one_line_and_exit_3(capfd):
    def body(argv):
        print("progress bar", file=sys.stderr, flush=True)
        raise TrainingDiverged("non-finite loss nan at step 3 (epoch 0); stopped by NonFiniteGuard(action='stop') "
                               "before the update. Last good checkpoint: none written yet")

    assert console_entry(body, argv=[]) == 3
    lines = capfd.readouterr().err.splitlines()
    assert lines[-1].startswith("error: non-finite loss nan at step 3") and "Traceback" not in "".join(lines)


def test_body_int_is_the_exit_code():
    assert console_entry(lambda argv: 0, argv=[]) == 0
    assert console_entry(lambda argv: None, argv=[]) == 0


EXIT_PROBE = """
import atexit, gc, os, sys
atexit.register(lambda: print("last", gc.get_freeze_count(), len(gc.get_objects())))  # runs after exit_quickly's
heap = [[] for _ in range(200_000)]  # 200k tracked objects, as a command's imports leave (torch: ~440k)
def body(argv):
    atexit.register(lambda: print("command's handler", gc.get_freeze_count()))  # e.g. logging's, a logger's
    return {}
if sys.argv[1] == "console_entry":
    from lightning_ffpa.errors import console_entry
    console_entry(lambda argv: body(argv) and 0, argv=[])
else:  # a benchmark row's process
    from benchmarks.row_process import row_main
    row_main(["--row", "{}", "--row-out", os.devnull], body)
"""


@pytest.mark.parametrize("entry", ["console_entry", "row_main"])
def test_a_console_script_or_benchmark_row_exit_skips_the_exit_time_walks_of_the_heap(entry):
    """After the command's own exit handlers, the objects alive are frozen out of the cyclic GC, so the
    interpreter's exit-time collections do not walk them (~1.3 s of every CPU fit's exit)."""
    import subprocess

    out = subprocess.run([sys.executable, "-c", EXIT_PROBE, entry], capture_output=True, text=True, timeout=60,
                         env=os.environ | {"PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    handler, last = out.stdout.splitlines()
    assert handler == "command's handler 0"  # the command's handlers ran first, on the unfrozen heap
    frozen, walked = map(int, last.split()[1:])
    assert frozen > 200_000 and walked < 1_000, last


@pytest.mark.parametrize("args, line", [
    (["--trainer.max_steps", "abc"], "`trainer.max_steps='abc'`: expected int"),
    (["--model.init_args.loss_impl", "fast"], "`model.init_args.loss_impl='fast'`: expected one of 'plain', "),
    (["--model.init_args.nope", "1"], "`model.init_args.nope='1'`: is not an argument of Gemma4LM"),
    (["--model.class_path", "no.such.Module"], "`model.class_path='no.such.Module'`: No module named 'no'"),
    (["--trainer.precision", "17"], "`trainer.precision='17'`: expected one of 64, 32, 16, 'transformer-engine'"),
    (["--trainer.callbacks+=no.such.Callback"], "`trainer.callbacks.class_path='no.such.Callback'`"),
    # a ~700-character line of Namespace dumps
    (["--trainer.logger+=CSVLogger", "--trainer.logger+=TensorBoardLogger"],
     "`trainer.logger`: `save_dir` is required by CSVLogger"),
])
def test_parse_errors_fold_to_the_option_value_and_reason(args, line):
    with pytest.raises(ConfigError) as info:
        cli.build(["fit", "--config", "tiny", *args])
    assert str(info.value).startswith(line) and "\n" not in str(info.value)
    assert "Namespace(" not in str(info.value) and "Union" not in str(info.value)


def test_a_misspelled_key_of_a_config_file_is_named_without_a_made_up_value(tmp_path):
    text = (ROOT / "configs" / "tiny.yaml").read_text().replace("    learning_rate:", "    learning_rat:")
    (tmp_path / "t.yaml").write_text(text)
    with pytest.raises(ConfigError) as info:
        cli.build(["fit", "--config", str(tmp_path / "t.yaml")])
    assert str(info.value) == "`model.init_args.learning_rat`: is not an argument of Gemma4LM"


def test_constructor_errors_arrive_unwrapped():
    with pytest.raises(ConfigError) as info:  # the module's own error, not jsonargparse's wrapper
        cli.build(["--config", "tiny", "--model.init_args.attn_implementation", "flash9"], run=False)
    assert str(info.value).startswith("`model.attn_implementation='flash9'`: is unknown")


def test_describe_keeps_a_config_error_raised_inside():
    inner = ConfigError("model.lora.r", 0, "must be >= 1")
    outer = ValueError("Does not validate against any of the Union subtypes\nErrors:\n  - x")
    outer.__cause__ = inner
    assert describe_parse_error(outer) is inner


def test_trainer_ranges_lightning_does_not_check():
    with pytest.raises(ConfigError, match="trainer.accumulate_grad_batches=0"):
        cli.check_trainer_options({"accumulate_grad_batches": 0})
    with pytest.raises(ConfigError, match="trainer.val_check_interval=0"):
        cli.check_trainer_options({"val_check_interval": 0})
    cli.check_trainer_options({"accumulate_grad_batches": 1, "val_check_interval": 0.5, "gradient_clip_val": None,
                               "num_sanity_val_steps": -1})
    # Lightning's refusal did not say the tiny recipe's `check_val_every_n_epoch: null` is why
    with pytest.raises(ConfigError, match=r"trainer.val_check_interval=0.5`: .*which the config sets to null"):
        cli.check_trainer_options({"val_check_interval": 0.5, "check_val_every_n_epoch": None})
    cli.check_trainer_options({"val_check_interval": 100, "check_val_every_n_epoch": None})


SLURM_8_TASKS = dict(SLURM_JOB_ID="1", SLURM_JOB_NAME="x", SLURM_NTASKS="8", SLURM_NTASKS_PER_NODE="8",
                     SLURM_NODELIST="localhost", SLURM_JOB_NUM_NODES="1", SLURM_PROCID="0", SLURM_LOCALID="0",
                     SLURM_NODEID="0")


def test_a_slurm_task_count_that_differs_from_devices_names_trainer_devices(monkeypatch):
    from lightning.fabric.plugins.environments import SLURMEnvironment

    for key, value in SLURM_8_TASKS.items():
        monkeypatch.setenv(key, value)
    launcher = SimpleNamespace(cluster_environment=SLURMEnvironment(), num_processes=4, num_nodes=1)
    trainer = SimpleNamespace(strategy=SimpleNamespace(launcher=launcher))
    with pytest.raises(ConfigError, match=r"^`trainer.devices`: You set `devices=4` .* HINT: Set `devices=8`"):
        cli.check_cluster_layout(trainer)
    launcher.num_processes = 8
    cli.check_cluster_layout(trainer)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_gpu_recipe_on_a_cpu_machine_names_trainer_accelerator():
    with pytest.raises(ConfigError, match=r"^`trainer.accelerator='gpu'`: no CUDA device found .*accelerator cpu"):
        cli.build(["--config", "tiny", "--trainer.accelerator", "gpu"], run=False)


def test_a_locked_run_directory_is_refused_before_the_logger_writes(tmp_path):
    (tmp_path / LOCK_NAME).write_text(json.dumps({"pid": os.getppid(), "host": socket.gethostname()}))  # alive
    before = sorted(tmp_path.rglob("*"))
    with pytest.raises(ConfigError, match=r"^`trainer.default_root_dir=.*`: another fit \(pid \d+ on this host\)"):
        cli.build(["fit", "--config", "tiny", "--trainer.default_root_dir", str(tmp_path), "--trainer.max_steps", "1"])
    assert sorted(tmp_path.rglob("*")) == before  # no lightning_logs/version_N in the locked run


@pytest.mark.parametrize("accelerator, reason", [
    ("tpu", r"`XLAAccelerator` can not run on this machine \(.*torch_xla.*\); available here: cpu"),
    ("hpu", r"not an accelerator Lightning knows \(one of auto, cpu, cuda, mps, tpu\)"),
])
def test_an_accelerator_this_machine_cannot_run_names_trainer_accelerator(accelerator, reason):
    from lightning.fabric.accelerators.xla import XLAAccelerator

    if torch.cuda.is_available() or XLAAccelerator.is_available():
        pytest.skip("needs a machine with only a CPU")
    with pytest.raises(ConfigError, match=rf"^`trainer.accelerator='{accelerator}'`: {reason}$"):
        cli.build(["--config", "tiny", "--trainer.accelerator", accelerator], run=False)


@pytest.mark.parametrize("where", ["command line", "config file"])
def test_a_reward_function_in_the_old_colon_form_names_reward_funcs_and_the_dotted_form(where, tmp_path):
    old, new = "lightning_ffpa.rl.rewards:token_range_reward", "lightning_ffpa.rl.rewards.token_range_reward"
    args = ["--config", "tiny_grpo", "--trainer.callbacks.init_args.reward_funcs", f"[{old}]"]
    if where == "config file":
        (tmp_path / "g.yaml").write_text((ROOT / "configs" / "tiny_grpo.yaml").read_text().replace(new, old))
        args = ["--config", str(tmp_path / "g.yaml")]
    with pytest.raises(ConfigError) as info:
        cli.build(args, run=False)
    assert str(info.value) == (f"`trainer.callbacks.init_args.reward_funcs`: `{old}` is the old `module:function` "
                               "form: write a dotted import path `package.module.function`")


def test_the_export_script_imports_its_libraries_with_stderr_held(capfd, monkeypatch):
    """`lightning-ffpa-export` imported transformers before holding stderr, so torchao's load messages (printed
    where it is installed) came before a bad input's one line. A library printing at import is simulated here."""
    import tomllib

    scripts = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["lightning-ffpa-export"] == "lightning_ffpa.cli:export_main"
    monkeypatch.delitem(sys.modules, "lightning_ffpa.export", raising=False)
    monkeypatch.setattr(sys, "meta_path", [_NoisyImport("lightning_ffpa.export"), *sys.meta_path])
    assert cli.export_main(["no_such.ckpt", "out"]) == 2
    assert capfd.readouterr().err == "error: `ckpt='no_such.ckpt'` does not exist\n"


class _NoisyImport:
    """A meta-path finder that writes to stderr when `name` is imported, then lets the real import go on."""

    def __init__(self, name: str):
        self.name = name

    def find_spec(self, fullname, path, target=None):
        if fullname == self.name:
            os.write(2, b"Failed to load some_library.so\n")
        return None


def test_a_message_whose_first_line_opens_a_bracket_is_kept_whole():
    """peft's `Target module Gemma4ClippableLinear(` + the module's repr + why: cut to its first line, the
    reason (`is not supported ...`) was lost."""
    from lightning_ffpa.errors import one_line

    err = ValueError("Target module Gemma4ClippableLinear(\n  (linear): Linear(in=4)\n) is not supported.")
    assert one_line(err) == "Target module Gemma4ClippableLinear( (linear): Linear(in=4) ) is not supported."
    assert one_line(ValueError("first line\nsecond")) == "first line"


@pytest.mark.parametrize("logger, package", [("WandbLogger", "wandb"), ("MLFlowLogger", "mlflow")])
def test_a_logger_whose_package_is_missing_names_trainer_logger_and_the_pip_hint(logger, package):
    """It was a ~100-line traceback (exit 1) with Lightning's "Requirement ... not met" buried in it."""
    import importlib.util

    if importlib.util.find_spec(package) is not None:
        pytest.skip(f"{package} is installed")
    with pytest.raises(ConfigError) as info:
        cli.build(["--config", "tiny", "--trainer.logger", logger], run=False)
    assert str(info.value).startswith(f"`trainer.logger='lightning.pytorch.loggers.{logger}'`: needs a package that "
                                      f"is not installed: Requirement '{package}")
    assert "pip install" in str(info.value)


def test_a_key_of_a_config_before_the_subcommand_is_named_as_not_accepted_there(tmp_path):
    """A top-level config keyed by subcommand with another key too: it said "is not an argument of this class"."""
    (tmp_path / "mixed.yaml").write_text("fit:\n  trainer:\n    max_steps: 2\nmodel:\n  init_args:\n    preset: tiny\n")
    with pytest.raises(ConfigError) as info:
        cli.build(["--config", str(tmp_path / "mixed.yaml"), "fit", "--config", "tiny"])
    assert str(info.value).startswith("`model.init_args.preset`: is not accepted before the subcommand: give it "
                                      "after `fit`")
