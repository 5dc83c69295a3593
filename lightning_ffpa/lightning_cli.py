"""The LightningCLI behind `lightning-ffpa` fit/validate/test/predict: `FFPACLI`, `build` and `command`.

Owns the Lightning side of the command's contract (`lightning_ffpa.cli` owns the console script and the
help-only commands, which do not import Lightning): a bad input is found before any model is built or file
is written and raised as the project's one-line error; `build` gives the same CLI in-process (tests,
notebooks). What runs is the LightningModule, DataModule, strategy and callbacks named in the config
(`class_path` for each), so any Lightning class can be plugged in from YAML. `--config NAME` may name a
packaged recipe (`lightning_ffpa.recipes`). Does not own the checks themselves: each component validates its
own options, `lightning_ffpa.validation` the ones that span components.
"""
from __future__ import annotations

import importlib
import re
import sys
import warnings
from argparse import ArgumentError
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lightning as L
from jsonargparse import Namespace
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lightning_ffpa import recipes
from lightning_ffpa._compat import lightning as lightning_compat
from lightning_ffpa.cli_checks import (
    check_config_before_subcommand,
    check_flow_values,
    check_folder_writable,
    check_negative_values,
    check_no_optimizer_options,
    check_precision_runs_here,
    check_seed,
    is_number,
)
from lightning_ffpa.environment import check_environment, check_world_matches_launcher
from lightning_ffpa.errors import (
    EXIT_INTERRUPTED,
    EXIT_TERMINATED,
    NOT_GIVEN,
    ConfigError,
    InputError,
    causes,
    describe_constructor_error,
    describe_parse_error,
    one_line,
    release_stderr,
)
from lightning_ffpa.parallel import close_process_group
from lightning_ffpa.validation import (
    MODULE_CLASS_KEY,
    PreflightCLIMixin,
    check_checkpoint,
    check_data_fits_model,
    check_evaluated_checkpoint,
    check_hparams_match,
    check_strategy_loads,
    check_tokenizer_matches,
)
from lightning_ffpa.yaml_files import refuse_duplicate_keys

# Trainer options Lightning accepts but fails on mid-run (e.g. accumulate_grad_batches=0 divides by zero at
# the first step): the smallest value that works.
TRAINER_MINIMUMS: dict[str, float] = {
    "accumulate_grad_batches": 1,
    "min_steps": 0,
    "log_every_n_steps": 1,
    "check_val_every_n_epoch": 1,
    "num_sanity_val_steps": -1,
    "gradient_clip_val": 0,
}


def import_components() -> None:
    """Import the project's components (see the comment)."""
    # Importing registers the classes as LightningModule/DataModule/Callback subclasses, so short names work too
    # (`--model.help GRPOModule`, `--trainer.callbacks.help RolloutCallback`) with or without a config.
    import lightning_ffpa.callbacks  # noqa: F401
    import lightning_ffpa.callbacks.rollout  # noqa: F401
    import lightning_ffpa.data  # noqa: F401
    import lightning_ffpa.module  # noqa: F401
    import lightning_ffpa.rl.module  # noqa: F401


def check_trainer_options(options: dict[str, Any]) -> None:
    """Range checks for `trainer.*` numbers Lightning does not check itself (ConfigError naming the option)."""
    for key, low in TRAINER_MINIMUMS.items():
        value = options.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value < low:
            raise ConfigError(f"trainer.{key}", value, f"must be >= {low}")
    if options.get("max_steps") == 0:
        raise ConfigError("trainer.max_steps", 0, "trains nothing: give the number of optimizer steps (or -1 to let "
                          "trainer.max_epochs decide)")
    if is_number(options.get("limit_train_batches")) == 0:
        raise ConfigError("trainer.limit_train_batches", options["limit_train_batches"],
                          "trains nothing: give a number of batches or a fraction of the epoch > 0")
    if options.get("max_epochs") == -1 and options.get("max_steps") in (-1, None):
        raise ConfigError("trainer.max_epochs", -1, "with `trainer.max_steps=-1` the run never ends, and the "
                          "learning-rate schedule needs a horizon: set trainer.max_steps (or a max_epochs >= 1)")
    interval = options.get("val_check_interval")
    if isinstance(interval, (int, float)) and not isinstance(interval, bool) and interval <= 0:
        raise ConfigError("trainer.val_check_interval", interval,
                          "must be > 0 (a fraction of the epoch in (0, 1], or a number of batches)")
    if isinstance(interval, float) and options.get("check_val_every_n_epoch", 1) is None:
        # Lightning's refusal does not say where the null comes from: the tiny recipes set it (steps across epochs)
        raise ConfigError("trainer.val_check_interval", interval, "a fraction of the epoch needs "
                          "`trainer.check_val_every_n_epoch`, which the config sets to null (as the tiny recipes do, to "
                          "count batches across epochs): give a number of batches, or also pass "
                          "`--trainer.check_val_every_n_epoch 1`")


