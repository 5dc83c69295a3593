"""The "ffpa" Hugging Face attention backend: registration, mask function, per-call routing, visible fallbacks.

Routing for one attention call (in this order):
1. refusal: context parallel > 1 raises one error pointing to the ring route;
2. packed documents (``documents=`` from ``Gemma4LM.compute_loss``, or ``position_ids`` that restart inside a
   row) replace HF's mask: full layers run FFPA varlen over the document segments, sliding layers get a
   window AND same-document Flex mask (``documents.py``);
3. a Flex ``BlockMask`` (sliding and other non-plain-causal layers) goes to flex (eager if softcap), except a plain
   causal sliding-window mask when the plan's sliding kernel is a registry kernel with windowed attention (FA4)
   that takes the call (else flex, the fallback counted with its reason);
4. an eligible full-attention call goes to FFPA: dense with no mask, varlen with a 2D padding mask;
5. anything else falls back: eager when a softcap is set, otherwise SDPA with repeated KV
   (never ``enable_gqa`` at head_dim > 256, which drops to the MATH kernel).
Every fallback is counted and warned about once per reason, the CP ring's full layers' too
(``note_ring_fallback``). Counting goes through ``counters.py``, so it is taken at runtime once per forward call
in eager and compiled layers alike, and nothing here graph-breaks or recompiles a compiled layer. Kernels live in
``kernels.py``; this file never calls ffpa_attn directly.
"""

from __future__ import annotations

import functools
import warnings
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

from lightning_ffpa import saved_ops
from lightning_ffpa._compat import transformers as hf_compat
from lightning_ffpa.attention import counters, fa4, kernels, masks, registry
from lightning_ffpa.attention.documents import PackedDocuments
from lightning_ffpa.attention.flex import flex_forward

NAME = "ffpa"
PATHS = ("ffpa-dense", "ffpa-varlen", "fa4-dense", "fa4-varlen", "flex", "sdpa", "eager")
CP_ROUTE = ("use context_parallel_size > 1 with the FFPA ring (the attention Callback installs it), "
            "which carries document ids through the ring")


class FFPAFallbackWarning(UserWarning):
    """An attention call left the FFPA path; raised once per reason."""


@dataclass
class FFPABackendConfig:
    """What the "ffpa" backend accepts; anything else falls back visibly."""

    head_dims: tuple[int, ...] = (512,)
    """Head dims routed to FFPA (Gemma4 full-attention layers use 512)."""
    dtypes: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16)
    """Activation dtypes routed to the CuTeDSL kernel (the CPU reference takes any float dtype)."""
    sliding: str = "flex"
    """The sliding layers' kernel: "flex", or a registry kernel with windowed attention ("fa4") tried first, with
    Flex as its counted fallback (set from the attention plan)."""


_config = FFPABackendConfig()
_packed_cache: dict[str, tuple] = {}


def dispatch_counts() -> dict[str, int]:
    """Forward calls per path since the last reset: ffpa-dense, ffpa-varlen, flex, sdpa, eager.

    One count per attention call in a forward pass, eager or compiled; activation-checkpoint
    recomputes are not counted again (see ``counters.py``).
    """
    return {**dict.fromkeys(PATHS, 0), **counters.counts("path")}


def fallback_counts() -> dict[str, int]:
    """Fallback calls per reason since the last reset (e.g. {'dtype': 4})."""
    return counters.counts("reason")


def reset_dispatch_counts() -> None:
    """Zero the path/reason/kernel counters and re-arm the once-per-reason warnings."""
    counters.reset()


def config() -> FFPABackendConfig:
    """The active backend configuration."""
    return _config


