"""A function torch.compile gives up on (past dynamo's recompile limit) is counted, warned about and logged.

Dynamo then runs it eagerly for the rest of the process, saying so in one log line only; the product turns
that into `compile_fallbacks.counts()`, a `CompileFallbackWarning` and the strategy's `compile/fallbacks`.
"""

import functools
import os

import lightning as L
import pytest
import torch
import torch._dynamo

from lightning_ffpa import compile_fallbacks
from lightning_ffpa._compat import torch as torch_compat
from lightning_ffpa.compile_fallbacks import CompileFallbackWarning
from lightning_ffpa.parallel import FSDP2Strategy

from ._fit_tiny import TinyLM  # the plain module the strategy tests fit


@pytest.fixture
def low_limit(monkeypatch):
    """Dynamo keeps 2 graphs per function (the product would raise it to 64) and compiles with "eager"."""
    monkeypatch.setattr(torch_compat, "raise_recompile_limit", lambda limit=64: None)
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    compile_fallbacks.reset()
    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile_limit=2):
        yield
    torch._dynamo.reset()
    compile_fallbacks.reset()


def test_a_function_dynamo_gives_up_on_is_counted_and_warned(low_limit):
    def doubled(x):
        return x * 2

    compile_fallbacks.prepare()
    fn = torch.compile(doubled, dynamic=False)
    with pytest.warns(CompileFallbackWarning, match=r"gave up on 'doubled'.*recompile_limit=2"):
        for n in (2, 3, 4, 5):  # one graph per length: the third length passes the limit
            assert torch.equal(fn(torch.ones(n)), torch.full((n,), 2.0))
    assert compile_fallbacks.total() == 1 and "'doubled'" in next(iter(compile_fallbacks.counts()))


@pytest.fixture
def in_process_group():
    """Lightning's in-process group of one: torn down after, with the env vars it set (the port stays free)."""
    env = dict(os.environ)
    yield
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    os.environ.clear()
    os.environ.update(env)


@pytest.mark.timeout(300)
def test_strategy_logs_decoder_layers_that_fell_back_to_eager(low_limit, in_process_group):
    # Four lengths, one graph each per layer variant: the compiled decoder layers pass the limit of 2.
    batches = [torch.randint(0, 512, (1, n), generator=torch.Generator().manual_seed(n)) for n in (8, 12, 16, 20)]
    strategy = FSDP2Strategy(compile=True, activation_checkpointing="none", param_dtype="fp32", reduce_dtype="fp32")
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=4, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    with pytest.warns(CompileFallbackWarning, match="gave up on"):
        trainer.fit(TinyLM(), torch.utils.data.DataLoader([(ids,) for ids in batches], batch_size=None))
    assert compile_fallbacks.total() >= 1
    assert trainer.logged_metrics["compile/fallbacks"] == compile_fallbacks.total()
