"""Checkpoints without the frozen base (`model.save_frozen_weights: false`): what is left out and how a resume
proves it rebuilt the same base.

Owns: the names of a module's frozen weights (parameters with `requires_grad=False`, named as state dicts
name them, without `parallelize`'s wrapper levels), their digest, the record a checkpoint saved without them
carries (`checkpoint[FROZEN_BASE_KEY]`: the run's seed and name -> digest), reading that record from a `.ckpt`
file or a DCP folder, and the checks a resume (or an export) makes: the seed of a `preset` base before any model is
built, the digest against the base it rebuilt; seeding as the fit did outside a run (`under_fit_seed`, for export).
Does not own building the base (`HFModule` rebuilds it from `pretrained`, or from `preset` under the run's seed),
leaving the weights out of the state dict (`HFModule.on_save_checkpoint`, `FSDP2Strategy.lightning_module_state_dict`)
or loading the trained weights over the base (Lightning, and `_compat.lightning.module_keys_with_wrappers` under
FSDP2Strategy; `lightning_ffpa.export` for an export).

The digest of a tensor is its shape, dtype, and the sum and the sum of squares of its bits read as 16-bit
integers, summed in int64: integer sums do not depend on the order they are taken in, so a tensor sharded
over any number of ranks digests as the whole tensor does, exactly. It costs one read of the base (chunked:
at most 128 MiB of temporaries). Another seed, another `pretrained` checkpoint or another dtype changes it;
a permutation of the same values would not (a rebuild that permutes a base is not a way this project fails).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_ffpa._compat import lightning as lightning_compat
from lightning_ffpa._compat.torch import without_wrapper_levels
from lightning_ffpa.errors import ConfigError

__all__ = ["FROZEN_BASE_KEY", "OPTION", "check_frozen_base", "check_frozen_seed", "fingerprint", "frozen_names",
           "frozen_record", "read_frozen_record", "under_fit_seed"]

# top-level checkpoint key: {"seed": seed_everything's seed or None, "tensors": {name: [shape, dtype, word sum,
# squared word sum]}}
FROZEN_BASE_KEY = "frozen_base"
OPTION = "model.save_frozen_weights"
_CHUNK = 1 << 24  # words digested at a time: an int64 temporary of 128 MiB


def frozen_names(module: nn.Module) -> set[str]:
    """State-dict names (wrapper levels removed) of `module`'s parameters with `requires_grad=False`, ties included."""
    return {without_wrapper_levels(n) for n, p in module.named_parameters(remove_duplicate=False)
            if not p.requires_grad}


def _words(t: torch.Tensor) -> torch.Tensor:
    """`t`'s bits as a flat tensor of 16-bit words (bytes for 1-byte dtypes)."""
    flat = t.detach().reshape(-1)
    return flat.view(torch.int16) if t.element_size() % 2 == 0 else flat.view(torch.uint8)