def register_ffpa(head_dims: tuple[int, ...] = (512,), sliding: str | None = None) -> None:
    """Register "ffpa" in transformers' attention and mask interfaces (idempotent; updates the config).

    `sliding`: the sliding layers' kernel ("flex", or a registry kernel with windowed attention, e.g. "fa4");
    None keeps the current one. The direct backend runs without context parallelism; CP > 1 goes through the FFPA
    ring (`lightning_ffpa.cp`).
    """
    hf_compat.check_version()
    _config.head_dims = tuple(int(d) for d in head_dims)
    if sliding is not None:
        if sliding != "flex":
            registry.get(sliding, "windowed", option="sliding")
            saved_ops.register(registry.get(sliding).forward_ops())
        _config.sliding = sliding
    hf_compat.register_attention(NAME, ffpa_attention_forward)
    hf_compat.register_mask(NAME, ffpa_mask)
    kernels.register_flop_formulas()
    saved_ops.register(kernels.forward_ops())  # SAC saves the FFPA forwards (its policy knows no kernels)


# --------------------------------------------------------------------------- mask function


def ffpa_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
              mask_function=None, attention_mask: Tensor | None = None, local_size: int | None = None,
              allow_is_causal_skip: bool = True, device: torch.device | str = "cpu", **kwargs):
    """HF mask function: BlockMask for sliding/non-plain-causal layers, 2D bool padding mask or None otherwise."""
    padding = hf_compat.prepare_padding_mask(attention_mask, kv_length, kv_offset)
    plain_causal = local_size is None and allow_is_causal_skip and mask_function is not None
    aligned = isinstance(q_offset, int) and isinstance(kv_offset, int) and q_offset + q_length == kv_offset + kv_length
    if plain_causal and aligned:
        if padding is None:
            return None
        padding = padding[:, kv_offset:kv_offset + kv_length]
        # One host sync per forward (HF's sdpa mask does the same check).
        return None if bool(padding.all()) else padding
    if padding is not None and bool(padding.all()):
        # No row is padded (a data loader's all-ones mask): the window alone stays a plain window a windowed
        # kernel (FA4) can take. One host sync per mask, as for the full layers above.
        padding = None
    if mask_function is None:
        mask_function = masks.generate_causal()
    mod = masks.combine(mask_function, masks.generate_padding(padding) if padding is not None else None)
    block_mask = masks.build_block_mask(masks.with_offsets(mod, q_offset, kv_offset), batch_size, q_length,
                                        kv_length, device)
    # Remember that a padding mask exists: HF only treats position_ids resets as packing without one.
    block_mask._ffpa_padded = padding is not None
    # A whole-model torch.compile called without attention_mask: while tracing HF cannot tell packed rows from plain
    # ones by their position_ids, so it builds a packing mask for every batch (counted as `traced_positions`).
    block_mask._ffpa_traced_positions = (
        attention_mask is None and not allow_is_causal_skip and not kwargs.get("use_vmap", False)
        and q_offset == 0 and kv_offset == 0 and q_length == kv_length and torch.compiler.is_compiling())
    # HF sets use_vmap when a model adds its own or/and mask (e.g. bidirectional image tokens): packed
    # documents would replace that mask, so such a call is refused rather than silently changed.
    block_mask._ffpa_overlay = bool(kwargs.get("use_vmap", False))
    # A causal sliding window and nothing else (no padding, overlay, packing or cache offset): a windowed kernel
    # (FA4) can replace the mask by its window. HF clears allow_is_causal_skip for overlays and packing, and
    # passes it False for bidirectional sliding masks.
    window = (local_size if local_size is not None and allow_is_causal_skip and not block_mask._ffpa_overlay
              and q_offset == 0 and kv_offset == 0 and q_length == kv_length else None)
    block_mask._ffpa_plain_window = window if padding is None else None
    # Padded rows whose tokens are contiguous (left or right padding, a GRPO batch): the same window over each row's
    # tokens, which a windowed kernel's varlen form runs on the unpadded tokens (`_padded_window_forward`).
    # (Its host sync only where a windowed kernel is planned.)
    block_mask._ffpa_padded_window = (
        (padding, window) if window is not None and padding is not None and _config.sliding != "flex"
        and _contiguous(padding) else None)
    return block_mask