def check_fit_has_a_logger(options: dict[str, Any]) -> None:
    """`trainer.logger: false` with a callback Lightning refuses to train without a logger: refused by name here,
    where Lightning refuses it only once the model is built and the run's config.yaml is written."""
    from lightning.pytorch.callbacks import DeviceStatsMonitor, LearningRateMonitor

    if options.get("logger") is not False:
        return
    callbacks = options.get("callbacks")
    entries = callbacks if isinstance(callbacks, (list, tuple)) else [callbacks] if callbacks else []
    classes = [_config_class(entry) for entry in entries]
    needs = [c.__name__ for c in classes if c is not None and issubclass(c, (LearningRateMonitor, DeviceStatsMonitor))]
    if needs:
        raise ConfigError("trainer.logger", False, f"`trainer.callbacks` has {needs[0]}, which writes to the logger: "
                          "keep a logger, or leave the callback out of a copy of the recipe (`lightning-ffpa cp`)")


def strategy_class_path(value: Any) -> str | None:
    """The import path of the Strategy class `trainer.strategy` names as a plain string (`FSDP2Strategy`,
    `lightning_ffpa.parallel.FSDP2Strategy`), or None for anything else (`ddp`, `auto`: Lightning's names)."""
    from lightning.pytorch import strategies

    from lightning_ffpa import parallel

    if not isinstance(value, str) or not value.isidentifier() and "." not in value:
        return None
    if "." in value:
        module, _, name = value.rpartition(".")
        try:
            cls = getattr(importlib.import_module(module), name, None)
        except ImportError:
            return None
    else:
        cls = getattr(parallel, value, None) or getattr(strategies, value, None)
    if not (isinstance(cls, type) and issubclass(cls, strategies.Strategy)):
        return None
    return f"{cls.__module__}.{cls.__qualname__}" if "." not in value else value


# Trainer options that only steer the validation loop, which a GRPO run does not have (its prompts have no targets)
_VALIDATION_OPTIONS = ("val_check_interval", "limit_val_batches", "num_sanity_val_steps")


def _config_class(component: Any) -> type | None:
    """The class a config entry's `class_path` names (the model, the strategy), or None."""
    path = getattr(component, "class_path", None)
    module, _, name = path.rpartition(".") if isinstance(path, str) else ("", "", "")
    cls = getattr(importlib.import_module(module), name, None) if module else None
    return cls if isinstance(cls, type) else None


def check_validation_options(model: Any, options: dict[str, Any]) -> None:
    """A GRPO model with a validation option set: Lightning would skip the loop without a word (ConfigError)."""
    from lightning_ffpa.rl.module import GRPOModule

    cls = _config_class(model)
    if cls is None or not issubclass(cls, GRPOModule):
        return
    for key in _VALIDATION_OPTIONS:
        if options.get(key) is not None:
            raise ConfigError(f"trainer.{key}", options[key], "a GRPO run has no validation loop, so this would do "
                              "nothing: remove it (the mean reward is logged each step as rollout/reward)")


