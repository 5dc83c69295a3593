"""Every shipped YAML fits 2 steps on CPU through the installed `lightning-ffpa` console script, with tiny
overrides, in a folder of its own: exit code 0, the closing line, and an honest screen. Two CPU ranks fit the
same way (the SFT and GRPO recipes).

`TINY` holds each recipe's overrides in one place: a recipe that changes its options changes its row here.
The shipped recipes, the two-rank fits and the folder-on-sys.path check run fresh processes; the other single
commands fork from one preloader (`_console.Preloaded`: the installed script, its imports done once).
"""

from __future__ import annotations

import re
import shlex

import pytest
from _console import ROOT, Preloaded, env, run, snapshot

from lightning_ffpa.validation import available_host_bytes

CPU = "--trainer.accelerator cpu --trainer.devices 1 --trainer.num_nodes 1"
FSDP2_CPU = ("--trainer.strategy.init_args.param_dtype fp32 --trainer.strategy.init_args.compile false "
             "--trainer.precision 32-true")
ROLLOUT_CPU = ("--trainer.callbacks.init_args.num_generations 2 "
               "--trainer.callbacks.init_args.sampling '{max_new_tokens: 4}' "
               "--trainer.callbacks.init_args.engine '{page_size: 8, num_pages: 32, max_batch_size: 8, "
               "max_seq_len: 16, max_prefill_tokens: 64, cuda_graphs: false, compile_decode: false, "
               "attention: dense}' --trainer.callbacks.init_args.inference_dtype float32")

# recipe -> the overrides that make it a 2-step CPU fit (each recipe also gets --trainer.max_steps 2)
TINY: dict[str, str] = {
    "tiny": "--data.init_args.batch_size 2 --data.init_args.max_seq_length 32 --trainer.limit_val_batches 0",
    "tiny_fsdp2": "--data.init_args.batch_size 2 --data.init_args.seq_length 32",
    "tiny_grpo": "",
    "gemma4_ffpa": (f"{CPU} {FSDP2_CPU} --model.init_args.preset tiny --model.init_args.max_seq_length 32 "
                    "--data.init_args.vocab_size 512 --data.init_args.seq_length 32 --data.init_args.batch_size 2 "
                    "--data.init_args.num_samples 8"),
    "gemma4_26b_a4b": (f"{CPU} {FSDP2_CPU} --model.init_args.preset tiny-moe --model.init_args.dtype float32 "
                       "--model.init_args.max_seq_length 32 --data.init_args.vocab_size 512 "
                       "--data.init_args.seq_length 32 --data.init_args.batch_size 2 --data.init_args.num_samples 8"),
    "gemma4_26b_a4b_full": (f"{CPU} {FSDP2_CPU} --model.init_args.preset tiny-moe --model.init_args.max_seq_length 32 "
                            "--data.init_args.vocab_size 512 --data.init_args.seq_length 32 "
                            "--data.init_args.batch_size 2 --data.init_args.num_samples 8"),
    # compile off: 26 s of CPU inductor per fit, covered by tests/parallel/test_compile.py
    "gemma4_grpo": (f"{CPU} --trainer.strategy.init_args.compile false --trainer.precision 32-true --model.init_args.preset tiny --model.init_args.dtype float32 "
                    "--model.init_args.config_overrides '{num_hidden_layers: 2}' --model.init_args.learning_rate 1e-3 "
                    f"{ROLLOUT_CPU} --data.init_args.prompt_len 4 --data.init_args.vocab_size 512 "
                    "--data.init_args.batch_size 2 --data.init_args.num_random_prompts 8"),
}
SHIPPED = sorted(p.stem for p in (ROOT / "configs").glob("*.yaml"))


@pytest.fixture(scope="module")
def console(tmp_path_factory):
    """Runs a console command as `run` does, in a child forked from one preloader for the file."""
    preloader = Preloaded(tmp_path_factory.mktemp("preloader"))
    yield preloader
    preloader.close()