def _contiguous(padding: Tensor) -> bool:
    """Whether every row's kept tokens form one run (one host sync)."""
    count = padding.sum(-1, keepdim=True)
    first = padding.int().argmax(-1, keepdim=True)
    pos = torch.arange(padding.shape[-1], device=padding.device)
    return bool((((pos >= first) & (pos < first + count)) == padding).all())


# --------------------------------------------------------------------------- routing


def _fallback_reason(module, query: Tensor, dropout: float, scaling, softcap, sliding_window) -> str | None:
    """Why this full-attention call cannot take FFPA, or None if it can."""
    if softcap:
        return "softcap"
    if sliding_window is not None:
        return "sliding_window"
    if query.shape[-1] not in _config.head_dims:
        return "head_dim"
    if dropout and dropout > 0.0:
        return "dropout"
    if scaling is None:
        return "no_scale"
    if kernels.forced_kernel() == "reference":
        return None  # tests run the exact dispatch code on the CPU reference, any float dtype
    reason = "dtype" if query.dtype not in _config.dtypes else None
    if reason is None and not kernels.cute_supports(query):
        reason = "kernel_unavailable"
    elif reason == "dtype" and registry.get("ffpa").unavailable(query.device):
        reason = "kernel_unavailable"  # no device to run it at all: a bf16 run would fall back too
    if reason is not None and kernels.forced_kernel() == "cutedsl":  # forced: no silent sdpa in its place
        raise RuntimeError(f"force_kernel('cutedsl') but FFPA cannot take this call ({query.dtype} on "
                           f"{query.device.type}): {_REASON_TEXT[reason].removesuffix(' -> sdpa')}; "
                           f"{kernels.ffpa_unavailable_reason() or 'unsupported device or dtype'}")
    return reason


_REASON_TEXT = {
    "softcap": "attention logit softcap is set (FFPA has no softcap) -> eager",
    "sliding_window": "a sliding-window layer arrived without a BlockMask -> sdpa",
    "head_dim": "head_dim is not in the FFPA set -> sdpa",
    "dropout": "attention dropout in training (FFPA has no dropout) -> sdpa",
    "no_scale": "no scaling passed (FFPA never guesses 1/sqrt(D)) -> sdpa",
    "dtype": "dtype is not fp16/bf16 -> sdpa",
    "kernel_unavailable": "FFPA CuTeDSL cannot run here -> sdpa",
    "4d_mask": "a precomputed 4D mask was passed -> sdpa",
    "flex_cpu": "flex_attention has no CPU backward; the BlockMask runs densely through sdpa",
    "flex_meta": "flex_attention cannot run on meta tensors (FLOP counting); the BlockMask is costed as sdpa",
    "fa4_head_dim": "FA4 has no kernel at this head_dim here (SM90: 8-256; SM100: 8-128 or 256) -> flex",
    "fa4_dtype": "dtype is not fp16/bf16 (FA4) -> flex",
    "fa4_unavailable": "flash-attn-4 cannot run here -> flex",
    "traced_positions": "the whole model is compiled and called without attention_mask: while tracing, transformers "
                        "cannot tell packed rows from plain ones by position_ids and masks every batch as packed -> "
                        "flex; pass attention_mask (all ones where nothing is padded), or compile per decoder layer "
                        "(FSDP2Strategy's compile)",
    # the CP ring's full layers: its blocks stay on the FFPA op contract, whose CPU reference kernel takes them
    "ring_kernel_unavailable": "FFPA CuTeDSL cannot run here -> the ring's blocks run the fp32 reference kernel",
    "ring_dtype": "dtype is not fp16/bf16 -> the ring's blocks run the fp32 reference kernel",
    "ring_head_dim": "head_dim is outside FFPA's range -> the ring's blocks run the fp32 reference kernel",
    "fa4_mask": "the sliding mask is more than a causal window over each row's tokens (an overlay, a cache offset "
                "or padding between tokens) -> flex",
}


