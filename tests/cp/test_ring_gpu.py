"""Ring attention on 2 GPUs (NCCL, bf16): FFPA and Flex full-layer rings and the Flex sliding halo vs one device."""

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_ffpa.attention import kernels
from lightning_ffpa.cp import shard_batch, shard_index, unshard
from lightning_ffpa.cp.ring import RingAttention
from tests.cp.test_ring import _documents, reference

pytestmark = pytest.mark.gpu


def _entry(rank, world, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    try:
        _worker(rank, world)
    finally:
        dist.destroy_process_group()


def _worker(rank, world):
    s, b = 1024, 1
    gen = torch.Generator().manual_seed(0)
    docs = _documents(b, s, 16, gen)
    layout = shard_batch({"input_ids": torch.zeros(b, s, dtype=torch.long), "document_ids": docs},
                         rank, world)["ring_layout"]
    idx = shard_index(s, rank, world)
    for name, hq, hkv, d, window, ops in (("ffpa", 8, 2, 512, None, "ffpa"), ("flex_full", 8, 2, 512, None, "flex"),
                                          ("sliding", 8, 4, 256, 100, "ffpa")):
        q, k, v, g = (torch.randn(b, s, h, d, generator=gen).cuda().bfloat16() for h in (hq, hkv, hkv, hq))
        scale = d ** -0.5
        ql, kl, vl = (t[:, idx.cuda()].clone().requires_grad_() for t in (q, k, v))
        ring = RingAttention(None, block_ops=ops)
        out = ring.sliding(ql, kl, vl, layout, scale, window) if window else ring.full(ql, kl, vl, layout, scale)
        (out.float() * g[:, idx.cuda()].float()).sum().backward()
        qr, kr, vr = (t.float().requires_grad_() for t in (q, k, v))
        ref = reference(qr, kr, vr, layout.document_ids.cuda(), scale, window)
        (ref * g.float()).sum().backward()
        tol = dict(atol=3e-2, rtol=3e-2)
        torch.testing.assert_close(unshard(out.detach().float(), rank, world), ref.detach(), **tol, msg=name)
        for mine, theirs in ((ql, qr), (kl, kr), (vl, vr)):
            torch.testing.assert_close(unshard(mine.grad.float(), rank, world), theirs.grad, **tol, msg=name)
        if ops == "ffpa" and not window:
            assert kernels.active_kernel() == "cutedsl", kernels.ffpa_unavailable_reason()


@pytest.mark.timeout(300)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_ring_on_two_gpus_matches_one_device():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.spawn(_entry, args=(2, port), nprocs=2, join=True)
