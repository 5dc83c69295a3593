"""Dtype options: the one parser of dtype strings, shared by every option that names a dtype.

Owns the accepted spellings (`bf16`/`bfloat16`, `fp16`/`float16`, `fp32`/`float32`, and `auto` where the option
allows it) and what `auto` means (bf16 on a CUDA device that supports it, else fp32). Raises `ConfigError`
naming the option as the user spells it. Does not own which dtype a component should use by default.
"""

from __future__ import annotations

from typing import Literal

import torch

from lightning_ffpa.errors import ConfigError

__all__ = ["AUTO", "DTYPE_NAMES", "DtypeName", "DtypeOrAuto", "auto_dtype", "choices", "parse_dtype"]

AUTO = "auto"
DTYPE_NAMES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16,
    "fp32": torch.float32, "float32": torch.float32,
}
# For signatures that jsonargparse reads (LightningCLI checks the value and lists the choices in --help).
DtypeName = Literal["bf16", "bfloat16", "fp16", "float16", "fp32", "float32"]
DtypeOrAuto = Literal["auto", "bf16", "bfloat16", "fp16", "float16", "fp32", "float32"]


def auto_dtype() -> torch.dtype:
    """bf16 where the device supports it (CUDA with bf16), else fp32."""
    bf16 = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    return torch.bfloat16 if bf16 else torch.float32


def choices(*, allow_auto: bool = True, allow_none: bool = False) -> list[str]:
    """The accepted spellings, as an error message lists them."""
    names = ([AUTO] if allow_auto else []) + list(DTYPE_NAMES)
    return names + (["null"] if allow_none else [])


def parse_dtype(option: str, value: str | torch.dtype | None, *, allow_auto: bool = True,
                allow_none: bool = False) -> torch.dtype | None:
    """The torch dtype `value` names (a torch.dtype passes through); ConfigError naming `option` otherwise."""
    if value is None and allow_none:
        return None
    if isinstance(value, torch.dtype) and value in DTYPE_NAMES.values():
        return value
    if isinstance(value, str):
        if value == AUTO and allow_auto:
            return auto_dtype()
        if value in DTYPE_NAMES:
            return DTYPE_NAMES[value]
    raise ConfigError(option, value, f"must be one of {choices(allow_auto=allow_auto, allow_none=allow_none)}")