def _warn_fallback(reason: str) -> None:
    """Warn once per reason; runs at runtime from the counter (also inside compiled layers)."""
    text = _REASON_TEXT.get(reason, reason)
    detail = {"kernel_unavailable": kernels.ffpa_unavailable_reason,
              "ring_kernel_unavailable": kernels.ffpa_unavailable_reason,
              "fa4_unavailable": fa4.unavailable_detail}.get(reason, str)()
    warnings.warn(f"'ffpa' attention fallback ({reason}): {text}{'; ' + detail if detail else ''}",
                  FFPAFallbackWarning, stacklevel=2)


counters.on_first("reason", _warn_fallback)


def _note_fallback(reason: str, query: Tensor) -> None:
    counters.count("reason", reason, query)


def note_ring_fallback(query: Tensor) -> None:
    """Count (and warn about once) a CP ring full-layer forward whose FFPA blocks run the reference kernel.

    The same test as `kernels.dense_fwd`'s; nothing when the reference is forced (tests), as at CP = 1."""
    if kernels.forced_kernel() == "reference":
        return
    why = registry.get("ffpa").why_not(query.shape[-1], query.dtype, query.device)
    if why:
        tag = why.split(":")[0]
        _note_fallback("ring_" + ("kernel_unavailable" if tag == "unavailable" else tag), query)


def _documents_from_positions(position_ids: Tensor | None, batch: int) -> PackedDocuments | None:
    """Segments from position_ids that restart inside a row, or None; one check per tensor, skipped when tracing."""
    if (position_ids is None or position_ids.shape[-1] < 2 or position_ids.device.type == "meta"
            or torch.compiler.is_compiling()):
        return None
    # Every layer of one forward gets the same tensor: check it once (a host sync), keyed by a weak
    # reference so a new batch that reuses the same memory is checked again.
    # An inference tensor (validate/test/predict run under inference_mode) has no version counter to key by:
    # it is checked on every call instead.
    inference = position_ids.is_inference()
    cached = None if inference else _packed_cache.get("last")
    if cached is None or cached[0]() is not position_ids or cached[1] != position_ids._version:
        packed = bool((position_ids.diff(dim=-1) != 1).any())
        docs = PackedDocuments.from_position_ids(position_ids.expand(batch, -1)) if packed else None
        if inference:
            return docs
        cached = (weakref.ref(position_ids), position_ids._version, docs)
        _packed_cache["last"] = cached
    return cached[2]


def _documents(query: Tensor, attention_mask, kwargs: dict) -> PackedDocuments | None:
    """The packed documents of this call (or None); raises where document boundaries cannot be honoured."""
    if type(query).__name__ == "DTensor":  # sharded over a CP mesh: the ring's job, not this backend's
        raise RuntimeError(f"the direct 'ffpa' attention backend cannot run under context parallelism; {CP_ROUTE}")
    docs = kwargs.get("documents")
    padded = (attention_mask is not None and not isinstance(attention_mask, BlockMask)) or getattr(
        attention_mask, "_ffpa_padded", False)
    if docs is None and not padded:  # with a padding mask HF does not read resets as packing (left padding)
        docs = _documents_from_positions(kwargs.get("position_ids"), query.shape[0])
    if docs is None:
        packed_kw = [k for k in hf_compat.PACKED_KWARGS if kwargs.get(k) is not None]
        if packed_kw:
            raise RuntimeError(f"the 'ffpa' attention backend takes packed-sequence boundaries from `documents=` or "
                               f"from position_ids that restart per document, not from kwargs {packed_kw}: "
                               "without either, documents would attend to each other")
        return None
    if getattr(attention_mask, "_ffpa_overlay", False):
        raise NotImplementedError("packed documents with a model-specific mask overlay (e.g. bidirectional image "
                                  "tokens) are not supported by the 'ffpa' backend")
    return docs


