"""The FP8 frozen base of LoRA (`model.lora.base_dtype: fp8`): W0 stored in float8_e4m3fn with one fp32 scale per
output row, and the matmuls that read it.

Owns the weight-only quantisation (rowwise amax scale, saturating cast), `Float8BaseLinear` (what each LoRA
target's `base_layer` becomes: a frozen float8 weight, its scales, the Linear's bias), the matmul path of each call
(`scaled_mm`: FP8 tensor cores through `torch._scaled_mm` with rowwise scales, CUDA capability >= 8.9; or
`dequantize`: W0 made in the compute dtype for the call and dropped; `dequantize_fallback` on CUDA where the
activations are not bf16 or the dims not multiples of 16), counted per forward call (`attention.counters` group
"fp8_base"; the backward for the input dequantises on every path, measured faster than a scaled_mm backward; the
first call of each path is reported, the fallback's as a warning), `quantize_lora_bases` (the swap over
a peft model, after its weights are loaded) and the device check. The adapters, their optimizer states and the
rest of the model stay in `model.dtype`.

Only the float8 weight and its scales are saved for backward: the dequantised W0 of a call is remade in the
backward for the input (never kept between them), so the base costs its float8 bytes only.

Does not own the option's parsing (`lora.py`), where the swap happens (`HFModule`), the export's dequantisation
(`export.py`) or the rollout engine's reading of the same bytes (`rollout/lora_linear.py`).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lightning_ffpa._compat.torch import scaled_mm
from lightning_ffpa.attention import counters
from lightning_ffpa.errors import ConfigError
from lightning_ffpa.lora import BASE_DTYPES, hf_name  # noqa: F401 - BASE_DTYPES re-exported

__all__ = ["OPTION", "BASE_DTYPES", "FP8_DTYPE", "Float8BaseLinear", "quantize_rowwise", "dequantize", "base_linear",
           "matmul_path", "check_device", "force_dequantize", "quantize_lora_bases", "scale_of", "as_dtype", "path_counts"]

OPTION = "model.lora.base_dtype"
FP8_DTYPE = torch.float8_e4m3fn
MIN_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada (SM89), Hopper (SM90) and later
_DIM_MULTIPLE = 16  # torch._scaled_mm needs K and N divisible by 16
SCALE_ATTR = "_fp8_scale"  # the float8 weight Parameter's own reference to its scales (rollout, export helpers)
COUNTER = "fp8_base"


def quantize_rowwise(w: torch.Tensor, dtype: torch.dtype = FP8_DTYPE) -> tuple[torch.Tensor, torch.Tensor]:
    """`w` (rows, cols) as float8 `q` and fp32 `scale` (rows,) with w ~= q * scale[:, None].

    Each row's amax maps to the float8 maximum (448 for e4m3); a zero row gets scale 1. The cast saturates
    (clamped to +-max first: float8_e4m3fn has no infinity, an overflow would be NaN)."""
    fmax = torch.finfo(dtype).max
    wf = w.detach().float()
    amax = wf.abs().amax(dim=-1)  # (rows,)
    scale = torch.where(amax > 0, amax / fmax, torch.ones_like(amax))
    q = (wf / scale.unsqueeze(-1)).clamp(-fmax, fmax).to(dtype)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q * scale[:, None] in `dtype` (the product in fp32, one rounding to `dtype`)."""
    return (q.float() * scale.float().unsqueeze(-1)).to(dtype)


def matmul_path(device: torch.device) -> tuple[str, str]:
    """(path, why) the float8 base's matmuls take on `device`; raises ConfigError on a CUDA GPU without FP8."""
    if device.type != "cuda":
        return "dequantize", f"{device.type}: no FP8 tensor cores, W0 dequantised to the compute dtype per call"
    cap = torch.cuda.get_device_capability(device)
    if cap < MIN_CAPABILITY:
        raise ConfigError(OPTION, "fp8", f"needs FP8 tensor cores (CUDA capability >= 8.9) for its scaled_mm path; "
                                         f"{torch.cuda.get_device_name(device)} has {cap[0]}.{cap[1]}: set "
                                         "base_dtype model")
    return "scaled_mm", f"capability {cap[0]}.{cap[1]}: torch._scaled_mm with rowwise scales (bf16 inputs)"


