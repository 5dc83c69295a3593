"""What in a model keeps its decode step out of a CUDA graph, found before any capture.

A captured step must not wait on the host. HF's MoE experts do in two cases: `experts_implementation="eager"`
reads the routed expert ids on the host (`nonzero`, then a loop over them; transformers' `integrations/moe.py`), and
"grouped_mm" with weights that are not bf16 falls back to a loop over the group offsets read on the host, both
compiled (transformers' `offs.tolist()`) and eager (torch's `_grouped_mm` fallback copies `offs` to the CPU: a
float32 26B-A4B decode on an H100 failed so, `benchmarks/GPU_RUNS.md`). Either fails mid-capture, after the model
and the pools are built; `check_capture` refuses it first, naming `cuda_graphs`.
"""

from __future__ import annotations

import torch
from torch import nn

from lightning_ffpa._compat.transformers import experts_implementation
from lightning_ffpa.errors import ConfigError


def capture_blockers(model: nn.Module) -> list[str]:
    """One line per MoE experts module whose forward would wait on the host inside the decode step."""
    out = []
    for name, module in model.named_modules():
        weight = getattr(module, "gate_up_proj", None)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 3:  # experts keep 3-D (expert, out, in) weights
            continue
        impl = experts_implementation(module)
        if impl == "eager":
            out.append(f"{name}: experts_implementation='eager' reads the routed experts on the host")
        elif impl == "grouped_mm" and weight.dtype != torch.bfloat16:
            out.append(f"{name}: grouped_mm with {weight.dtype} weights falls back to a host loop")
    return out


def check_capture(model: nn.Module, device: torch.device, cuda_graphs: bool, option: str = "engine") -> None:
    """Raise ConfigError naming `<option>.cuda_graphs` when the decode step would be captured on CUDA and a part
    of the model cannot be."""
    if device.type != "cuda" or not cuda_graphs:
        return
    blockers = capture_blockers(model)
    if blockers:
        more = f" (and {len(blockers) - 1} more)" if len(blockers) > 1 else ""
        raise ConfigError(f"{option}.cuda_graphs", True,
                          f"the decode step cannot be captured: {blockers[0]}{more}; load the model in bf16 with "
                          f"experts_implementation='grouped_mm', or set `{option}.cuda_graphs: false`")