def test_every_shipped_recipe_has_tiny_overrides():
    assert sorted(TINY) == SHIPPED


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("recipe", SHIPPED)
def test_shipped_recipe_fits_two_steps_through_the_console_script(recipe, tmp_path):
    """By recipe name, from a folder outside the repository; the run's files land in that folder."""
    proc = run(["lightning-ffpa", "fit", "--config", recipe, "--trainer.max_steps", "2",
                *shlex.split(TINY[recipe])], tmp_path, timeout=540)
    assert proc.returncode == 0, proc.stderr[-4000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("fit finished at step 2"), proc.stdout[-2000:]
    screen = proc.stdout + proc.stderr
    assert "FLOPs" not in screen  # the summary shows no count it did not make
    assert "/-2" not in screen  # no bogus epoch total
    assert "-0.000" not in screen  # a small loss (GRPO's) in scientific notation
    assert "litlogger" not in screen and "LeafSpec" not in screen  # Lightning's tip and its pytree deprecation
    # how the expert adapters run is said once, by the trained model's build (not by the meta models of checks)
    assert screen.count("run their adapters unmerged") == (recipe == "gemma4_26b_a4b"), screen[-3000:]
    if "--trainer.enable_progress_bar false" not in TINY[recipe]:
        assert re.search(r"Epoch 0, step\b.*\b2/2\b", screen), screen[-2000:]  # steps done of max_steps
    if "grpo" in recipe:  # the rollout start-up line says what runs: attention, KV blocks, decode step, projections
        assert re.search(r"RolloutCallback: completions end at token ids [^;]+; [\w.]+ engine weights (shared|merged)\b.*; attention \w+ over \d+-token KV blocks in \d+-token "
                         r"pages, decode step \w+ \(K/V write \w+\), projections (fused \(\d+ groups\)|separate)", screen), screen[-3000:]
    for kind in ("checkpoint", "logs"):  # the closing line names where the run's files are; they exist
        named = re.search(rf"\b{kind} ([^;]+)", last)
        if named:
            assert (tmp_path / named.group(1)).exists(), last
    if recipe == "tiny":  # and the export console script turns that checkpoint into an HF folder, exit 0
        ckpt = re.search(r"\bcheckpoint ([^;]+)", last).group(1)
        exported = run(["lightning-ffpa-export", ckpt, "hf"], tmp_path, timeout=240)
        assert exported.returncode == 0, exported.stderr[-3000:]
        assert exported.stdout.strip().splitlines()[-1].startswith("wrote "), exported.stdout
        assert (tmp_path / "hf" / "config.json").is_file()


FSDP2_RANKS = """trainer:
  devices: 2
  strategy:
    class_path: lightning_ffpa.parallel.FSDP2Strategy
    init_args: {param_dtype: null, reduce_dtype: null, activation_checkpointing: selective}
"""


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("recipe, extra", [("tiny", f"--trainer.devices 2 {TINY['tiny']}"),
                                           ("tiny_grpo", "--config fsdp2_ranks.yaml "
                                                         "--model.init_args.lora '{r: 4, target_modules: [q_proj]}'")])
def test_two_ranks_exit_0_with_one_closing_line(recipe, extra, tmp_path):
    """Two CPU ranks (DDP; FSDP2 + LoRA for GRPO), as `srun` or `devices: N` start them: every rank takes part in
    finding the log folder for the closing line (rank 0 alone used to wait on a rank that had exited: exit 1)."""
    (tmp_path / "fsdp2_ranks.yaml").write_text(FSDP2_RANKS)
    proc = run(["lightning-ffpa", "fit", "--config", recipe, "--trainer.max_steps", "2", *shlex.split(extra)],
               tmp_path, timeout=540)
    assert proc.returncode == 0, proc.stderr[-4000:]
    closing = [line for line in proc.stdout.splitlines() if line.startswith("fit finished")]
    assert len(closing) == 1 and closing[0].startswith("fit finished at step 2"), proc.stdout[-2000:]
    logs = re.search(r"\blogs ([^;]+)", closing[0])
    assert logs and (tmp_path / logs.group(1)).is_dir(), closing


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_one_process_fsdp2_fit_needs_no_port(tmp_path):
    """A one-process FSDP2 fit meets nobody, so it binds no TCP port: MASTER_PORT pointing at a port another
    program holds (as on a node shared with other jobs) does not stop it (Lightning's own path: EADDRINUSE)."""
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        busy = env() | {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(held.getsockname()[1])}
        proc = run(["lightning-ffpa", "fit", "--config", "tiny_fsdp2", "--trainer.max_steps", "2",
                    *shlex.split(TINY["tiny_fsdp2"])], tmp_path, timeout=240, env=busy)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.strip().splitlines()[-1].startswith("fit finished at step 2"), proc.stdout[-2000:]


def test_a_fit_ending_between_two_saves_saves_its_last_step(console, tmp_path):
    """max_steps 10 with a save every 4 steps: Lightning kept step 8 as `last` (the closing line said "step 8: the
    steps after it are not saved"); `FinalCheckpoint` saves step 10, and `last` links to it.
    (At the CPU size of `TINY`: the step count is what matters here, not the steps' size.)"""
    config = tmp_path / "c.yaml"
    config.write_text((ROOT / "configs" / "tiny.yaml").read_text().replace("every_n_train_steps: 100",
                                                                          "every_n_train_steps: 4"))
    out = console.run(f"lightning-ffpa fit --config {config} --trainer.max_steps 10 {TINY['tiny']} "
              f"--trainer.default_root_dir {tmp_path / 'run'}", tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    line = out.stdout.strip().splitlines()[-1]
    assert line.startswith("fit finished at step 10; checkpoint ") and "not saved" not in line, line
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    assert last.resolve().name.endswith("step=10.ckpt"), sorted(p.name for p in last.parent.iterdir())


def test_a_resume_that_could_not_honour_its_options_is_refused_by_name(console, tmp_path):
    """`--ckpt_path last` with what the resume would not do, each one `error:` line, exit 2, no file touched:
    data with another row count (here a longer max_seq_length: the rest of a mid-epoch checkpoint's epoch cannot be
    found; it trained on a shifted order), a new learning rate (the loaded optimizer keeps the saved one; it exited 0
    with the new value in the run's hparams), a `max_steps` the checkpoint has reached (exit 0, nothing trained)."""
    config = tmp_path / "c.yaml"
    config.write_text((ROOT / "configs" / "tiny.yaml").read_text().replace("every_n_train_steps: 100",
                                                                          "every_n_train_steps: 2"))
    small = f"--config {config} --data.init_args.batch_size 2 --trainer.limit_val_batches 0 " \
            f"--trainer.default_root_dir {tmp_path / 'run'}"
    first = console.run(f"lightning-ffpa fit {small} --data.init_args.max_seq_length 32 --trainer.max_steps 2", tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    before = snapshot(tmp_path)
    for extra, line in [
        ("--data.init_args.max_seq_length 64 --trainer.max_steps 4", "error: `data`: the training set has "),
        ("--data.init_args.max_seq_length 32 --trainer.max_steps 4 --model.init_args.learning_rate 0.5",
         "error: `model.learning_rate=0.5`: differs from `ckpt_path`, which has 0.003: the resumed optimizer keeps"),
        ("--data.init_args.max_seq_length 32 --trainer.max_steps 2",
         "error: `trainer.max_steps=2`: `ckpt_path='last'` is at step 2 already, so the fit would train nothing"),
    ]:
        refused = console.run(f"lightning-ffpa fit {small} {extra} --ckpt_path last", tmp_path)
        assert refused.returncode == 2, refused.stderr[-2000:]
        assert refused.stderr.strip().splitlines() == [refused.stderr.strip()], refused.stderr[-2000:]
        assert refused.stderr.startswith(line), refused.stderr
    assert snapshot(tmp_path) == before


def test_validate_reports_its_loss_and_refuses_empty_validation_data(console, tmp_path):
    """`validate` on the tiny recipe says it evaluates the random init (no `--ckpt_path`), prints val/loss and exits
    0; with no validation rows it exits 2 with one `error:` line naming the options (a validation of nothing exited 0
    with no metric)."""
    tiny = "--data.init_args.batch_size 2 --data.init_args.max_seq_length 32 --trainer.limit_val_batches 2"
    ok = console.run(f"lightning-ffpa validate --config tiny {tiny}", tmp_path)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert "val/loss" in ok.stdout, ok.stdout[-2000:]
    assert ok.stdout.startswith("validate: no --ckpt_path, so the model is evaluated as built: random init"), ok.stdout
    empty = console.run(f"lightning-ffpa validate --config tiny {tiny} --data.init_args.val_fraction 0", tmp_path)
    assert empty.returncode == 2, empty.stderr[-2000:]
    errors = [line for line in empty.stderr.splitlines() if line.startswith("error:")]
    assert errors == [errors[-1]] and "val_fraction" in errors[0] and empty.stderr.strip().endswith(errors[0])


def test_validate_last_evaluates_the_runs_checkpoint(console, tmp_path):
    """`validate --ckpt_path last` finds `<default_root_dir>/checkpoints/last.ckpt` as `fit` does (it used to warn,
    evaluate the untrained model and exit 0): the trained loss, well under the untrained ln(512)."""
    tiny = (f"--data.init_args.batch_size 2 --data.init_args.max_seq_length 32 --trainer.limit_val_batches 2 "
            f"--trainer.default_root_dir {tmp_path / 'run'}")
    fit = console.run(f"lightning-ffpa fit --config tiny {tiny} --trainer.max_steps 30", tmp_path)
    assert fit.returncode == 0, fit.stderr[-2000:]
    last = console.run(f"lightning-ffpa validate --config tiny {tiny} --ckpt_path last", tmp_path)
    assert last.returncode == 0, last.stderr[-2000:]
    loss = float(re.search(r"val/loss\W+([0-9.]+)", last.stdout).group(1))
    assert loss < 5.5, last.stdout[-2000:]  # untrained: ln(512) = 6.24


@pytest.mark.timeout(400)
def test_tiny_fits_over_an_fp8_lora_base_says_its_path_and_exports_merged(console, tmp_path):
    """`model.lora.base_dtype: fp8` through the console script: the start-up line names what was stored and the
    matmul path (CPU: dequantize), the fit ends, and the export dequantises the base, merges and says so."""
    lora = "{r: 4, lora_alpha: 8, target_modules: all-linear, base_dtype: fp8}"
    proc = console.run(["lightning-ffpa", "fit", "--config", "tiny", "--trainer.max_steps", "2", *shlex.split(TINY["tiny"]),
                "--model.init_args.lora", lora], tmp_path, timeout=360)
    assert proc.returncode == 0, proc.stderr[-4000:]
    screen = proc.stdout + proc.stderr
    started = re.search(r"lora\.base_dtype fp8: (\d+) LoRA base weights stored as float8_e4m3fn with rowwise fp32 "
                        r"scales .*; matmul path: dequantize \(cpu: ", screen)
    assert started, screen[-3000:]
    assert "lora.base_dtype fp8: a base matmul ran on the dequantize path" in screen  # the path that ran, said once
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("fit finished at step 2"), proc.stdout[-2000:]
    ckpt = re.search(r"\bcheckpoint ([^;]+)", last).group(1)
    exported = console.run(["lightning-ffpa-export", ckpt, "hf", "--merge_lora"], tmp_path, timeout=240)
    assert exported.returncode == 0, exported.stderr[-3000:]
    n = started.group(1)
    assert (f"dequantised {n} float8 base weights (model.lora.base_dtype fp8) to float32; merged LoRA into {n} "
            "weights") in exported.stdout, exported.stdout
    assert "matmul path" not in exported.stdout + exported.stderr  # the fit's start-up line, printed twice before


def test_a_reward_function_in_the_folder_it_runs_from_is_found(tmp_path):
    """docs/rollout.md's `reward_funcs: [my_rewards.score]`, from the folder holding `my_rewards.py` and no
    PYTHONPATH for it: exit 2 `No module named 'my_rewards'` before (a console script's sys.path lacks the
    folder it runs from); now the fit runs and calls it."""
    (tmp_path / "my_rewards.py").write_text(
        "def score(prompts, completions, completion_ids, **kwargs):\n"
        "    with open('called.txt', 'a') as f:\n"
        "        f.write(f'{len(completion_ids)}\\n')\n"
        "    return [float(len(ids)) for ids in completion_ids]\n")
    proc = run("lightning-ffpa fit --config tiny_grpo --trainer.max_steps 1 --trainer.default_root_dir run "
               "--trainer.callbacks.init_args.reward_funcs '[my_rewards.score]'", tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "called.txt").read_text().split() == ["16"], "once, on 2 prompts x 8 completions"


def test_a_strategy_named_by_its_class_alone_is_built(console, tmp_path):
    """`--trainer.strategy FSDP2Strategy` with no init args: jsonargparse kept it as the Trainer's `str` choice and
    Lightning refused `'fsdp2strategy'` as no registered name; it is now the class with its defaults, as
    `{class_path: ...}` is (the model is fully sharded: `FSDPGemma4ForCausalLM`). Other spellings:
    tests/test_cli_checks.py."""
    proc = console.run(f"lightning-ffpa fit --config tiny --trainer.max_steps 1 {TINY['tiny']} --trainer.default_root_dir run "
               "--trainer.strategy FSDP2Strategy", tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "FSDPGemma4ForCausalLM" in proc.stderr, proc.stderr[-3000:]  # the model summary
    saved = (tmp_path / "run" / "lightning_logs" / "version_0" / "config.yaml").read_text()
    assert "class_path: lightning_ffpa.parallel" in saved and "FSDP2Strategy" in saved


@pytest.mark.skipif((available_host_bytes() or 0) > 50 * 2**30, reason="this machine holds the weights")
def test_the_gpu_recipe_on_the_cpu_is_refused_through_the_console_script(console, tmp_path):
    """The GPU recipes' hint on a CPU machine named `--trainer.accelerator cpu`: the 31B model was then built until
    the kernel killed it (exit 137, nothing printed); the weights' size is checked first."""
    proc = console.run("lightning-ffpa fit --config gemma4_grpo --trainer.accelerator cpu --trainer.devices 1 "
               "--trainer.precision 32-true", tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.startswith("error: `model.preset='gemma4-31b'`: builds 30.7B parameters: ") and \
        proc.stderr.count("\n") == 1, proc.stderr[-3000:]
    assert list(tmp_path.iterdir()) == []


def test_last_with_nothing_saved_says_it_starts_from_step_0_and_the_same_command_resumes(console, tmp_path):
    """`--ckpt_path last` in a job script that runs again (resume-or-start): the first run said only Lightning's
    hint to set `save_last=True` (on in the recipe) and trained from step 0; it now says so in one line naming the
    folder it looked in (a mistyped one shows there), and the same command with more steps resumes."""
    tiny = f"{TINY['tiny']} --trainer.default_root_dir {tmp_path / 'run'} --ckpt_path last"
    first = console.run(f"lightning-ffpa fit --config tiny --trainer.max_steps 2 {tiny}", tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    notice = (f"`ckpt_path='last'`: no checkpoint in {tmp_path / 'run' / 'checkpoints'} yet, so this fit starts from "
              "step 0 (the same command resumes once one is saved)")
    assert notice in first.stdout.splitlines(), first.stdout[-2000:]
    assert "save_last=True" not in first.stderr, first.stderr[-2000:]
    again = console.run(f"lightning-ffpa fit --config tiny --trainer.max_steps 4 {tiny}", tmp_path)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "starts from step 0" not in again.stdout
    assert again.stdout.strip().splitlines()[-1].startswith("fit finished at step 4"), again.stdout[-2000:]
