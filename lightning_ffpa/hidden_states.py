"""Final hidden states of an HF causal LM for the fused loss: find the CausalLM, run its decoder.

Owns: finding the CausalLM (`PeftModel.model` is the whole `*ForCausalLM`, not its decoder), the root-level
`forward_hidden_states` method that `parallelize` registers as an FSDP2 forward method, and
`causal_lm_hidden_states`, which the loss path calls, and `head_operands`, the lm_head's weight (a LoRA adapter
on it included) for the chunked loss and log-probs. Does not own the loss math (`loss.py`) or sharding
(`parallel/fsdp.py` installs and registers the method; this file only defines it).
"""

from __future__ import annotations

import torch
from torch import nn

from lightning_ffpa.lora import unwrap_peft

__all__ = ["HIDDEN_STATES_METHOD", "find_causal_lm", "install_hidden_states_method", "causal_lm_hidden_states",
           "head_operands"]

HIDDEN_STATES_METHOD = "forward_hidden_states"


def find_causal_lm(model: nn.Module) -> nn.Module | None:
    """The HF `*ForCausalLM` / `*ForConditionalGeneration` in `model` (peft wrappers removed), or None.

    Why not `model.model`: peft forwards attribute lookups through its wrappers, so on a `PeftModel`
    `.model` is the whole CausalLM (whose output has no `last_hidden_state`), not its decoder.
    """
    base = unwrap_peft(model)
    decoder = base._modules.get("model")  # a real child, not an attribute peft forwards
    if isinstance(decoder, nn.Module) and isinstance(getattr(base, "lm_head", None), nn.Module):
        return base
    return None


def _decoder_hidden_states(causal_lm: nn.Module, inputs: dict) -> torch.Tensor:
    # A KV cache in training would grow again in every AC recompute: off unless asked for.
    inputs.setdefault("use_cache", False)
    return causal_lm.model(**inputs).last_hidden_state  # (B, S, H)


def install_hidden_states_method(model: nn.Module) -> bool:
    """Give `model` (a CausalLM or its peft wrapper) a method returning final hidden states; False if not a CausalLM.

    The fused loss needs `lm_head.weight` unsharded while it runs, which FSDP2 guarantees only inside a
    root forward; `parallelize` registers this method as an FSDP forward method of the root it shards,
    so calling it runs the root's hooks. Installed on the root (the peft wrapper, if any), it calls the
    decoder of the CausalLM inside.
    """
    causal_lm = find_causal_lm(model)
    if causal_lm is None:
        return False

    def forward_hidden_states(**inputs) -> torch.Tensor:
        return _decoder_hidden_states(causal_lm, inputs)

    setattr(model, HIDDEN_STATES_METHOD, forward_hidden_states)
    return True


def causal_lm_hidden_states(model: nn.Module, **inputs) -> torch.Tensor:
    """Final hidden states (B, S, H) of an HF CausalLM (plain or peft-wrapped), sharded by `parallelize` or not."""
    method = getattr(model, HIDDEN_STATES_METHOD, None)
    if method is not None:
        return method(**inputs)
    if any(hasattr(p, "to_local") for p in model.parameters()):  # sharded, but not the root we wrapped
        raise RuntimeError(
            f"causal_lm_hidden_states got a sharded {type(model).__name__} without the root hook: pass the module "
            "given to `parallelize` (the FSDP root), not an inner or unwrapped one"
        )
    causal_lm = find_causal_lm(model)
    if causal_lm is None:
        raise TypeError(f"causal_lm_hidden_states needs an HF CausalLM (`.model` decoder and `.lm_head`), "
                        f"got {type(model).__name__}")
    return _decoder_hidden_states(causal_lm, inputs)


def head_operands(lm_head: nn.Module, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden', weight') with hidden' @ weight'.T equal to `lm_head(hidden)`, for the chunked loss and log-probs.

    A plain head gives (hidden, weight). A peft LoRA adapter on the head (`target_modules: [lm_head]`) joins
    as extra columns: [hidden, s * A(dropout(hidden))] @ [W0, B].T = W0 x + s B A x, peft's own forward, so the
    adapter trains; reading `weight` alone would skip it. The joined weight is a (V, H + r) copy made per call
    (a second head's worth of memory at 262k vocab), the price of this opt-in target.
    """
    from peft.tuners.lora import LoraLayer

    if not isinstance(lm_head, LoraLayer) or lm_head.disable_adapters or lm_head.merged:
        return hidden, lm_head.weight  # peft's `weight` is the base layer's (with any merged delta)
    base = lm_head.get_base_layer().weight
    feats, cols = [hidden], [base]
    for name in lm_head.active_adapters:
        if name not in lm_head.lora_A:
            continue
        if lm_head.use_dora.get(name) or lm_head.lora_B[name].bias is not None:
            raise NotImplementedError(f"the chunked lm_head takes plain LoRA adapters; adapter {name!r} uses "
                                      "DoRA or a LoRA bias: use `loss_impl: plain`")
        a = lm_head.lora_A[name]
        x = lm_head.lora_dropout[name](hidden).to(a.weight.dtype)
        feats.append((a(x) * lm_head.scaling[name]).to(hidden.dtype))
        cols.append(lm_head.lora_B[name].weight.to(base.dtype))
    if len(feats) == 1:
        return hidden, base
    return torch.cat(feats, -1), torch.cat(cols, -1)