def check_strategy_options(strategy: Any) -> None:
    """Build an FSDP2Strategy once from its `init_args`, so its constructor's ValueError (naming the option)
    is what the user reads: instantiated through the Trainer's `str | Strategy` type, it becomes "expected str"."""
    from lightning_ffpa.parallel import FSDP2Strategy

    cls = _config_class(strategy)
    if cls is not None and issubclass(cls, FSDP2Strategy):
        try:
            init_args = strategy.get("init_args")
            cls(**(dict(vars(init_args)) if init_args is not None else {}))
        except ValueError as err:
            raise InputError(f"trainer.strategy: {err}") from None


# Lightning's words for an accelerator this machine lacks; "gpu" gets its own hint (a GPU recipe on CPU).
_NO_ACCELERATOR = ("No supported gpu backend found", "can not run on your system since the accelerator is not available")
_UNKNOWN_ACCELERATOR = re.compile(r"You selected an invalid accelerator name: .*Available names are: (.*?)\.?$")


def _unrunnable(accelerator: Any) -> type | None:
    """The accelerator class Lightning registers under the name `accelerator` if this machine cannot run it."""
    from lightning.pytorch.accelerators import AcceleratorRegistry

    if not isinstance(accelerator, str) or accelerator not in AcceleratorRegistry:
        return None
    cls = AcceleratorRegistry[accelerator]["accelerator"]
    return None if cls.is_available() else cls


def _runnable() -> str:
    from lightning.pytorch.accelerators import AcceleratorRegistry

    names = AcceleratorRegistry.available_accelerators()
    return ", ".join(sorted(n for n in names if AcceleratorRegistry[n]["accelerator"].is_available()))


def accelerator_error(accelerator: Any, err: BaseException) -> ConfigError | None:
    """Lightning's error for an accelerator it does not know or this machine cannot run, as a ConfigError naming
    `trainer.accelerator` (else None)."""
    text = one_line(err)
    if m := _UNKNOWN_ACCELERATOR.search(text):
        names = ", ".join(sorted(n.strip() for n in m.group(1).split(",")))
        return ConfigError("trainer.accelerator", accelerator, f"not an accelerator Lightning knows (one of {names})")
    if isinstance(err, ModuleNotFoundError):  # `tpu` without torch_xla: Lightning's constructor raises it bare
        if (cls := _unrunnable(accelerator)) is None:
            return None
        return ConfigError("trainer.accelerator", accelerator,
                           f"`{cls.__name__}` can not run on this machine ({text}); available here: {_runnable()}")
    if not any(words in text for words in _NO_ACCELERATOR):
        return None
    if "No supported gpu backend found" in text:
        text = (f"no CUDA device found (Lightning: {text}); on a CPU machine run a tiny recipe (`--config tiny`), "
                "or `--trainer.accelerator cpu` for a model this machine's memory holds")
    return ConfigError("trainer.accelerator", accelerator, text)


def check_cluster_layout(trainer: L.Trainer) -> None:
    """The cluster's task layout (SLURM, torchrun) vs `trainer.devices` / `trainer.num_nodes`, the check
    Lightning's subprocess launcher makes at launch, made before the run starts: there it is a traceback."""
    launcher = getattr(trainer.strategy, "launcher", None)
    env = getattr(launcher, "cluster_environment", None)  # launchers that check the layout carry it
    if env is not None:
        devices, nodes = launcher.num_processes, launcher.num_nodes
    else:  # no launcher where the cluster starts the processes (FSDP2Strategy under srun or torchrun): nothing checks
        env = getattr(trainer.strategy, "cluster_environment", None)
        if env is None and SLURMEnvironment.detect():  # one device, N srun tasks: N fits of their own into one folder
            env = SLURMEnvironment()
        if env is None or not env.creates_processes_externally:
            return
        devices, nodes = trainer.num_devices, trainer.num_nodes
    try:
        env.validate_settings(num_devices=devices, num_nodes=nodes)
    except ValueError as err:
        option = "trainer.num_nodes" if "num_nodes" in str(err) else "trainer.devices"
        raise ConfigError(option, NOT_GIVEN, one_line(err)) from None


