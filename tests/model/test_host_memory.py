"""A CPU fit whose model's weights alone exceed the machine's available memory is refused before it is built
(following the GPU recipes' hint `--trainer.accelerator cpu`, the 31B preset was killed by the kernel after 93 s,
exit 137, nothing printed). Through the console script: tests/cli/test_console_fit.py."""

import lightning as L
import pytest

from lightning_ffpa import validation
from lightning_ffpa.errors import ConfigError
from lightning_ffpa.module import Gemma4LM

GIB = 2**30


def _cpu_trainer():
    return L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False)


def test_weights_beyond_the_available_memory_are_refused_naming_the_preset(monkeypatch):
    monkeypatch.setattr(validation, "available_host_bytes", lambda: 20 * GIB)
    with pytest.raises(ConfigError, match=r"^`model\.preset='gemma4-31b'`: builds 30\.7B parameters: 57\.2 GiB of "
                                          r"bfloat16 weights alone, more than the 20\.0 GiB"):
        validation.check_fits_host_memory(_cpu_trainer(), Gemma4LM(preset="gemma4-31b", dtype="bfloat16"))
    validation.check_fits_host_memory(_cpu_trainer(), Gemma4LM(preset="tiny"))  # 0.8M parameters: fits
    monkeypatch.setattr(validation, "available_host_bytes", lambda: 64 * GIB)
    validation.check_fits_host_memory(_cpu_trainer(), Gemma4LM(preset="gemma4-31b", dtype="bfloat16"))  # 57 < 64
    monkeypatch.setattr(validation, "available_host_bytes", lambda: None)  # not Linux: no verdict
    validation.check_fits_host_memory(_cpu_trainer(), Gemma4LM(preset="gemma4-31b", dtype="float32"))


def test_the_machines_available_memory_is_read():
    available = validation.available_host_bytes()
    assert available is None or 0 < available < 2**50