def check_device(lora: dict[str, Any] | None, device: torch.device) -> None:
    """Refuse `base_dtype: fp8` on a CUDA GPU below capability 8.9 (before the model is built)."""
    if (lora or {}).get("base_dtype") == "fp8":
        matmul_path(device)


_force_dequantize = False  # `force_dequantize`: benchmarks and tests time or check the other path on the same GPU


@contextlib.contextmanager
def force_dequantize(on: bool = True) -> Iterator[None]:
    """Inside, every base matmul takes the dequantise path (counted as `dequantize_fallback` on CUDA)."""
    global _force_dequantize
    saved, _force_dequantize = _force_dequantize, on
    try:
        yield
    finally:
        _force_dequantize = saved


def _fits_scaled_mm(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (not _force_dequantize and x.is_cuda and x.dtype == torch.bfloat16
            and weight.shape[0] % _DIM_MULTIPLE == 0 and weight.shape[1] % _DIM_MULTIPLE == 0)


def _scaled_mm_forward(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])  # (M, K)
    xq, xs = quantize_rowwise(x2)
    y = scaled_mm(xq, weight.t(), xs.unsqueeze(1), scale.unsqueeze(0), x.dtype)  # W0ᵀ (K, N) is column-major
    return y.view(*x.shape[:-1], weight.shape[0])


class _BaseMatmul(torch.autograd.Function):
    """x @ W0ᵀ over the float8 W0; saves only W0's float8 bytes and scales, and returns no grad for them."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, fast: bool) -> torch.Tensor:
        ctx.save_for_backward(weight, scale)
        if fast:
            return _scaled_mm_forward(x, weight, scale)
        return F.linear(x, dequantize(weight, scale, x.dtype))

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        weight, scale = ctx.saved_tensors
        # Dequantised on every path: at the 31B shapes on an H100 it took 14.7 ms summed against 19.8 ms for a
        # scaled_mm backward (dy*s cast to e4m3 from an fp32 copy of dy, W0 copied column-major), and it makes no
        # fp32 copy of dy (756 MiB for one MLP of a 9k-token micro-batch; benchmarks/results/fp8_base_matmul_h100.json)
        return dy @ dequantize(weight, scale, dy.dtype), None, None, None


PATHS = {
    "scaled_mm": "torch._scaled_mm with rowwise scales",
    "dequantize": "W0 dequantised to the compute dtype: no FP8 tensor cores on this device",
    "dequantize_fallback": "W0 dequantised on a CUDA device: activations not bf16, or weight dims not multiples of 16",
}


def _report_first(path: str) -> None:
    """Say once per path that it ran (a warning for the CUDA fallback); runs from the counter, compiled too."""
    text = f"lora.base_dtype fp8: a base matmul ran on the {path} path ({PATHS.get(path, path)})"
    if path == "dequantize_fallback":
        warnings.warn(text, stacklevel=2)
    else:
        from lightning.pytorch.utilities import rank_zero_info

        rank_zero_info(text)


counters.on_first(COUNTER, _report_first)


def base_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ (q * scale)ᵀ + bias on the fastest path for `x` (counted; see the module docstring)."""
    fast = _fits_scaled_mm(x, weight)
    counters.count(COUNTER, "scaled_mm" if fast else "dequantize_fallback" if x.is_cuda else "dequantize", x)
    y = _BaseMatmul.apply(x, weight, scale, fast)
    return y if bias is None else y + bias


def path_counts() -> dict[str, int]:
    """Forward calls of float8-base linears per path since the counters were last reset."""
    return counters.counts(COUNTER)


