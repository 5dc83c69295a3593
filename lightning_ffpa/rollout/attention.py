"""The paged flex attention function HF decoder layers call during rollouts, and its kernel options.

Owns: the per-step context the engine passes in place of `attention_mask`, the attention function
registered as `ATTENTION_NAME`, and the override store of flex kernel options (the shipped table is
`lightning_ffpa.flex_options`, shared with training). It does not build masks
(`masks.py`) nor write the KV cache (`kv_cache.py`: HF calls `cache.update` before attention).

Kernel options are validated, not assumed: `tests/rollout/test_rollout_kernel_options.py` checks every option
set here against SDPA on scrambled page layouts with padded rows (CPU eager and GPU compiled).
We never enable `ROWS_GUARANTEED_SAFE` (padded decode rows are fully masked and give NaN with it) nor
`BLOCKS_ARE_CONTIGUOUS` (pages of a sequence are not physically consecutive); the GPU test re-checks
both hazards and fails if either is ever added while unsafe.

Overrides: `set_kernel_options(head_dim, decode, options)` (or `load_kernel_options(path)` on the JSON that
`benchmarks/rollout_attention.py` writes, which checks every candidate against `dense_reference` on the
engine's page layouts) replaces the built-in options for one (head_dim, phase, dtype) without code edits.
Keys are checked against the options flex reads for that phase, and the two unsafe options are refused.
Set them before the engine runs: a captured CUDA graph keeps the kernels it was captured with.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from lightning_ffpa._compat.transformers import register_attention
from lightning_ffpa.attention.reference import dense_reference  # noqa: F401 - its old home; the registry's "reference"
from lightning_ffpa.dtypes import parse_dtype
from lightning_ffpa.flex_options import flex_kernel_options

ATTENTION_NAME = "lightning_ffpa_paged"

UNSAFE_OPTIONS = ("ROWS_GUARANTEED_SAFE", "BLOCKS_ARE_CONTIGUOUS")


# What flex's Triton templates read (torch/_inductor/kernel/flex/flex_decoding.py, flex_attention.py);
# anything else is a typo that flex would ignore or a knob we have not validated.
DECODE_OPTION_KEYS = ("BLOCK_N", "BLOCK_M", "num_stages", "num_warps", "SPLIT_KV", "USE_TMA", "PRESCALE_QK")
PREFILL_OPTION_KEYS = ("BLOCK_M", "BLOCK_N", "num_stages", "num_warps", "USE_TMA", "PRESCALE_QK")
_BOOL_KEYS = ("USE_TMA", "PRESCALE_QK")

# (head_dim, decode, dtype) -> options; None is a valid override (flex's defaults). Empty: built-ins only.
_OVERRIDES: dict[tuple[int, bool, torch.dtype], dict[str, Any] | None] = {}


def _fit_block_n(options: dict[str, Any] | None, kv_block: int | None) -> dict[str, Any] | None:
    """Halve BLOCK_N until it divides the decode masks' KV block."""
    if options is None or kv_block is None or "BLOCK_N" not in options:
        return options
    block_n = options["BLOCK_N"]
    while block_n > 1 and kv_block % block_n:
        block_n //= 2
    return {**options, "BLOCK_N": block_n}


def builtin_kernel_options(head_dim: int, decode: bool, dtype: torch.dtype = torch.bfloat16,
                           kv_block: int | None = None) -> dict[str, Any] | None:
    """The shipped flex kernel options for one head_dim, phase and dtype (`lightning_ffpa.flex_options`), with
    BLOCK_N fitted to the decode masks' KV block (None: flex's defaults)."""
    options = flex_kernel_options(head_dim, "decode" if decode else "prefill", dtype)
    return _fit_block_n(options, kv_block) if decode else options


def kernel_options(head_dim: int, decode: bool, dtype: torch.dtype = torch.bfloat16,
                   kv_block: int | None = None) -> dict[str, Any] | None:
    """Flex kernel options the engine uses: an override set for this key, else the built-in ones.

    With `kv_block` (the decode masks' KV block), an override whose BLOCK_N does not divide it raises (flex would
    fail to lower).
    """
    key = (head_dim, decode, dtype)
    if key not in _OVERRIDES:
        return builtin_kernel_options(head_dim, decode, dtype, kv_block)
    options = _OVERRIDES[key]
    if options is None:
        return None
    if kv_block is not None and kv_block % options.get("BLOCK_N", 1):
        raise ValueError(f"kernel option `BLOCK_N={options['BLOCK_N']}` set for head_dim {head_dim} must divide "
                         f"the decode KV block (`kv_block_size={kv_block}`)")
    return dict(options)


