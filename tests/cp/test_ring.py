"""Ring attention on CPU/gloo (2 and 4 processes) vs single-device attention: forward and gradients.

Cases: causal; packed documents straddling shard boundaries (with padding); sliding windows (halo and the
all-gather path for a window longer than a chunk); a rank whose whole shard is padding; D=512; the ring under
activation checkpointing (its stats) and on CPU without a forced kernel (its fallback, counted and warned).
"""

import os
import socket
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils.checkpoint import checkpoint

from lightning_ffpa import attention
from lightning_ffpa.attention import fa4, kernels
from lightning_ffpa.cp import shard_batch, shard_index, unshard
from lightning_ffpa.cp.ring import RingAttention


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, fn, world, port, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        with kernels.force_kernel("reference"):
            fn(rank, world, *args)
    finally:
        dist.destroy_process_group()


def spawn(fn, world, *args):
    """Run fn(rank, world, *args) in `world` gloo processes; an assertion in any of them fails the test."""
    mp.spawn(_entry, args=(fn, world, _free_port(), args), nprocs=world, join=True)


def reference(q, k, v, docs, scale, window=None):
    """Single-device float64 attention with document, causal and window masks; empty rows give 0."""
    g = q.shape[2] // k.shape[2]
    qd, kd, vd = q.double(), k.double().repeat_interleave(g, 2), v.double().repeat_interleave(g, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", qd, kd) * scale
    pos = torch.arange(q.shape[1], device=q.device)
    dist_ = pos[:, None] - pos[None, :]
    allowed = (dist_ >= 0) & (dist_ < (window or q.shape[1] + 1))
    allowed = allowed[None] & (docs[:, :, None] == docs[:, None, :]) & (docs[:, :, None] >= 0)
    s = s.masked_fill(~allowed[:, None], float("-inf"))
    p = torch.nan_to_num(torch.softmax(s, -1), nan=0.0)
    return torch.einsum("bhqk,bkhd->bqhd", p, vd).float()


CASES = {
    # name: (B, S per cp unit, Hq, Hkv, D, documents(bool), padding, window)
    "causal": dict(b=2, hq=4, hkv=2, d=16, docs=False, pad=0, window=None),
    "packed": dict(b=2, hq=4, hkv=2, d=16, docs=True, pad=3, window=None),
    "sliding": dict(b=2, hq=4, hkv=2, d=16, docs=True, pad=0, window=6),
    "sliding_long": dict(b=1, hq=2, hkv=1, d=16, docs=True, pad=0, window=13),
    "d512": dict(b=1, hq=2, hkv=1, d=512, docs=True, pad=2, window=None),
}


def _documents(b, s, pad, gen):
    """Random packed documents (lengths 1..s/2) per row, plus `pad` trailing padding tokens; -1 = padding."""
    docs = torch.empty(b, s, dtype=torch.long)
    for row in range(b):
        cuts = torch.randint(1, s // 2, (s,), generator=gen).cumsum(0)
        docs[row] = torch.bucketize(torch.arange(s), cuts, right=True)
        if pad:
            docs[row, s - pad * (row + 1):] = -1
    return docs


def _check_case(rank, world, name, s, all_pad_rank=None, flex=False, sliding_backend=None, checkpointed=False):
    cfg = CASES[name]
    gen = torch.Generator().manual_seed(123)
    b, hq, hkv, d = cfg["b"], cfg["hq"], cfg["hkv"], cfg["d"]
    q = torch.randn(b, s, hq, d, generator=gen)
    k = torch.randn(b, s, hkv, d, generator=gen)
    v = torch.randn(b, s, hkv, d, generator=gen)
    grad = torch.randn(b, s, hq, d, generator=gen)
    docs = _documents(b, s, cfg["pad"], gen) if cfg["docs"] else torch.zeros(b, s, dtype=torch.long)
    if all_pad_rank is not None:  # every token that this rank would hold is padding
        idx_pad = shard_index(s, all_pad_rank, world)
        after = docs[:, idx_pad[-1] + 1:]
        after[after >= 0] += 1000  # a document does not continue across the padding
        docs[:, idx_pad] = -1
    scale = 0.5

    layout = shard_batch({"input_ids": torch.zeros(b, s, dtype=torch.long), "document_ids": docs},
                         rank, world)["ring_layout"]
    idx = shard_index(s, rank, world)
    ql, kl, vl = (t[:, idx].clone().requires_grad_() for t in (q, k, v))
    ring = RingAttention(None, sliding_backend=sliding_backend)
    if checkpointed:  # backward re-runs the ring's forward (the recompute of activation checkpointing)
        call = (lambda *a: ring.sliding(*a, cfg["window"])) if cfg["window"] else ring.full
        out = checkpoint(call, ql, kl, vl, layout, scale, use_reentrant=False)
    elif cfg["window"]:
        with fa4.cpu_stand_in(sliding_backend == "fa4"):  # FA4's varlen ops through their reference kernels
            out = ring.sliding(ql, kl, vl, layout, scale, cfg["window"])
    else:
        out = ring.full(ql, kl, vl, layout, scale)
    (out * grad[:, idx]).sum().backward()

    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref = reference(qr, kr, vr, docs, scale, cfg["window"])  # raw ids: independent of the run numbering
    (ref * grad).sum().backward()
    tol = dict(atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(unshard(out.detach(), rank, world), ref.detach(), **tol)
    for mine, theirs in ((ql, qr), (kl, kr), (vl, vr)):
        torch.testing.assert_close(unshard(mine.grad, rank, world), theirs.grad, **tol)
    if all_pad_rank == rank:
        assert torch.count_nonzero(out) == 0 and torch.count_nonzero(kl.grad) == 0
    if flex:  # the Flex paths (GPU: sliding layers, and the flex-ring baseline) agree, forward only on CPU
        flex_ring = RingAttention(None, block_ops="flex", sliding_backend="flex")
        with torch.no_grad():
            args = (ql.detach(), kl.detach(), vl.detach(), layout, scale)
            got = flex_ring.sliding(*args, cfg["window"]) if cfg["window"] else flex_ring.full(*args)
        torch.testing.assert_close(got, out.detach(), **tol)
    return ring.stats


def _worker(rank, world, s):
    # One spawn per world size: each process pays the one-time import/dispatch cost once.
    stats = {}
    for name in ("causal", "packed", "sliding", "sliding_long"):
        stats[name] = _check_case(rank, world, name, s, flex=(name in ("sliding", "packed") and world == 2))
    # causal without documents runs dense blocks only (and cp - 1 K/V shifts); packed documents need varlen
    assert set(stats["causal"]) == {"block_dense", "shift"} and stats["causal"]["shift"] == world - 1, stats["causal"]
    assert stats["packed"]["block_varlen"] > 0, stats["packed"]
    assert stats["sliding"]["sliding_halo"] == 1 and stats["sliding_long"]["sliding_allgather"] == 1
    for name in ("sliding", "sliding_long"):  # the ring's sliding layers through FA4's varlen kernel
        assert _check_case(rank, world, name, s, sliding_backend="fa4")["sliding_fa4"] == 1
    if world == 2:
        _check_recompute_and_fallback(rank, world, s, stats)
        _check_case(rank, world, "packed", 16 * world, all_pad_rank=1)
        _check_case(rank, world, "d512", 8 * world)


def _check_recompute_and_fallback(rank, world, s, stats):
    """Under checkpointing the ring's stats counted the recompute's blocks and halos again (`selective` read like
    `full`); now forward counts are the forward's, and the exchanges the recompute repeats are counted apart.
    Unforced on CPU the ring's blocks ran the reference kernel with no reason counted and no warning."""
    for name, exchange in (("packed", "shift"), ("sliding", "sliding_halo")):
        got = _check_case(rank, world, name, s, checkpointed=True)
        assert got == {**stats[name], f"recompute_{exchange}": stats[name][exchange]}, (name, got, stats[name])
    attention.reset_dispatch_counts()
    with kernels.force_kernel(None), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            _check_case(rank, world, "causal", s)
    said = [str(w.message) for w in caught if issubclass(w.category, attention.FFPAFallbackWarning)]
    assert attention.fallback_counts() == {"ring_kernel_unavailable": 2}, attention.fallback_counts()
    assert len(said) == 1 and said[0].startswith("'ffpa' attention fallback (ring_kernel_unavailable): "), said
    assert "the ring's blocks run the fp32 reference kernel" in said[0], said


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 4])
def test_ring_matches_single_device(world):
    """causal, packed, sliding (halo + all-gather); with world=2 also an all-padding shard and D=512."""
    spawn(_worker, world, 16 * world)