def check_run_dir_free(trainer: L.Trainer) -> None:
    """Refuse a fit into a run directory (or checkpoint folder) that is a file, read-only, or held by another fit
    (RunLock's own check) before the logger writes its version folder there; RunLock takes the lock only in
    `setup`, after that folder exists."""
    from lightning_ffpa.checkpoint import RunLock
    from lightning_ffpa.checkpoint.lock import locked_folders

    for option, folder in locked_folders(trainer):
        check_folder_writable(folder, option)
    for callback in trainer.callbacks:
        if isinstance(callback, RunLock):
            for option, folder in locked_folders(trainer):
                callback.check_free(folder, option)


@contextmanager
def _as_user_errors() -> Iterator[None]:
    """Re-raise a parse or constructor error as the user's mistake it wraps (one line); bugs pass unchanged."""
    try:
        yield
    except Exception as err:
        found = describe_parse_error(err) if isinstance(err, ArgumentError) else describe_constructor_error(err)
        if found is None or found is err:
            raise
        if any(found is e for e in causes(err)):
            raise found from None  # the project's own error, with its own traceback
        raise found from err


class FFPACLI(PreflightCLIMixin, LightningCLI):
    """LightningCLI with our defaults: subclass mode, errors as one line, pre-flight checks, honest screen."""

    def __init__(self, *args: Any, on_ready: Callable[[L.Trainer], None] | None = None, **kwargs: Any) -> None:
        """LightningCLI's arguments, plus `on_ready(trainer)`: called once the input is accepted, before the
        subcommand runs."""
        self._on_ready = on_ready
        super().__init__(*args, **kwargs)

    def init_parser(self, **kwargs: Any):  # noqa: D102
        kwargs.setdefault("exit_on_error", False)  # raise, so the console script prints one line (no usage dump)
        return super().init_parser(**kwargs)

    def setup_parser(self, add_subcommands: bool, *args: Any, **kwargs: Any) -> None:  # noqa: D102
        super().setup_parser(add_subcommands, *args, **kwargs)
        if add_subcommands:  # `main` runs these before the parser sees them: listed in `--help` only, not parsed
            lightning_compat.add_help_only_subcommands(self.parser, recipes.COMMANDS)

    def add_arguments_to_parser(self, parser) -> None:  # noqa: D102
        parser.set_defaults({"trainer.log_every_n_steps": 10})

    def parse_arguments(self, parser, args) -> None:  # noqa: D102
        check_negative_values(list(args or []))
        if not self.auto_configure_optimizers:
            check_no_optimizer_options(list(args or []))
        check_flow_values(list(args or []))
        with _as_user_errors(), warnings.catch_warnings():
            # `main` passes the console's argv explicitly (recipe names resolved); that is not a mistake
            warnings.filterwarnings("ignore", message="LightningCLI's args parameter")
            super().parse_arguments(parser, args)
        config = self.config[self.config["subcommand"]] if self.config.get("subcommand") else self.config
        check_seed(config.get("seed_everything"))

    def before_instantiate_classes(self) -> None:  # noqa: D102
        check_environment()
        config = self.config[self.subcommand] if self.subcommand else self.config
        trainer = config.get("trainer")
        if trainer is not None and (path := strategy_class_path(trainer.get("strategy"))) is not None:
            # jsonargparse keeps a bare class name (or path) as Trainer's `str` choice, and Lightning lower-cases it
            # and names no registered strategy: build the class the user named, with its defaults
            trainer["strategy"] = Namespace(class_path=path, init_args=Namespace())
        options = dict(trainer or {})
        check_trainer_options(options)
        if self.subcommand == "fit":  # the callbacks that need a logger log while training
            check_fit_has_a_logger(options)
        check_validation_options(config.get("model"), options)
        # from the Namespace: `dict()` of it flattens nested keys, so the dict holds no `strategy` Namespace
        check_strategy_options(trainer.get("strategy") if trainer is not None else None)

    def instantiate_classes(self) -> None:  # noqa: D102
        with _as_user_errors():
            super().instantiate_classes()

    def instantiate_trainer(self, **kwargs: Any):
        """The Trainer, with `StopOnSigterm`, `CheckpointSpace`, `FinalCheckpoint`, and the step progress bar and
        parameter summary unless the config disables or sets them."""
        from lightning_ffpa.callbacks.preemption import StopOnSigterm
        from lightning_ffpa.callbacks.screen import ParameterSummary, default_callbacks
        from lightning_ffpa.checkpoint.final import FinalCheckpoint
        from lightning_ffpa.checkpoint.space import CheckpointSpace

        config = self.config_init[self.subcommand] if self.subcommand else self.config_init
        options = dict(config.get("trainer") or {})
        callbacks = options.get("callbacks") or []
        callbacks = list(callbacks) if isinstance(callbacks, (list, tuple)) else [callbacks]
        extra = default_callbacks(options, callbacks)
        if not any(isinstance(c, StopOnSigterm) for c in callbacks):
            extra.append(StopOnSigterm())  # every rank stops at the same step (exit 143)
        if not any(isinstance(c, CheckpointSpace) for c in callbacks):
            extra.append(CheckpointSpace())  # a checkpoint that will not fit: refused at fit start, not when due
        if not any(isinstance(c, FinalCheckpoint) for c in callbacks):
            extra.append(FinalCheckpoint())  # a fit that ends between two periodic saves saves its last step
        kwargs.setdefault("callbacks", callbacks + extra)
        if any(isinstance(c, ParameterSummary) for c in extra):
            kwargs.setdefault("enable_model_summary", False)  # ours replaces Lightning's default summary
        try:
            trainer = super().instantiate_trainer(**kwargs)
        except TypeError as err:  # Lightning reports some bad values as TypeError (e.g. `devices=-2`)
            raise InputError(one_line(err)) from err
        except (MisconfigurationException, ModuleNotFoundError, ValueError) as err:
            if (named := accelerator_error(options.get("accelerator"), err)) is not None:
                raise named from None
            raise
        check_precision_runs_here(trainer, options.get("precision"))
        return trainer

    def _ready(self) -> None:
        check_world_matches_launcher(self.trainer)
        check_cluster_layout(self.trainer)
        if self._on_ready is not None:
            self._on_ready(self.trainer)

    def before_fit(self) -> None:
        """Pre-flight checks (checkpoint, LoRA targets, vocab, layout) before any model is built."""
        # the launch layout first: before the run-dir lock (a sibling rank is not "another fit") and before the
        # strategy's root device is read (a rank beyond `trainer.devices` has none)
        check_world_matches_launcher(self.trainer)
        check_cluster_layout(self.trainer)
        with _as_user_errors():
            super().before_fit()
        check_run_dir_free(self.trainer)
        self._ready()

    def after_fit(self) -> None:
        """One closing line: the step reached, and where the checkpoints and logs are."""
        trainer = self.trainer
        log_dir = trainer.log_dir if trainer.loggers else None  # a broadcast: every rank takes part
        if not trainer.is_global_zero:
            return
        from lightning_ffpa.callbacks.preemption import DeferredRequeue

        requeued = next((c.requeued for c in trainer.callbacks if isinstance(c, DeferredRequeue) and c.requeued),
                        None)
        parts = [f"fit finished at step {trainer.global_step}"]
        if requeued:  # a SLURM requeue signal stopped it: the requeued job resumes by itself
            parts = [f"stopped for the SLURM requeue at step {requeued[0]}; HPC checkpoint {requeued[1]} (the requeued "
                     "job resumes from it with the same command)"]
        ckpt = trainer.checkpoint_callback
        if ckpt is not None and (ckpt.last_model_path or ckpt.best_model_path):
            saved_at = lightning_compat.last_checkpoint_step(ckpt)
            if saved_at is None:  # nothing saved in this process: the checkpoint is the one it resumed from (or older)
                saved_at = _saved_step(ckpt.last_model_path or ckpt.best_model_path)
            behind = (f" (step {saved_at}: the steps after it are not saved)"
                      if saved_at is not None and saved_at < trainer.global_step else "")
            parts.append(f"checkpoint {ckpt.last_model_path or ckpt.best_model_path}{behind}")
        if log_dir:
            parts.append(f"logs {log_dir}")
        print("; ".join(parts), flush=True)

    def before_validate(self) -> None:  # noqa: D102
        if not self._model_has("validation_step"):
            raise InputError(f"`model` ({type(self.model).__name__}) has no validation step, so `validate` has "
                             "nothing to run (a GRPO run logs its rewards at each fit step, as rollout/reward; for a held-out "
                             "loss of its weights, export them with `lightning-ffpa-export --merge_lora` and validate "
                             "an SFT config with `--model.init_args.pretrained` at the folder)")
        if self.trainer.limit_val_batches == 0:
            raise InputError("`trainer.limit_val_batches` is 0, so `validate` has nothing to run")
        if getattr(self.datamodule, "num_val_samples", None) == 0:  # MockDataModule: no validation rows
            raise InputError("`data.init_args.num_val_samples` is 0, so `validate` has nothing to run")
        if _holds_out_nothing(self.datamodule):  # checked before the checkpoint loads, not after an empty loop
            raise InputError("`data.init_args.val_fraction` is 0 and no `val_file` or `val_split` is set, so "
                             "`validate` has no rows to run on")
        self._check_ckpt_loads()
        self._ready()
        self._say_what_is_evaluated()

    def after_validate(self) -> None:
        """A validation that ran no batch is an input mistake, not a success with no metrics."""
        if not sum(self.trainer.num_val_batches):
            data = type(self.datamodule).__name__ if self.datamodule is not None else "no datamodule"
            text_data = hasattr(self.datamodule, "val_fraction")
            hint = " (set `val_file`, `val_split` or `val_fraction` > 0)" if text_data else ""
            raise InputError(f"`validate` ran no batch: `data` ({data}) gave no validation rows{hint}")
        line = capped_evaluation(sum(self.trainer.num_val_batches), _loader_batches(self.trainer.val_dataloaders),
                                 self.trainer.limit_val_batches)
        if line and self.trainer.is_global_zero:
            print(line, flush=True)

    def before_test(self) -> None:  # noqa: D102
        self._require_loader("test_dataloader")
        self._check_ckpt_loads()
        self._ready()
        self._say_what_is_evaluated()

    def before_predict(self) -> None:  # noqa: D102
        self._require_loader("predict_dataloader")
        self._check_ckpt_loads()
        self._ready()
        self._say_what_is_evaluated()

    def after_predict(self) -> None:
        """LightningCLI drops what `predict` returns: say so where no callback wrote the predictions."""
        from lightning.pytorch.callbacks import BasePredictionWriter

        trainer = self.trainer
        if trainer.is_global_zero and not any(isinstance(c, BasePredictionWriter) for c in trainer.callbacks):
            batches = sum(trainer.num_predict_batches)
            print(f"predict ran {batches} batch{'es' if batches != 1 else ''}, and nothing saved the predictions: "
                  "add a `lightning.pytorch.callbacks.BasePredictionWriter` to `trainer.callbacks` to write them",
                  flush=True)

    def _check_ckpt_loads(self) -> None:
        """The checkpoint `validate`/`test`/`predict` evaluates loads here, into a model built as it was trained
        (the module's load hook would refuse it only once the Trainer started), and fits the data: the data is read
        now (a bad input is one line before the Trainer starts), its ids fit the model's vocabulary, and its
        tokenizer is the one the checkpoint was trained with."""
        ckpt_path = self.config_init[self.subcommand].get("ckpt_path")
        with _as_user_errors():
            check_strategy_loads(self.trainer, ckpt_path)
            check_evaluated_checkpoint(self.trainer, ckpt_path, self.subcommand)
            resolved = lightning_compat.resolve_ckpt_path(self.trainer, ckpt_path) if ckpt_path != "best" else None
            state = check_checkpoint(resolved, "ckpt_path", resume=False, verify_checksums=False) if resolved else {}
            check_hparams_match(state.get("hyper_parameters"), self.model, "ckpt_path", resume=False,
                                saved_class=state.get(MODULE_CLASS_KEY))
            if callable(getattr(self.model, "check_data", None)):
                self.model.check_data(self.datamodule)
            if callable(getattr(self.datamodule, "check_before_fit", None)):  # ours: reading twice costs nothing
                self.datamodule.setup(self.subcommand)
            check_data_fits_model(self.model, self.datamodule)
            if resolved is not None:
                check_tokenizer_matches(self.datamodule, state, resolved)

    def _say_what_is_evaluated(self) -> None:
        """Without `--ckpt_path` the model runs as built: said on one line once the input is accepted (a random
        init evaluated without a word looked like a trained model's loss)."""
        if self.config_init[self.subcommand].get("ckpt_path") is None and self.trainer.is_global_zero:
            print(evaluated_as_built(self.model, self.subcommand), flush=True)

    def _model_has(self, hook: str) -> bool:
        return _overrides(self.model, hook)

    def _require_loader(self, hook: str) -> None:
        """Refuse a subcommand whose data is missing before the model is built or sharded."""
        if not any(_overrides(owner, hook) for owner in (self.datamodule, self.model)):
            data = type(self.datamodule).__name__ if self.datamodule is not None else "no datamodule"
            hint = ("; for held-out loss and perplexity use `lightning-ffpa validate`"
                    if self._model_has("validation_step") else "")
            raise InputError(f"`data` ({data}) has no `{hook}`, so `{self.subcommand}` has nothing to run on{hint}")


