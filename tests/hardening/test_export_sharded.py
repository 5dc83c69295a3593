"""`save_hf_sharded`: 2 CPU ranks (gloo) with an FSDP2-sharded tiny Gemma4 write HF safetensors through
torch's HuggingFaceStorageWriter, each rank its own shard; `from_pretrained` then matches the unsharded model."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.multiprocessing as mp
from transformers import Gemma4ForCausalLM

from lightning_ffpa.presets import build_text_config


def _model() -> Gemma4ForCausalLM:
    torch.manual_seed(0)
    return Gemma4ForCausalLM(build_text_config("tiny"))


def _worker(rank: int, world: int, port: int, out: str) -> None:
    import os

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from lightning_ffpa.export import save_hf_sharded

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model = _model()
        mesh = init_device_mesh("cpu", (world,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        save_hf_sharded(model, out, max_shard_size="1MB")
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(180)
def test_sharded_model_saves_hf_safetensors_without_gathering(tmp_path, record_property):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(2, port, str(tmp_path / "hf")), nprocs=2)
    files = sorted(p.name for p in (tmp_path / "hf").iterdir())
    assert "config.json" in files and "model.safetensors.index.json" in files and "sharded" not in files
    assert sum(f.endswith(".safetensors") for f in files) > 1  # split by max_shard_size
    hf = Gemma4ForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ref = _model().eval()
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(hf(input_ids=ids).logits, ref(input_ids=ids).logits)
    record_property("hardening", "export")
    record_property("case", "FSDP2-sharded model (2 ranks) -> HF safetensors via HuggingFaceStorageWriter")
