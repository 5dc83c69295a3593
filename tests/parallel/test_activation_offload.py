"""Activation offload: saved activations go to host memory and come back unchanged; parameters stay put.

CPU runs the real hooks with the host copy made from CPU tensors (`device_type="cpu"`); the GPU test in
`test_gpu.py` checks the memory it saves.
"""

import contextlib

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_ffpa.parallel import FSDP2Strategy
from lightning_ffpa.parallel.activation_offload import ActivationOffload


class _Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


def _grads(blocks, x, offload: ActivationOffload | None, ac: bool):
    for p in blocks.parameters():
        p.grad = None
    with offload.hooks() if offload else contextlib.nullcontext():
        y = x
        for b in blocks:
            y = checkpoint(b, y, use_reentrant=False) if ac else b(y)
        loss = y.square().mean()
    loss.backward()  # after the context: the hooks were attached when the tensors were saved
    return loss.item(), [p.grad.clone() for p in blocks.parameters()]


@pytest.mark.parametrize("ac", [False, True], ids=["no_ac", "full_ac"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_offloaded_step_matches_and_moves_activations_only(ac, compiled):
    from lightning_ffpa._compat import torch as torch_compat

    torch.manual_seed(0)
    blocks = nn.ModuleList(_Block(32) for _ in range(3))
    if compiled:
        for b in blocks:
            b.compile()
    x = torch.randn(4, 16, 32, requires_grad=True)
    torch_compat.dynamo_counters().clear()
    ref_loss, ref = _grads(blocks, x, None, ac)
    one_input = x.numel() * x.element_size()
    off = ActivationOffload(device_type="cpu", pin_memory=False, min_bytes=one_input)
    loss, got = _grads(blocks, x, off, ac)
    assert loss == ref_loss and all(torch.equal(a, b) for a, b in zip(ref, got))
    stats = off.reset_stats()
    if ac:  # full AC saves one input per block (and the loss saves its own): exactly those move
        assert stats == dict(moved=len(blocks) + 1, moved_bytes=(len(blocks) + 1) * one_input, kept=0)
    else:  # without AC every block's intermediates are saved too (the 4x-wide ones move, weights stay)
        assert stats["moved"] > len(blocks) + 1 and stats["kept"] > 0
    assert off.stats == dict(moved=0, moved_bytes=0, kept=0)
    assert not torch_compat.dynamo_counters()["graph_break"]  # the hooks act at run time, outside the graphs


def test_parameters_and_small_tensors_are_not_moved():
    off = ActivationOffload(device_type="cpu", pin_memory=False, min_bytes=1024)
    weight = nn.Parameter(torch.randn(64, 64))
    assert off._pack(weight) is weight and off._pack(torch.ones(8)) is not None
    big = torch.randn(64, 64)
    packed = off._pack(big)
    assert isinstance(packed, tuple) and torch.equal(off._unpack(packed), big)
    assert off.stats == dict(moved=1, moved_bytes=64 * 64 * 4, kept=2)


def test_offload_on_a_cpu_run_is_refused_before_the_process_group_starts():
    import torch.distributed as dist

    class Plain(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 2)

        def training_step(self, batch, batch_idx):
            return self.lin(batch).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=FSDP2Strategy(activation_offload=True), max_steps=1,
                        logger=False, enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(ValueError, match="`trainer.strategy.init_args.activation_offload=True` moves saved activations from cuda"):
        trainer.fit(Plain(), torch.utils.data.DataLoader(torch.randn(4, 2)))
    assert not dist.is_initialized()


def test_the_strategy_offloads_inside_each_training_step(tmp_path, one_process):
    """A one-process CPU fit through FSDP2Strategy: its training_step runs under the hooks (swapped for CPU ones
    here), the losses equal a fit without them, and the counts show what moved."""

    class Blocks(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.blocks = nn.ModuleList(_Block(16) for _ in range(2))
            self.losses = []

        def configure_model(self):  # sharded here, so the strategy looks for no HF model
            from torch.distributed.fsdp import fully_shard

            for b in self.blocks:
                fully_shard(b, mesh=self.trainer.strategy.parallel_dims.dp_mesh)

        def training_step(self, batch, batch_idx):
            y = batch
            for b in self.blocks:
                y = checkpoint(b, y, use_reentrant=False)
            loss = y.square().mean()
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    def fit(offload: bool):
        strategy = FSDP2Strategy(activation_checkpointing="none", param_dtype=None, reduce_dtype=None)
        if offload:  # what `activation_offload=True` installs, with CPU as the device offloaded from
            strategy._offload = ActivationOffload(device_type="cpu", pin_memory=False, min_bytes=0)
        model = Blocks()
        trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=3, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            default_root_dir=tmp_path)
        trainer.fit(model, torch.utils.data.DataLoader(torch.randn(12, 8, 16), batch_size=4))
        return model.losses, strategy._offload

    import torch.distributed as dist

    try:
        plain, _ = fit(False)
        offloaded, off = fit(True)
    finally:  # the one-process group the strategy started must not leak into later tests
        if dist.is_initialized():
            dist.destroy_process_group()
    assert offloaded == plain and len(plain) == 3
    assert off.stats["moved"] > 0


@pytest.mark.gpu
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_offload_lowers_the_peak_on_gpu_and_changes_no_gradient(compiled):
    """Eight checkpointed blocks on CUDA (bf16, full AC: each saves its input), eager and compiled per block as
    the strategy compiles layers: with offload the inputs wait in pinned host memory, so the peak drops by
    about their size, the gradients are bit-identical, and no weight is moved. Long and narrow, so the saved
    inputs (not the weights' gradients, as at width 2048) set the peak: the last block's forward."""
    torch.manual_seed(0)
    blocks = nn.ModuleList(_Block(256) for _ in range(8)).cuda().bfloat16()
    if compiled:
        for b in blocks:
            b.compile()
    x = torch.randn(1, 262144, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def peak(offload):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        loss, grads = _grads(blocks, x, offload, ac=True)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base, loss, grads

    peak(None)  # compiles (when compiled) outside the measured pair
    plain, ref_loss, ref = peak(None)
    off = ActivationOffload()
    offloaded, loss, got = peak(off)
    inputs = 8 * x.numel() * x.element_size()
    assert loss == ref_loss and all(torch.equal(a, b) for a, b in zip(ref, got))
    assert off.stats["moved"] >= 8 and offloaded < plain - inputs // 2, (plain, offloaded, off.stats)
    one = x.numel() * x.element_size()
    assert off.stats["moved_bytes"] == off.stats["moved"] * one <= 9 * one, off.stats  # inputs and the loss's
