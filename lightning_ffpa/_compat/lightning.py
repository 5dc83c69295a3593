"""Private Lightning surfaces (checked on lightning 2.6): trainer connectors, strategy internals, fabric helpers.

Owns every read or write of a Lightning name or attribute that starts with `_`. Does not own what the
callers do with them: the strategy, Callbacks and checks import these so a Lightning upgrade breaks one file.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import warnings
from collections.abc import Collection, Iterator
from typing import Any

import torch
from torch import nn

from lightning_ffpa._compat.torch import without_wrapper_levels

# Two lines Lightning prints on every fit that the user can do nothing about, each silenced by its exact text:
# - its own `_pytree` helper still builds `LeafSpec()`, which torch deprecates with a FutureWarning
#   (Lightning-AI/pytorch-lightning#21326);
# - a tip advertising its hosted logger (`rank_zero_info` in the trainer's logger connector).
warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated", category=FutureWarning,
                        module=r"lightning\.pytorch\.utilities\._pytree")
_LITLOGGER_TIP = "💡 Tip: For seamless cloud logging"


def _not_the_litlogger_tip(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith(_LITLOGGER_TIP)


logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(_not_the_litlogger_tip)

__all__ = [
    "accumulating",
    "add_help_only_subcommands",
    "cluster_environment",
    "handler_before_trainer",
    "last_checkpoint_saved",
    "last_checkpoint_step",
    "lightning_dcp_meta_filename",
    "loaded_checkpoint",
    "logging_step",
    "materialize_distributed_module",
    "module_keys_with_wrappers",
    "module_device_mesh",
    "next_hpc_checkpoint",
    "optimizers_to_device",
    "requested_data_parallel_size",
    "resolve_ckpt_path",
    "set_device_mesh",
    "set_received_sigterm",
    "setup_distributed",
    "should_update_logs",
]


# --------------------------------------------------------------------------- fabric helpers



_FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def _copy_whole_float8(state_dict: dict[str, Any], module: nn.Module) -> frozenset[str]:
    """Copy the float8 plain-tensor (not DTensor) parameters of `module` from `state_dict` in place, and take them
    out of it; returns their names without wrapper levels."""
    done = set()
    for name, param in module.named_parameters():
        value = state_dict.get(name)
        if value is None or param.dtype not in _FLOAT8 or hasattr(param, "device_mesh"):
            continue
        with torch.no_grad():
            param.copy_(value)
        for key in (name, without_wrapper_levels(name)):
            state_dict.pop(key, None)
        done.add(without_wrapper_levels(name))
    return frozenset(done)


@contextlib.contextmanager
def module_keys_with_wrappers(absent: Collection[str] = (), module: nn.Module | None = None) -> Iterator[None]:
    """While open, Lightning's single-file load into a DTensor model (`_load_raw_module_state`) also finds each
    weight under its module path with `parallelize`'s wrapper levels, which its lookup uses: a file saved
    without them (every single-file save: `get_model_state_dict` drops them) loaded with a KeyError.

    `absent`: weights (named without wrapper levels) the checkpoint was saved without (`save_frozen_weights`).
    The model keeps its own values of those, in both the single-file and the DCP-folder load; any other
    weight the checkpoint lacks is still an error.

    `module`: the model a DCP folder loads into. Lightning fills `get_model_state_dict(module)` (names without the
    wrapper levels) and hands it to `module.load_state_dict`, whose names have them where a layer is compiled
    (`_orig_mod`): the names are put back before that call.

    Float8 parameters kept whole on every rank (a LoRA's float8 base, out of FSDP2) are copied from the file,
    which every rank has read, instead of broadcast from rank 0: gloo has no float8 type ("Invalid scalar
    type")."""
    import lightning.fabric.strategies.model_parallel as fabric_mp

    original, original_dcp = fabric_mp._load_raw_module_state, fabric_mp._distributed_checkpoint_load
    absent = frozenset(absent)

    def load(state_dict: dict[str, Any], module: nn.Module, *args: Any, **kwargs: Any) -> None:
        aliased = dict(state_dict)
        for name in [*(n for n, _ in module.named_parameters()), *(n for n, _ in module.named_buffers())]:
            plain = without_wrapper_levels(name)  # saved state dicts name weights without them
            if name != plain and plain in state_dict:
                aliased.setdefault(name, state_dict[plain])
        local = _copy_whole_float8(aliased, module)
        skipped = absent | local
        if skipped and kwargs.get("strict", True):
            # strict would demand the absent weights too: check the rest here, then load leniently
            have = {without_wrapper_levels(k) for k in state_dict}
            missing = [k for k in map(without_wrapper_levels, module.state_dict()) if k not in have | skipped]
            if missing:
                raise KeyError(f"The model contains a key {missing[0]!r} that does not exist in the loaded "
                               f"checkpoint ({len(missing)} missing besides the frozen weights it was saved without)")
            kwargs["strict"] = False
        return original(aliased, module, *args, **kwargs)

    def load_dcp(module_state: dict[str, Any], path: Any) -> None:
        # DCP reads every entry it is given: take the absent ones out (the model's own tensors, which
        # Lightning's strict `load_state_dict` then copies onto themselves), and put them back after
        held = []
        for inner in module_state.values():
            if isinstance(inner, dict):
                held += [(inner, key, inner.pop(key)) for key in [k for k in inner if k in absent]]
        try:
            original_dcp(module_state, path)
        finally:
            for inner, key, value in held:
                inner[key] = value
        if module is not None:  # Lightning next calls `module.load_state_dict` with these plain names
            for inner in module_state.values():
                if isinstance(inner, dict):
                    _with_wrapper_names(inner, module)

    original_rekey = fabric_mp._rekey_optimizer_state_if_needed

    def rekey(optimizer_state: dict[str, Any], module: nn.Module) -> dict[str, Any]:
        # a single file's optimizer state is keyed by position; FSDP1's re-keying names each parameter with
        # compile's `_orig_mod` level, which `set_optimizer_state_dict` looks up without
        return _without_wrapper_names(original_rekey(optimizer_state, module))

    fabric_mp._load_raw_module_state = load
    fabric_mp._distributed_checkpoint_load = load_dcp
    fabric_mp._rekey_optimizer_state_if_needed = rekey
    try:
        yield
    finally:
        fabric_mp._load_raw_module_state = original
        fabric_mp._distributed_checkpoint_load = original_dcp
        fabric_mp._rekey_optimizer_state_if_needed = original_rekey


def _with_wrapper_names(state: dict[str, Any], module: nn.Module) -> None:
    """Re-key `state` (names without wrapper levels) in place to `module.state_dict()`'s own names."""
    for name in list(module.state_dict().keys()):
        plain = without_wrapper_levels(name)
        if name != plain and plain in state:
            state[name] = state.pop(plain)


def _without_wrapper_names(optimizer_state: dict[str, Any]) -> dict[str, Any]:
    """An optimizer state dict keyed by parameter name, with the names' wrapper levels taken out."""
    def plain(key: Any) -> Any:
        return without_wrapper_levels(key) if isinstance(key, str) else key

    groups = [{**g, "params": [plain(p) for p in g["params"]]} for g in optimizer_state.get("param_groups", [])]
    return {**optimizer_state, "state": {plain(k): v for k, v in optimizer_state["state"].items()},
            "param_groups": groups}


def materialize_distributed_module(module: nn.Module, device: torch.device) -> None:
    """Allocate meta-device parameters on `device` and call `reset_parameters()` (Lightning's own path)."""
    from lightning.fabric.utilities.init import _materialize_distributed_module

    _materialize_distributed_module(module, device)


def optimizers_to_device(optimizers: Any, device: torch.device) -> None:
    """Move every optimizer's state tensors to `device`."""
    from lightning.fabric.utilities.optimizer import _optimizers_to_device

    _optimizers_to_device(optimizers, device)


# --------------------------------------------------------------------------- ModelParallelStrategy internals


def setup_distributed(strategy: Any) -> None:
    """Start the process group the way ModelParallelStrategy does (backend, timeout, device), with one change:
    a world of one process gets an in-memory store instead of a TCP one.

    Why: Lightning binds a TCP port (MASTER_PORT, or a "free" one it picked) even for one process; on a node
    shared with other jobs that port can be taken between the pick and the bind (EADDRINUSE at start-up).
    One process has nobody to meet, so it needs no port."""
    import torch.distributed as dist

    if strategy.num_nodes * strategy.num_processes == 1 and not dist.is_initialized():
        from lightning.fabric.utilities.distributed import _destroy_dist_connection

        backend, device = strategy._get_process_group_backend(), strategy.root_device
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=strategy._timeout,
                                device_id=device if device.type != "cpu" else None)
        if backend == "nccl":
            atexit.register(_destroy_dist_connection)  # as Lightning does for the groups it starts
    strategy._setup_distributed()  # ranks and backend; it leaves an initialised group as it is


def set_device_mesh(strategy: Any, mesh: Any) -> None:
    """Install `mesh` as the strategy's `device_mesh` and the LightningModule's (`self.device_mesh` in
    `configure_model`), as ModelParallelStrategy.setup_environment does with its own dp x tp mesh."""
    strategy._device_mesh = mesh
    if strategy.lightning_module is not None:
        strategy.lightning_module._device_mesh = mesh


def requested_data_parallel_size(strategy: Any) -> Any:
    """The `data_parallel_size` a ModelParallelStrategy was constructed with ("auto" or an int)."""
    return getattr(strategy, "_data_parallel_size", "auto")


def module_device_mesh(pl_module: Any) -> Any:
    """The LightningModule's device mesh, or None (`pl_module.device_mesh` without the property's checks)."""
    return getattr(pl_module, "_device_mesh", None)


# --------------------------------------------------------------------------- trainer internals


def cluster_environment(trainer: Any) -> Any:
    """The trainer's ClusterEnvironment (SLURM, torchelastic, ...)."""
    return trainer._accelerator_connector.cluster_environment


def set_received_sigterm(trainer: Any) -> None:
    """Mark SIGTERM as received: Lightning's loop raises `SIGTERMException` at the end of the current step."""
    trainer._signal_connector.received_sigterm = True


def accumulating(trainer: Any) -> bool:
    """Whether the batch that just ran left its gradients for a later optimizer step (gradient accumulation)."""
    return trainer.fit_loop._should_accumulate()


def handler_before_trainer(trainer: Any, signum: int) -> Any:
    """The handler `signum` had before the trainer installed its own (None, `SIG_DFL` or `SIG_IGN` included)."""
    return trainer._signal_connector._original_handlers.get(signum)


def next_hpc_checkpoint(trainer: Any) -> str:
    """The path Lightning's SLURM requeue handler saves to next (`hpc_ckpt_<N+1>.ckpt` in `default_root_dir`)."""
    return trainer._checkpoint_connector.hpc_save_path(trainer.default_root_dir)


def last_checkpoint_saved(checkpoint_callback: Any) -> str:
    """The file a ModelCheckpoint wrote last (its `last.ckpt` or not), or ""."""
    return getattr(checkpoint_callback, "_last_checkpoint_saved", "") or ""


def hold_last_save(trainer: Any) -> list[tuple[Any, Any]]:
    """Keep each ModelCheckpoint's `on_train_end` from saving `last` (it does where it saved nothing yet in this
    process); returns what `release_last_save` puts back."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    held = [(c, c.save_last) for c in trainer.checkpoint_callbacks if isinstance(c, ModelCheckpoint) and c.save_last]
    for callback, _ in held:
        callback.save_last = False
    return held


def release_last_save(held: list[tuple[Any, Any]]) -> None:
    """Put back the `save_last` values `hold_last_save` took."""
    for callback, save_last in held:
        callback.save_last = save_last


def last_checkpoint_step(checkpoint_callback: Any) -> int | None:
    """The global step of a ModelCheckpoint's newest save in this run, or None if it saved nothing."""
    if not last_checkpoint_saved(checkpoint_callback):  # `_last_global_step_saved` starts at 0, not "none"
        return None
    step = getattr(checkpoint_callback, "_last_global_step_saved", None)
    return step if isinstance(step, int) and step >= 0 else None


def save_checkpoint_now(checkpoint_callback: Any, trainer: Any, epoch: int | None = None) -> bool:
    """Have a ModelCheckpoint save the current step as its periodic save does (its top-k rule, then `last`);
    False, saving nothing, where its monitored value is not logged at this point or where it would skip a save
    itself (`fast_dev_run`, sanity checking, outside fit). `epoch`: the one its file name carries, where it is not
    `trainer.current_epoch`."""
    if checkpoint_callback._should_skip_saving_checkpoint(trainer):  # Lightning: "checkpointing is suppressed"
        return False
    candidates = checkpoint_callback._monitor_candidates(trainer)
    if epoch is not None:
        candidates["epoch"] = torch.tensor(epoch)
    if checkpoint_callback.monitor is not None and checkpoint_callback.monitor not in candidates:
        return False
    checkpoint_callback._save_topk_checkpoint(trainer, candidates)
    checkpoint_callback._save_last_checkpoint(trainer, candidates)
    return True


def logging_step(trainer: Any) -> int:
    """The step a training batch's `self.log` metrics are written at: in `on_train_batch_end` the optimizer step
    has already raised `global_step`, while the logger connector still writes at `_batches_that_stepped`."""
    return trainer.fit_loop.epoch_loop._batches_that_stepped


def should_update_logs(trainer: Any) -> bool:
    """Whether the trainer logs at this step (`log_every_n_steps`)."""
    return trainer._logger_connector.should_update_logs


def resolve_ckpt_path(trainer: Any, ckpt_path: str | None) -> str | None:
    """What `trainer.fit(ckpt_path=...)` will load: resolves "last", "hpc", "best" and SLURM auto-resume."""
    from lightning.pytorch.trainer.states import TrainerFn

    connector = trainer._checkpoint_connector
    with warnings.catch_warnings():  # `preflight` says it instead: the hint blames `save_last` even where it is on
        warnings.filterwarnings("ignore", message=r".*there is no last checkpoint available")
        return connector._parse_ckpt_path(TrainerFn.FITTING, ckpt_path, model_provided=True, model_connected=False)


def lightning_dcp_meta_filename() -> str:
    """File in a Lightning DCP folder that holds the non-tensor state (loops, hparams, callbacks)."""
    from lightning.fabric.strategies.model_parallel import _METADATA_FILENAME

    return _METADATA_FILENAME


def loaded_checkpoint(trainer: Any) -> dict[str, Any] | None:
    """The checkpoint dict the trainer is restoring (between restoring the modules and the loops), or None."""
    connector = getattr(trainer, "_checkpoint_connector", None)
    checkpoint = getattr(connector, "_loaded_checkpoint", None)
    return checkpoint if isinstance(checkpoint, dict) else None


def add_help_only_subcommands(parser: Any, commands: dict[str, str]) -> None:
    """List `commands` ({name: one line}) among a LightningCLI parser's subcommands in `--help` only.

    jsonargparse keeps its argparse `_SubParsersAction` as `_subcommands_action`; argparse prints each
    `_choices_actions` entry as one line. Without those names the help just lacks the lines."""
    action = getattr(parser, "_subcommands_action", None)
    pseudo = getattr(action, "_ChoicesPseudoAction", None)
    if pseudo is None:
        return
    for name, text in commands.items():
        action._choices_actions.append(pseudo(name, (), text))
