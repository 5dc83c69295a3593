"""Fixtures of the parallel tests: `aot_eager_compile`, so that `parallelize(compile=True)` compiles in seconds."""

import functools

import pytest
import torch
import torch._dynamo


@pytest.fixture
def aot_eager_compile(monkeypatch):
    """`parallelize(compile=True)` compiles with dynamo + AOT autograd only (seconds instead of a minute): where
    graph breaks, guards, the SAC partition and dead-code elimination happen; inductor adds only codegen."""
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
