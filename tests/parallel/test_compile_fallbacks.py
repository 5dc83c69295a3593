"""A function torch.compile gives up on (past dynamo's recompile limit) is counted, warned about and logged.

Dynamo then runs it eagerly for the rest of the process, saying so in one log line only; the product turns
that into `compile_fallbacks.counts()`, a `CompileFallbackWarning` and the strategy's `compile/fallbacks`.
"""

import functools
import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch._dynamo

from lightning_ffpa import compile_fallbacks
from lightning_ffpa._compat import torch as torch_compat
from lightning_ffpa.compile_fallbacks import CompileFallbackWarning

ROOT = Path(__file__).resolve().parents[2]


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


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.mark.parametrize("dynamo_level", [logging.ERROR, logging.WARNING], ids=["dynamo_silenced", "dynamo_warns"])
def test_a_fallback_is_counted_where_the_user_silenced_dynamo_and_stays_silent_there(low_limit, dynamo_level):
    def tripled(x):
        return x * 3

    dynamo = logging.getLogger("torch._dynamo")
    seen, level = _Records(), dynamo.level
    dynamo.addHandler(seen)
    dynamo.setLevel(dynamo_level)  # e.g. TORCH_LOGS="-dynamo"
    try:
        compile_fallbacks.prepare()
        fn = torch.compile(tripled, dynamic=False)
        with pytest.warns(CompileFallbackWarning, match=r"gave up on 'tripled'"):
            for n in (2, 3, 4, 5):
                fn(torch.ones(n))
    finally:
        dynamo.removeHandler(seen)
        dynamo.setLevel(level)
    assert compile_fallbacks.total() == 1
    dynamo_said = any("hit config." in m for m in seen.messages)
    assert dynamo_said == (dynamo_level <= logging.WARNING)  # dynamo's own line only where the user allows it


@pytest.mark.timeout(300)
def test_strategy_logs_decoder_layers_that_fell_back_to_eager(tmp_path):
    # Four lengths, one graph each per layer variant: the compiled decoder layers pass the limit of 2.
    out = tmp_path / "fallbacks.json"
    proc = subprocess.run([sys.executable, "-m", "tests.parallel._fit_fallbacks", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(out.read_text())
    assert got["total"] >= 1 and got["logged"] == got["total"]
    assert got["warnings"] and all("gave up on" in w for w in got["warnings"])
