"""Loss and gradient parity of a context-parallel run against an independent CP=1 reference.

Owns the comparison: gradients grouped per decoder-layer part (attention, MLP, norms) plus the embedding and
the final norm; per group the largest absolute difference and the norm-relative difference
``||g_cp - g_ref||_2 / ||g_ref||_2``; the worst group; and the check against tolerances. Does not own how
the gradients were made (``benchmarks/cp_rows.py``) or the summary (``benchmarks/context_parallel.py``).
The norm-relative measure is used because elementwise ratios blow up on near-zero entries.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import Tensor

__all__ = ["grad_parity", "param_group", "parity_failures"]

_LAYER = re.compile(r"layers\.(\d+)\.(.*)")


def param_group(name: str) -> str:
    """The group of a parameter name: ``layers.{i}.{self_attn|mlp|norms|other}``, ``embed_tokens``, ``final_norm``."""
    m = _LAYER.search(name)
    if m:
        rest = m.group(2)
        part = ("self_attn" if rest.startswith("self_attn") else "mlp" if rest.startswith("mlp")
                else "norms" if "norm" in rest else "other")
        return f"layers.{m.group(1)}.{part}"
    if "embed_tokens" in name:
        return "embed_tokens"
    if "lm_head" in name:
        return "lm_head"
    return "final_norm" if "norm" in name else "other"


def grad_parity(ref: dict[str, Tensor], got: dict[str, Tensor]) -> dict[str, Any]:
    """Per-group max |got - ref| and ||got - ref|| / ||ref|| (fp32), the worst group, and any name mismatch.

    A parameter present on one side only is listed under ``missing``/``unexpected`` and makes the result fail
    (``max_rel_l2`` is then infinite): a gradient that was never produced is not a small difference.
    """
    groups: dict[str, dict[str, float]] = {}
    sq: dict[str, list[float]] = {}
    for name in sorted(set(ref) & set(got)):
        a = ref[name].detach().float()
        b = got[name].detach().to(a.device).float()
        if a.shape != b.shape:
            raise ValueError(f"gradient of {name}: shapes differ (ref {tuple(a.shape)}, got {tuple(b.shape)})")
        g = param_group(name)
        acc = sq.setdefault(g, [0.0, 0.0, 0.0])
        diff = b - a
        acc[0] += float(diff.square().sum())
        acc[1] += float(a.square().sum())
        acc[2] = max(acc[2], float(diff.abs().max()) if diff.numel() else 0.0)
        if not torch.isfinite(diff).all():
            acc[0] = float("inf")
    for g, (d2, r2, mx) in sq.items():
        rel = d2 ** 0.5 / r2 ** 0.5 if r2 > 0 else (0.0 if d2 == 0 else float("inf"))
        groups[g] = {"max_abs": mx, "rel_l2": rel, "ref_l2": r2 ** 0.5}
    missing, unexpected = sorted(set(ref) - set(got)), sorted(set(got) - set(ref))
    worst = max(groups, key=lambda g: groups[g]["rel_l2"], default=None)
    max_rel = float("inf") if missing or unexpected else (groups[worst]["rel_l2"] if worst else float("inf"))
    return {"groups": groups, "worst_group": worst, "max_rel_l2": max_rel,
            "max_abs": max((v["max_abs"] for v in groups.values()), default=float("inf")),
            "params_compared": len(set(ref) & set(got)), "missing": missing[:20], "unexpected": unexpected[:20]}


def parity_failures(loss_abs_diff: float, grads: dict[str, Any], loss_tol: float, grad_rel_tol: float) -> list[str]:
    """Why a CP run does not match its reference within the tolerances ([] when it does)."""
    out = []
    if not loss_abs_diff <= loss_tol:  # written so that NaN fails
        out.append(f"loss differs by {loss_abs_diff:.3g} > {loss_tol:.3g}")
    if not grads["max_rel_l2"] <= grad_rel_tol:
        out.append(f"gradient group {grads['worst_group']} differs by {grads['max_rel_l2']:.3g} (relative L2) "
                   f"> {grad_rel_tol:.3g}")
    if grads["missing"] or grads["unexpected"]:
        out.append(f"parameters without a counterpart: missing {grads['missing']}, unexpected {grads['unexpected']}")
    return out
