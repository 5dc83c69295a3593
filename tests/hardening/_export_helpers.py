"""Helpers of the export tests: a 2-step tiny fit saved as a `.ckpt`, the same checkpoint as a DCP folder, and
a fixed batch of token ids."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_ffpa.data import MockDataModule
from lightning_ffpa.module import Gemma4LM


def train(tmp_path: Path, lora: dict[str, Any] | None = None, preset: str = "tiny",
          **module_kwargs: Any) -> tuple[Gemma4LM, Path]:
    """Two optimizer steps of a tiny preset (fp32); the module in eval mode and its `.ckpt`."""
    torch.manual_seed(0)
    lm = Gemma4LM(preset=preset, dtype="float32", lora=lora, learning_rate=1e-2, warmup_steps=0, **module_kwargs)
    trainer = pl.Trainer(max_steps=2, accelerator="cpu", logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False)
    trainer.fit(lm, MockDataModule(seq_length=16, num_samples=4, batch_size=2))
    path = tmp_path / "run.ckpt"
    trainer.save_checkpoint(path)
    return lm.eval(), path


def ids() -> torch.Tensor:
    return torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(1))


def dcp_folder(ckpt: Path, dst: Path) -> Path:
    """The `.ckpt`'s content as the DCP folder FSDP2's ModelCheckpoint writes (weights sharded by DCP)."""
    import torch.distributed.checkpoint as dcp

    from lightning_ffpa._compat.lightning import lightning_dcp_meta_filename

    state = torch.load(ckpt, map_location="cpu", weights_only=True)
    dcp.save({"state_dict": state.pop("state_dict")}, checkpoint_id=str(dst), no_dist=True)
    torch.save(state, dst / lightning_dcp_meta_filename())
    return dst