def validate_kernel_options(options: dict[str, Any] | None, decode: bool) -> dict[str, Any] | None:
    """Return a copy of `options` after checking names and values; raise ValueError naming the bad one."""
    if options is None:
        return None
    if not isinstance(options, dict):
        raise ValueError(f"kernel options must be a dict or None, got {type(options).__name__}")
    unsafe = sorted(set(options) & set(UNSAFE_OPTIONS))
    if unsafe:
        raise ValueError(f"kernel option(s) {unsafe} are refused: ROWS_GUARANTEED_SAFE gives NaN on padded decode "
                         "rows and BLOCKS_ARE_CONTIGUOUS is wrong on scrambled pages")
    known = DECODE_OPTION_KEYS if decode else PREFILL_OPTION_KEYS
    phase = "decode" if decode else "prefill"
    for name, value in options.items():
        if name not in known:
            raise ValueError(f"kernel option `{name}` is not a known {phase} option; choose from {list(known)}")
        if name in _BOOL_KEYS:
            if not isinstance(value, bool):
                raise ValueError(f"kernel option `{name}={value!r}` must be a bool")
        elif isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"kernel option `{name}={value!r}` must be a positive int")
    return dict(options)


def set_kernel_options(head_dim: int, decode: bool, options: dict[str, Any] | None,
                       dtype: torch.dtype = torch.bfloat16) -> None:
    """Override the options for one (head_dim, phase, dtype); `options=None` selects flex's defaults."""
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 1:
        raise ValueError(f"`head_dim={head_dim!r}` must be a positive int")
    _OVERRIDES[(head_dim, decode, dtype)] = validate_kernel_options(options, decode)


def reset_kernel_options() -> None:
    """Drop every override: back to the built-in options."""
    _OVERRIDES.clear()


def kernel_option_overrides() -> list[dict[str, Any]]:
    """The overrides in force, in the JSON form `load_kernel_options` reads."""
    return [{"head_dim": d, "decode": dec, "dtype": str(dt).removeprefix("torch."), "options": opts}
            for (d, dec, dt), opts in _OVERRIDES.items()]


def load_kernel_options(path: str | Path) -> list[dict[str, Any]]:
    """Apply overrides from a JSON list of {head_dim, decode, dtype, options}, or from a result file of
    `benchmarks/rollout_attention.py` (its `summary.kernel_options`). All entries are checked before any applies.
    """
    data = json.loads(Path(path).read_text())
    entries = data["summary"]["kernel_options"] if isinstance(data, dict) and "summary" in data else data
    if not isinstance(entries, list):
        raise ValueError(f"{path}: expected a list of kernel-option entries or a rollout_attention result")
    parsed = []
    for i, e in enumerate(entries):
        dtype = parse_dtype(f"{path}[{i}].dtype", e.get("dtype", "bfloat16"), allow_auto=False)
        decode = bool(e["decode"])
        parsed.append((int(e["head_dim"]), decode, validate_kernel_options(e["options"], decode), dtype))
    for head_dim, decode, options, dtype in parsed:
        set_kernel_options(head_dim, decode, options, dtype)
    return entries


@dataclass
class StepContext:
    """What every layer needs for one forward: masks by sliding window (None = full) and the flex op."""

    masks: dict[int | None, BlockMask]
    decode: bool
    flex: Callable = flex_attention
    options: Callable[..., dict[str, Any] | None] = kernel_options
    calls: dict[str, int] = field(default_factory=dict)  # per-window call counts (tests count layers)
    kv_block: int | None = None  # decode: the masks' KV block, which BLOCK_N must divide


def paged_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: StepContext, scaling: float | None = None, dropout: float = 0.0,
                    sliding_window: int | None = None, softcap: float | None = None, **kwargs: Any):
    """HF attention interface over paged KV: q (B,Hq,S,D); k/v (1,Hkv,pool,D) in decode, packed in prefill."""
    ctx = attention_mask
    if not isinstance(ctx, StepContext):
        raise TypeError(f"{ATTENTION_NAME} needs the rollout engine's StepContext, got {type(ctx).__name__}")
    window = sliding_window if sliding_window is not None else getattr(module, "sliding_window", None)
    block_mask = ctx.masks[window]
    key_name = "sliding" if window is not None else "full"
    ctx.calls[key_name] = ctx.calls.get(key_name, 0) + 1
    score_mod = None
    if softcap is not None:
        def score_mod(score, b, h, q_idx, kv_idx):  # noqa: ARG001 - flex's score_mod signature
            return softcap * torch.tanh(score / softcap)
    out = ctx.flex(query, key, value, score_mod=score_mod, block_mask=block_mask, scale=scaling,
                   enable_gqa=query.shape[1] != key.shape[1],
                   kernel_options=ctx.options(query.shape[-1], ctx.decode, query.dtype, kv_block=ctx.kv_block))
    return out.transpose(1, 2), None  # (B, S, H, D)


register_attention(ATTENTION_NAME, paged_attention)
