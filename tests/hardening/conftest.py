"""Fixtures shared by the hardening tests: one uninterrupted reference run of the tiny config."""

from __future__ import annotations

import pytest
from _helpers import EVERY, MAX_STEPS, read_steps, recorder, start_fit, tiny_config, wait_ok, write_config


@pytest.fixture(scope="session")
def reference_steps(tmp_path_factory) -> dict[int, tuple[str, str]]:
    """{step: (loss hex, batch fingerprint)} of an uninterrupted `lightning-ffpa fit` of the tiny config."""
    root = tmp_path_factory.mktemp("reference")
    log = root / "steps.log"
    cfg = write_config(root / "fit.yaml", tiny_config(root / "ckpt", max_steps=MAX_STEPS, every_n_train_steps=EVERY,
                                                      callbacks=[recorder(log)]))
    wait_ok(start_fit(cfg))
    steps = read_steps(log)
    assert sorted(steps) == list(range(1, MAX_STEPS + 1))
    return steps