def _local_digest(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """(word sum, squared word sum) of `t`, int64, on `device`: no overflow below 2**33 words per tensor."""
    words = _words(t)
    out = torch.zeros(2, dtype=torch.int64, device=words.device)
    for start in range(0, words.numel(), _CHUNK):
        w = words[start:start + _CHUNK].to(torch.int64)
        out[0] += w.sum()
        out[1] += (w * w).sum()
    return out.to(device)


def fingerprint(module: nn.Module) -> dict[str, list]:
    """name -> [shape, dtype, word sum, squared word sum] of each frozen parameter of `module`, as the whole
    tensor digests. Collective where frozen parameters are sharded (DTensors): call it on every rank."""
    from torch.distributed.tensor import DTensor, Shard

    tensors: dict[int, tuple[list[str], torch.Tensor]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if not p.requires_grad:
            tensors.setdefault(id(p), ([], p))[0].append(without_wrapper_levels(name))
    digests: dict[int, torch.Tensor] = {}
    sharded: dict[tuple, list[int]] = {}  # (mesh, dims it is sharded over) -> tensors whose digests sum there
    for key, (_, p) in tensors.items():
        if isinstance(p, DTensor):
            mesh = p.device_mesh
            digests[key] = _local_digest(p.to_local(), torch.device(mesh.device_type))  # where its group reduces
            dims = tuple(d for d, placement in enumerate(p.placements) if isinstance(placement, Shard))
            if dims:
                sharded.setdefault((mesh, dims), []).append(key)
        else:
            digests[key] = _local_digest(p, torch.device("cpu"))
    for (mesh, dims), keys in sharded.items():  # one all-reduce per mesh dim the shards lie along
        import torch.distributed as dist

        stacked = torch.stack([digests[k] for k in keys])  # (n, 2)
        for dim in dims:
            dist.all_reduce(stacked, group=mesh.get_group(dim))
        for k, row in zip(keys, stacked):
            digests[k] = row
    out: dict[str, list] = {}
    for key, (names, p) in tensors.items():
        total, squares = (int(v) for v in digests[key].tolist())
        for name in names:
            out[name] = [list(p.shape), str(p.dtype).removeprefix("torch."), total, squares]
    return out


def _run_seed() -> int | None:
    """The seed `seed_everything` set in this process (Lightning keeps it in PL_GLOBAL_SEED), or None."""
    seed = os.environ.get("PL_GLOBAL_SEED")
    return int(seed) if seed is not None else None


@contextlib.contextmanager
def under_fit_seed(record: dict[str, Any]) -> Iterator[None]:
    """Seed as the fit's `seed_everything` did (the record's seed; nothing if it ran unseeded), for rebuilding its
    base outside a run (export): a resume gets the seed from the CLI. RNG states and the seed variables are restored
    after."""
    import random

    import lightning as L
    import numpy as np

    seed = record.get("seed")
    env = {k: os.environ.get(k) for k in ("PL_GLOBAL_SEED", "PL_SEED_WORKERS")}
    py, npy = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        try:
            if seed is not None:
                L.seed_everything(seed, verbose=False)
            yield
        finally:
            random.setstate(py)
            np.random.set_state(npy)
            for key, value in env.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value


def frozen_record(module: nn.Module) -> dict[str, Any]:
    """What a checkpoint saved without the frozen base carries: the run's seed and the base's digest."""
    return {"seed": _run_seed(), "tensors": fingerprint(module)}


def read_frozen_record(path: str | os.PathLike, weights_only: bool | None = None) -> dict[str, Any] | None:
    """The frozen-base record of the checkpoint at `path` (a `.ckpt` file, memory-mapped, or a DCP folder's
    non-tensor file), or None for a checkpoint that holds its frozen weights."""
    path = Path(path)
    if not path.exists():  # the loader that follows says so in its own words
        return None
    if path.is_dir():
        meta = path / lightning_compat.lightning_dcp_meta_filename()
        state = torch.load(meta, weights_only=weights_only) if meta.is_file() else {}
    else:
        state = torch.load(path, map_location="cpu", mmap=True, weights_only=weights_only)
    return state.get(FROZEN_BASE_KEY) if isinstance(state, dict) else None


_RESUME_FIX = ("rebuild the fit's base (the same `model.pretrained`, or `model.preset` and `config_overrides` under "
               "the fit's `seed_everything`)")


def _refuse(ckpt_path: Any, why: str, option: str = "ckpt_path", rebuilt: str = "the one this run builds",
            fix: str = _RESUME_FIX) -> ConfigError:
    return ConfigError(option, str(ckpt_path), f"was saved with `{OPTION}=false` (without the frozen base) "
                       f"over another base than {rebuilt}: {why}; {fix}")


def check_frozen_seed(record: dict[str, Any] | None, hparams: dict[str, Any], ckpt_path: Any) -> None:
    """Before any model is built: a `preset` base (drawn at random) must be drawn under the fit's seed."""
    if record is None or hparams.get("pretrained") is not None or record.get("seed") is None:
        return
    if record["seed"] != _run_seed():
        raise _refuse(ckpt_path, f"its random `model.preset` base was drawn under `seed_everything={record['seed']}`, "
                                 f"this run's under {_run_seed()}")


def check_frozen_base(record: dict[str, Any], module: nn.Module, ckpt_path: Any, option: str = "ckpt_path",
                      **wording: str) -> None:
    """Refuse (ConfigError naming `option`=`ckpt_path` and `save_frozen_weights`) a resume whose rebuilt frozen base
    is not the one the checkpoint `ckpt_path` was saved over. Collective where the base is sharded. `wording`
    (`rebuilt`, `fix`) says what rebuilt the base and how to repair it, for callers other than a resume (export)."""
    saved, current = record["tensors"], fingerprint(module)
    why = None
    if set(saved) != set(current):
        extra, lacking = sorted(set(current) - set(saved)), sorted(set(saved) - set(current))
        why = (f"this run has a frozen weight the checkpoint's base did not, `{extra[0]}`" if extra else
               f"this run lacks a frozen weight of the checkpoint's base, `{lacking[0]}`")
    else:
        differ = [name for name in sorted(saved) if list(saved[name]) != list(current[name])]
        if differ:
            was, now = saved[differ[0]], current[differ[0]]
            what = (f"{now[0]} {now[1]} where the checkpoint's base had {was[0]} {was[1]}" if was[:2] != now[:2]
                    else "other values")
            why = f"{len(differ)} of its {len(saved)} frozen weights differ, e.g. `{differ[0]}` has {what}"
    if why is not None:
        if record.get("seed") != _run_seed():
            why += f" (the fit ran under `seed_everything={record.get('seed')}`, this run under {_run_seed()})"
        raise _refuse(ckpt_path, why, option, **wording)