def evaluated_as_built(model: Any, subcommand: str) -> str:
    """The start-up line of `validate`/`test`/`predict` without `--ckpt_path`: which weights the model runs with."""
    hparams = getattr(model, "hparams", None) or {}
    if hparams.get("pretrained"):
        weights = f"the pretrained weights of {hparams['pretrained']}"
    elif "pretrained" in hparams:  # ours, built from `preset`: nothing trained
        weights = (f"random init of preset {hparams.get('preset')!r} (no `model.init_args.pretrained`; `--ckpt_path "
                   "last` evaluates the run's last checkpoint)")
    else:
        weights = f"{type(model).__name__}'s own weights"
    return f"{subcommand}: no --ckpt_path, so the model is evaluated as built: {weights}"


def capped_evaluation(ran: int, batches: int | None, limit: int | float) -> str | None:
    """The line after a `validate` that `trainer.limit_val_batches` cut short (a recipe's cap, set for a fit's
    periodic validation, scored part of the set without a word); None where it scored every batch."""
    if batches is None or ran >= batches:
        return None
    return (f"validate: scored {ran} of the {batches} validation batches (`trainer.limit_val_batches={limit}`; "
            "`--trainer.limit_val_batches 1.0` scores them all)")


def _loader_batches(loaders: Any) -> int | None:
    """This rank's batches in the evaluation loaders, where they have a length."""
    try:
        return sum(len(loader) for loader in (loaders if isinstance(loaders, (list, tuple)) else [loaders]))
    except TypeError:  # an iterable-style dataset
        return None