@functools.cache
def _warn_no_weights() -> None:
    # HF's output then holds no attention weights; as with sdpa, only "eager" computes them
    warnings.warn("'ffpa' attention computes no attention weights, so `output_attentions=True` returns none; set "
                  "the attention implementation to 'eager' for them", UserWarning, stacklevel=3)


def ffpa_attention_forward(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor,
                           attention_mask: Tensor | BlockMask | None, dropout: float = 0.0,
                           scaling: float | None = None, sliding_window: int | None = None,
                           softcap: float | None = None, **kwargs) -> tuple[Tensor, None]:
    """HF attention function: q/k/v ``[B,H,S,D]`` in, ``([B,S,H,D], None)`` out."""
    if kwargs.get("output_attentions"):
        _warn_no_weights()
    documents = _documents(query, attention_mask, kwargs)
    causal = kwargs.get("is_causal", getattr(module, "is_causal", True))
    if documents is not None:
        return _documents_forward(module, query, key, value, documents, dropout, scaling, sliding_window, softcap,
                                  causal), None
    if isinstance(attention_mask, BlockMask):
        if getattr(attention_mask, "_ffpa_traced_positions", False):
            _note_fallback("traced_positions", query)  # the full layers leave FFPA, the sliding ones a windowed kernel
            return _block_mask_forward(module, query, key, value, attention_mask, dropout, scaling, softcap,
                                       None), None
        # The mask's window, where the layer says it is a sliding layer with that window (HF also passes a
        # chunk size as `local_size`).
        window = getattr(attention_mask, "_ffpa_plain_window", None)
        window = window if causal and window is not None and window == sliding_window else None
        padded = getattr(attention_mask, "_ffpa_padded_window", None)
        if window is None and padded is not None and causal and padded[1] == sliding_window:
            out = _padded_window_forward(query, key, value, padded[0], scaling, softcap, int(sliding_window))
            if out is not None:
                return out, None
        elif window is None and sliding_window is not None and _config.sliding != "flex":
            _note_fallback(f"{registry.get(_config.sliding).name}_mask", query)  # packed, overlay or offset: Flex
        return _block_mask_forward(module, query, key, value, attention_mask, dropout, scaling, softcap, window), None

    if attention_mask is not None and attention_mask.dim() != 2:
        reason = "4d_mask"
    else:
        reason = _fallback_reason(module, query, dropout, scaling, softcap, sliding_window)
    if reason is None:
        # HF's [B,H,S,D] are transposed views of [B,S,H,D] projections: transposing back is free.
        q, k, v = (t.transpose(1, 2) for t in (query, key, value))
        if attention_mask is None:
            counters.count("path", "ffpa-dense", query)
            return kernels.ffpa_attention(q, k, v, scaling, causal), None
        counters.count("path", "ffpa-varlen", query)
        return _varlen(q, k, v, attention_mask, scaling, causal), None

    _note_fallback(reason, query)
    if attention_mask is not None and attention_mask.dim() == 2:
        attention_mask = masks.dense_causal_padding(attention_mask, query.shape[2], key.shape[2], causal,
                                                    query.device)
        causal = False  # folded into the mask
    if softcap:
        return _eager(module, query, key, value, attention_mask, dropout, scaling, softcap, causal), None
    return _sdpa(query, key, value, attention_mask, dropout, scaling, causal), None


def _windowed_kernel(query: Tensor) -> registry.Kernel | None:
    """The plan's windowed sliding kernel if it takes this call; None for Flex (a fallback is counted with its reason)."""
    if _config.sliding == "flex":
        return None
    kernel = registry.get(_config.sliding)
    stand_in = query.device.type == "cpu" and fa4.stand_in_active()  # CPU tests: the reference takes any float
    why = kernel.why_not(query.shape[-1], None if stand_in else query.dtype, query.device,
                         needs=("causal", "sliding_window", "gqa"))
    if why:
        _note_fallback(f"{kernel.name}_{why.split(':')[0]}", query)
        return None
    return kernel