class Float8BaseLinear(nn.Module):
    """A frozen Linear whose weight is float8_e4m3fn (out, in) with fp32 `weight_scale` (out,): a LoRA target's base."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = nn.Parameter(weight, requires_grad=False)  # (out, in) float8
        self.weight_scale = nn.Parameter(scale, requires_grad=False)  # (out,) fp32
        self.bias = bias if bias is None or isinstance(bias, nn.Parameter) else nn.Parameter(bias, requires_grad=False)
        self._link_scale()

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Float8BaseLinear:
        """Quantise `linear`'s weight (its bias kept as it is)."""
        q, scale = quantize_rowwise(linear.weight)
        return cls(q, scale, linear.bias)

    def _link_scale(self) -> None:
        self.weight.__dict__[SCALE_ATTR] = self.weight_scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return base_linear(x, self.weight, self.weight_scale, self.bias)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True):
        # `.to(dtype)` (a precision plugin's `module.to(bfloat16)`, `.half()`) casts every floating tensor, float8
        # included: the float8 bytes and fp32 scales move to the new device but keep their dtype.
        def keep_dtype(t: torch.Tensor) -> torch.Tensor:
            out = fn(t)
            if out.dtype == t.dtype or t.is_meta or t is self.bias:
                return out
            return t.to(device=out.device)

        out = super()._apply(keep_dtype, recurse)
        self._link_scale()
        return out

    def _load_from_state_dict(self, *args, **kwargs) -> None:
        super()._load_from_state_dict(*args, **kwargs)
        self._link_scale()  # `load_state_dict(assign=True)` gives new Parameters

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, weight=float8_e4m3fn rowwise"


def scale_of(weight: torch.Tensor) -> torch.Tensor | None:
    """The rowwise scales of a `Float8BaseLinear`'s weight, None for any other tensor."""
    return weight.__dict__.get(SCALE_ATTR) if weight.dtype == FP8_DTYPE else None


def as_dtype(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`weight` in `dtype`: dequantised when it is a float8 base weight, else cast."""
    scale = scale_of(weight)
    return weight.to(dtype) if scale is None else dequantize(weight, scale, dtype)


def quantize_lora_bases(model: nn.Module, option: str = OPTION) -> dict[str, Any]:
    """Replace the `base_layer` Linear of every peft LoRA layer of `model` by its `Float8BaseLinear`, in place.

    Call after the base weights are final (loaded or drawn). Returns what happened, for the start-up line:
    {"converted": n, "fp8_bytes": ..., "was_bytes": ..., "was_dtype": ...}. A LoRA target that is not an
    nn.Linear (an embedding) is refused: its base would silently stay in high precision; so is one whose weight is
    tied to another module's (a tied lm_head): its float8 copy would untie them."""
    from peft.tuners.lora import LoraLayer

    converted, fp8_bytes, was_bytes, was_dtype = 0, 0, 0, None
    uses: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        uses[id(p)] = uses.get(id(p), 0) + 1
    for name, module in model.named_modules():
        if not isinstance(module, LoraLayer):
            continue
        base = module.base_layer
        if isinstance(base, Float8BaseLinear):
            continue
        if type(base) is not nn.Linear:
            raise ConfigError(option, "fp8", f"stores Linear LoRA targets only; {hf_name(name)} adapts a "
                                             f"{type(base).__name__}: drop it from target_modules or set "
                                             "base_dtype model")
        if uses.get(id(base.weight), 0) > 1:  # a tied head: a float8 copy would untie it from the embedding
            raise ConfigError(option, "fp8", f"cannot store {hf_name(name)}'s base in float8: its weight is tied to another "
                                             "module's (the embedding); drop it from target_modules or set base_dtype "
                                             "model")
        was_dtype = base.weight.dtype
        was_bytes += base.weight.numel() * base.weight.element_size()
        fp8 = Float8BaseLinear.from_linear(base)
        module.base_layer = fp8
        fp8_bytes += sum(t.numel() * t.element_size() for t in (fp8.weight, fp8.weight_scale))
        converted += 1
    if not converted:
        raise ConfigError(option, "fp8", "found no LoRA Linear layer to store in float8")
    return {"converted": converted, "fp8_bytes": fp8_bytes, "was_bytes": was_bytes,
            "was_dtype": str(was_dtype).removeprefix("torch.")}


def describe(report: dict[str, Any], device: torch.device) -> str:
    """The start-up line: what was stored in float8 and which matmul path runs on `device`."""
    path, why = matmul_path(device)
    return (f"lora.base_dtype fp8: {report['converted']} LoRA base weights stored as float8_e4m3fn with rowwise fp32 "
            f"scales ({report['fp8_bytes'] / 2**20:.1f} MiB; {report['was_bytes'] / 2**20:.1f} MiB as "
            f"{report['was_dtype']}); matmul path: {path} ({why})")