def _holds_out_nothing(datamodule: Any) -> bool:
    """A text datamodule (`val_fraction`) with no validation source of its own and nothing held out."""
    return (getattr(datamodule, "val_fraction", None) == 0 and getattr(datamodule, "val_file", None) is None
            and getattr(datamodule, "val_split", None) is None)


def _overrides(owner: Any, hook: str) -> bool:
    """Whether a model or datamodule (None: no) defines Lightning hook `hook` itself."""
    from lightning.pytorch.utilities.model_helpers import is_overridden

    return owner is not None and is_overridden(hook, owner)


def _strict_yaml() -> None:
    """jsonargparse's YAML loader, refusing a repeated key (YAML lets the later one win silently)."""
    import jsonargparse
    import yaml

    if not getattr(jsonargparse.get_loader("yaml"), "refuses_duplicate_keys", False):
        load = refuse_duplicate_keys(jsonargparse.get_loader("yaml"))
        load.refuses_duplicate_keys = True
        jsonargparse.set_loader("yaml", load, exceptions=(yaml.YAMLError,))


def build(args: list[str] | None = None, *, run: bool = True, on_ready: Callable[[L.Trainer], None] | None = None,
          **cli_kwargs: Any) -> FFPACLI:
    """The CLI exactly as `lightning-ffpa` builds it; runs the subcommand in `args` unless `run=False`.

    Args:
        args: Command-line words (default: `sys.argv[1:]`); with `run=False`, no subcommand (`fit`).
        run: Run the subcommand (True) or only parse and instantiate (False: `cli.model`, `cli.trainer`).
        on_ready: Called once the input is accepted, before the subcommand runs.
        cli_kwargs: LightningCLI arguments that replace the project's defaults.
    """
    import_components()
    _strict_yaml()
    args = list(sys.argv[1:] if args is None else args)
    check_config_before_subcommand(args, ("fit", "validate", "test", "predict"),
                                   lambda name: recipes.resolve_config_args(["--config", name])[1])
    args = recipes.resolve_config_args(args)
    kwargs: dict[str, Any] = dict(
        model_class=None, datamodule_class=None, subclass_mode_model=True, subclass_mode_data=True,
        seed_everything_default=1234, save_config_kwargs={"overwrite": True}, auto_configure_optimizers=False,
        # no abbreviated options: argparse ran `--trainer.max_step 3` as max_steps without a word
        parser_kwargs={"description": recipes.DESCRIPTION, "allow_abbrev": False},
    )
    kwargs.update(cli_kwargs)
    return FFPACLI(args=args, run=run, on_ready=on_ready, **kwargs)