def _padded_window_forward(query: Tensor, key: Tensor, value: Tensor, padding: Tensor, scaling, softcap,
                           window: int) -> Tensor | None:
    """A sliding layer over padded rows on the windowed kernel's varlen form: unpad -> varlen -> pad; None (the
    caller's Flex path) when the kernel cannot take the call (counted there) or the plan is Flex."""
    kernel = _windowed_kernel(query) if not softcap and scaling is not None else None
    if kernel is None:
        return None
    counters.count("path", f"{kernel.name}-varlen", query)
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # [B,S,H,D] views
    batch, seq = q.shape[0], q.shape[1]
    q_u, k_u, v_u, idx, (cu, _), (max_len, _) = hf_compat.unpad(q, k, v, padding, seq)
    out = kernel.windowed.varlen(q_u, k_u, v_u, cu, max_len, scaling, window)
    return hf_compat.pad(out, idx, batch, seq)


def _block_mask_forward(module, query: Tensor, key: Tensor, value: Tensor, block_mask: BlockMask, dropout: float,
                        scaling, softcap, window: int | None = None) -> Tensor:
    """A Flex mask: a windowed kernel for a plain sliding `window`, else flex, or its dense form through eager
    (softcap) / SDPA (CPU training, meta)."""
    kernel = _windowed_kernel(query) if window is not None and not softcap and scaling is not None else None
    if kernel is not None:
        counters.count("path", f"{kernel.name}-dense", query)
        q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # free: views of [B,S,H,D] projections
        return kernel.windowed.dense(q, k, v, scaling, window)
    if softcap:
        _note_fallback("softcap", query)
        mask = masks.dense_from_block_mask(block_mask, query.device)
        return _eager(module, query, key, value, mask, dropout, scaling, softcap)
    if query.device.type == "meta" or (query.device.type == "cpu" and torch.is_grad_enabled()
                                        and query.requires_grad):
        # torch's flex has no CPU backward and no meta kernel (FLOP counting): the same mask runs through SDPA.
        _note_fallback("flex_" + query.device.type, query)
        mask = masks.dense_from_block_mask(block_mask, query.device)
        return _sdpa(query, key, value, mask, dropout, scaling, False)
    counters.count("path", "flex", query)
    return flex_forward(query, key, value, block_mask, scaling).transpose(1, 2)


def _documents_forward(module, query: Tensor, key: Tensor, value: Tensor, docs: PackedDocuments, dropout: float,
                       scaling, sliding_window, softcap, causal: bool) -> Tensor:
    """Packed rows: full layers -> FFPA varlen over the segments; sliding layers -> window AND document Flex mask."""
    batch, _, seq, _ = query.shape
    if key.shape[2] != seq or docs.shape != (batch, seq) or not causal:
        raise ValueError(f"packed documents cover {docs.shape} tokens; this call has batch {batch}, {seq} queries, "
                         f"{key.shape[2]} keys, causal={causal} (only causal self-attention over the batch is packed)")
    if sliding_window is not None:
        kernel = _windowed_kernel(query) if not softcap and scaling is not None else None
        if kernel is not None:
            counters.count("path", f"{kernel.name}-varlen", query)
            q, k, v = (t.transpose(1, 2).reshape(batch * seq, t.shape[1], t.shape[3]) for t in (query, key, value))
            out = kernel.windowed.varlen(q, k, v, docs.cu_seqlens, docs.max_seqlen, scaling, int(sliding_window))
            return out.view(batch, seq, *out.shape[1:])
        return _block_mask_forward(module, query, key, value, docs.block_mask(int(sliding_window), query.device),
                                   dropout, scaling, softcap)
    reason = _fallback_reason(module, query, dropout, scaling, softcap, None)
    if reason is None:
        counters.count("path", "ffpa-varlen", query)
        # [B,H,S,D] transposed views of [B,S,H,D] projections: back to [B,S,H,D], then flat THD (views).
        q, k, v = (t.transpose(1, 2).reshape(batch * seq, t.shape[1], t.shape[3]) for t in (query, key, value))
        out = kernels.ffpa_varlen_attention(q, k, v, docs.cu_seqlens, docs.cu_seqlens, docs.max_seqlen,
                                            docs.max_seqlen, scaling, True)
        return out.view(batch, seq, *out.shape[1:])
    _note_fallback(reason, query)
    mask = docs.dense_mask(None, query.device)
    if softcap:
        return _eager(module, query, key, value, mask, dropout, scaling, softcap)
    return _sdpa(query, key, value, mask, dropout, scaling, False)


