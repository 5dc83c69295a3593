"""Run under torchrun with 2 gloo ranks: FSDP2Strategy's sharded checkpoint folders, end to end.

Scenarios, in this order, each into its own folder under argv[2]; rank 0 writes what it saw to argv[1]:
sync saves kept to the last 2; async saves, then a resume from `last`; a disk too small on one rank (both
ranks refuse before writing); a write that fails on rank 1 mid-save (nothing published, `last` unchanged).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from collections import namedtuple
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset

from lightning_ffpa.errors import ConfigError
from lightning_ffpa.parallel import FSDP2Strategy


class Net(L.LightningModule):
    """Two Linear layers sharded with fully_shard in configure_model; AdamW (moments are in the checkpoint)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16))

    def configure_model(self) -> None:
        mesh = self.trainer.strategy.parallel_dims.dp_mesh
        for layer in self.net:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def training_step(self, batch, batch_idx):
        return self.net(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def weights_hash(module: Net) -> str:
    h = hashlib.sha256()
    for _, p in sorted(module.named_parameters()):
        h.update(p.full_tensor().detach().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


class HashAtStart(L.Callback):
    def on_train_start(self, trainer, pl_module) -> None:
        self.hash = weights_hash(pl_module)


def fit(folder: Path, max_steps: int, *, async_save: bool = False, ckpt_path: str | None = None) -> tuple:
    data = TensorDataset(torch.randn(64, 16, generator=torch.Generator().manual_seed(1)))
    start = HashAtStart()
    ckpt = ModelCheckpoint(dirpath=folder, every_n_train_steps=1, save_top_k=2, monitor="step", mode="max",
                           save_last="link")
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=FSDP2Strategy(async_save=async_save,
                        param_dtype="fp32", reduce_dtype="fp32", activation_checkpointing="none"),
                        max_steps=max_steps, logger=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[ckpt, start], default_root_dir=folder.parent)
    module = Net()
    trainer.fit(module, DataLoader(data, batch_size=4), ckpt_path=ckpt_path)
    return trainer, module, start


def listing(folder: Path) -> dict | None:
    # Only rank 0 writes the report; another rank listing here races rank 0 removing a failed save's partial folder.
    if int(os.environ["RANK"]) != 0:
        return None
    out = {}
    for p in sorted(folder.iterdir()):
        if p.is_symlink():
            out[p.name] = "-> " + os.readlink(p)
        elif p.is_dir():
            out[p.name] = sorted(q.name for q in p.iterdir())
        else:
            out[p.name] = "file"
    return out


def main(out: str, root: str) -> None:
    root_dir = Path(root)
    rank = int(os.environ["RANK"])
    report: dict = {}

    trainer, _, _ = fit(root_dir / "sync", 4)
    report["sync"] = listing(root_dir / "sync")

    trainer, module, _ = fit(root_dir / "async", 4, async_save=True)
    report["async"] = listing(root_dir / "async")
    report["async_end_hash"] = weights_hash(module)
    report["async_saved"] = trainer.strategy._dcp_writer.num_saved if rank == 0 else None
    trainer, module, start = fit(root_dir / "async", 6, async_save=True, ckpt_path="last")
    report["resumed_start_hash"], report["resumed_step"] = start.hash, trainer.global_step
    report["async_after_resume"] = listing(root_dir / "async")

    # one rank's disk is too small: both ranks must raise the same one-line error, nothing is written
    real = shutil.disk_usage
    if rank == 1:
        shutil.disk_usage = lambda path: namedtuple("usage", "total used free")(10**6, 10**6 - 100, 100)
    try:
        fit(root_dir / "full", 2)
        report["full"] = "no error"
    except ConfigError as err:
        report["full"] = str(err)
    shutil.disk_usage = real
    dist.barrier()
    report["full_listing"] = listing(root_dir / "full") if (root_dir / "full").exists() else {}

    # a write that fails on rank 1 during the step-3 save: step 3 never appears, `last` still -> step 2
    fit(root_dir / "fail", 2)
    from torch.distributed.checkpoint import FileSystemWriter

    real_write = FileSystemWriter.write_data

    def failing_write(self, plan, planner):
        if rank == 1:
            raise OSError(28, "No space left on device (simulated)")
        return real_write(self, plan, planner)

    FileSystemWriter.write_data = failing_write
    try:
        fit(root_dir / "fail", 4, ckpt_path="last")
        report["fail"] = "no error"
    except BaseException as err:  # noqa: BLE001 - the writer turns DCP's CheckpointException into rank 1's OSError
        report["fail"] = f"{type(err).__name__}: {err}"
    FileSystemWriter.write_data = real_write
    report["fail_listing"] = listing(root_dir / "fail")
    if rank == 0:
        Path(out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    from lightning_ffpa.errors import exit_quickly
    from lightning_ffpa.parallel import close_process_group

    exit_quickly()  # a rank's exit skips the interpreter's exit-time walks of the heap (~1.3 s)
    main(sys.argv[1], sys.argv[2])
    close_process_group()  # as a script with its own Trainer should: no gloo teardown race at exit