def command(argv: list[str]) -> int:
    """Run the LightningCLI subcommand in `argv`; the exit code (143 after SIGTERM)."""
    running: list[L.Trainer] = []

    def ready(trainer: L.Trainer) -> None:
        release_stderr()
        running.append(trainer)

    try:
        build(argv, on_ready=ready)
        close_process_group()
    except SIGTERMException:  # Lightning ends fit with SystemExit(None) on SIGTERM: exit 0, silently
        if running and running[-1].is_global_zero:
            print(_terminated_line(running[-1]), file=sys.stderr, flush=True)
        return EXIT_TERMINATED
    except SystemExit as err:  # Lightning ends fit with SystemExit(1) on Ctrl-C, and prints no checkpoint
        if not (running and isinstance(err.__context__, KeyboardInterrupt)):
            raise
        if running[-1].is_global_zero:
            print(_terminated_line(running[-1], "SIGINT (Ctrl-C)"), file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    return 0


def _saved_step(path: str) -> int | None:
    """The `global_step` a checkpoint file (or DCP folder) holds, or None if it cannot be read."""
    import torch

    target = Path(path)
    if target.is_dir():
        target = target / lightning_compat.lightning_dcp_meta_filename()
    try:
        state = torch.load(target, map_location="cpu", mmap=True, weights_only=True)
    except Exception:  # noqa: BLE001 - the closing line then just names the file
        return None
    step = state.get("global_step") if isinstance(state, dict) else None
    return step if isinstance(step, int) else None


def _terminated_line(trainer: L.Trainer, signal_name: str = "SIGTERM") -> str:
    """Where the stopped run's last checkpoint is and how to continue from it (`--ckpt_path last` finds only a
    ModelCheckpoint's `last` file: without `save_last`, the line names the newest file instead)."""
    ckpt = trainer.checkpoint_callback
    last = ckpt.last_model_path if ckpt is not None else ""
    newest = lightning_compat.last_checkpoint_saved(ckpt) if ckpt is not None else ""
    stopped = f"stopped by {signal_name} at step {trainer.global_step}"
    if not last and not newest:  # `--ckpt_path last` would find nothing and start afresh anyway
        return f"{stopped}; no checkpoint was written; the same command starts the run again from step 0"
    if last:
        return f"{stopped}; last checkpoint {last}; continue with the same command and --ckpt_path last"
    return (f"{stopped}; newest checkpoint {newest} (ModelCheckpoint's save_last is off); continue with the same "
            f"command and --ckpt_path {newest}")