def _varlen(q: Tensor, k: Tensor, v: Tensor, padding: Tensor, scale: float, causal: bool) -> Tensor:
    """unpad -> FFPA varlen -> pad, on ``[B,S,H,D]`` tensors."""
    batch, q_len = q.shape[0], q.shape[1]
    q_u, k_u, v_u, idx_q, (cu_q, cu_k), (max_q, max_k) = hf_compat.unpad(q, k, v, padding, q_len)
    out = kernels.ffpa_varlen_attention(q_u, k_u, v_u, cu_q, cu_k, max_q, max_k, scale, causal)
    return hf_compat.pad(out, idx_q, batch, q_len)


# --------------------------------------------------------------------------- fallbacks


def _repeat_kv(t: Tensor, groups: int) -> Tensor:
    if groups == 1:
        return t
    b, h, s, d = t.shape
    return t[:, :, None].expand(b, h, groups, s, d).reshape(b, h * groups, s, d)


def _bottom_right(mask: Tensor | None, causal: bool, q_len: int, kv_len: int, device) -> Tensor | None:
    if causal and mask is None and q_len != kv_len:
        return masks.dense_causal_padding(None, q_len, kv_len, True, device)
    return mask


def _sdpa(query, key, value, mask, dropout, scaling, causal) -> Tensor:
    """SDPA with KV repeated to the query heads (enable_gqa at head_dim > 256 selects the MATH kernel)."""
    counters.count("path", "sdpa", query)
    groups = query.shape[1] // key.shape[1]
    key, value = _repeat_kv(key, groups), _repeat_kv(value, groups)
    q_len, kv_len = query.shape[2], key.shape[2]
    mask = _bottom_right(mask, causal, q_len, kv_len, query.device)
    if mask is not None and mask.dtype == torch.bool:
        # Rows with no visible key (left padding) would give NaN on some kernels; their output is unused.
        mask = mask | ~mask.any(-1, keepdim=True)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout,
                                         is_causal=causal and mask is None, scale=scaling)
    return out.transpose(1, 2)


def _eager(module, query, key, value, mask, dropout, scaling, softcap, causal: bool = False) -> Tensor:
    """Plain matmul-softmax attention with a logit softcap (what HF's eager does)."""
    counters.count("path", "eager", query)
    groups = query.shape[1] // key.shape[1]
    key, value = _repeat_kv(key, groups), _repeat_kv(value, groups)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    weights = torch.matmul(query, key.transpose(2, 3)) * scale
    if softcap:
        weights = torch.tanh(weights / softcap) * softcap
    if mask is None and causal:
        mask = masks.dense_causal_padding(None, query.shape[2], key.shape[2], True, query.device)
    if mask is not None and mask.dtype == torch.bool:
        weights = weights.masked_fill(~mask, torch.finfo(weights.dtype).min)
    elif mask is not None:  # an additive float mask
        weights = weights + mask
    probs = torch.softmax(weights, dim=-1, dtype=torch.float32).to(query.dtype)
    probs = F.dropout(probs, p=dropout, training=module.training)
    return torch.matmul(probs, value).transpose(1, 2)
