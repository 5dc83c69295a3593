"""Paged KV cache: one K/V pool per caching layer, shaped (2, kv_heads, num_pages * page_size, head_dim): K at
index 0, V at 1, so one kernel writes both (one launch per layer per decode step, not two).

Owns the KV tensors and the `update` hook HF attention modules call. Where each token goes is decided
by the engine (`begin`, from the page table); this file never allocates pages. KV-shared layers
(Gemma4 `num_kv_shared_layers`) get no pool: they reuse the pool of the layer that stores for them.

Under torch.compile the write goes through the custom op `lightning_ffpa::kv_write`. A plain
`index_copy_` into a graph input is functionalized into an out-of-place copy: inductor then rewrites
the whole pool every layer every step (which can make the compiled decode step slower than the uncompiled
one). A custom op that declares the mutation is re-inplaced by inductor into one in-place
call; `tests/rollout/test_compiled_decode_step.py` checks the generated code allocates no pool-sized buffer.
Eager runs call `index_copy_` directly (same kernel, no custom-op dispatch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@torch.library.custom_op("lightning_ffpa::kv_write", mutates_args=("pool",))
def kv_write(pool: torch.Tensor, index: torch.Tensor, rows: torch.Tensor) -> None:
    """Write `rows` (P, Hkv, T, D) into `pool` (P, Hkv, N, D) at flat token indices `index` (T,), in place."""
    pool.index_copy_(2, index, rows)


@kv_write.register_fake
def _(pool: torch.Tensor, index: torch.Tensor, rows: torch.Tensor) -> None:
    return None


def _write(pool: torch.Tensor, index: torch.Tensor, rows: torch.Tensor) -> None:
    if torch.compiler.is_compiling():
        kv_write(pool, index, rows)  # in place under inductor; see the module docstring
    else:
        pool.index_copy_(2, index, rows)


@dataclass(frozen=True)
class LayerSpec:
    """One decoder layer as the cache and masks see it."""

    num_kv_heads: int
    head_dim: int
    window: int | None
    shared: bool = False


def token_bytes(specs: list[LayerSpec], element_size: int) -> int:
    """K+V bytes one cached token costs over every non-shared layer."""
    return sum(2 * s.num_kv_heads * s.head_dim * element_size for s in specs if not s.shared)


def pool_bytes(specs: list[LayerSpec], num_pages: int, page_size: int, dtype: torch.dtype) -> int:
    """Bytes the K and V pools of every non-shared layer take (what `PagedKVCache` allocates)."""
    return token_bytes(specs, dtype.itemsize) * num_pages * page_size


class PagedKVCache:
    """KV pools for every non-shared layer, written through `update(k, v, layer_idx)`.

    `kv[i]` is layer i's pool; `k[i]` and `v[i]` are its (1, Hkv, N, D) halves (views, for readers and tests).
    """

    def __init__(self, specs: list[LayerSpec], num_pages: int, page_size: int, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        self.page_size = page_size
        self.num_pages = num_pages
        self.kv: dict[int, torch.Tensor] = {}
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}
        for i, spec in enumerate(specs):
            if spec.shared:
                continue
            shape = (2, spec.num_kv_heads, num_pages * page_size, spec.head_dim)
            self.kv[i] = torch.zeros(shape, dtype=dtype, device=device)
            self.k[i], self.v[i] = self.kv[i][0:1], self.kv[i][1:2]
        self.shared_layers: dict[int, Any] = {}  # older Gemma4 shares KV through the cache object
        self._index: torch.Tensor | None = None
        self._decode = False

    def layer_bytes_per_token(self, layer_idx: int) -> int:
        """K+V bytes one cached token costs in `layer_idx` (0 for shared layers)."""
        if layer_idx not in self.kv:
            return 0
        kv = self.kv[layer_idx]
        return 2 * kv.shape[1] * kv.shape[3] * kv.element_size()

    def begin(self, index: torch.Tensor, decode: bool) -> None:
        """Set where this forward's tokens are written (flat pool indices, batch-major) and the phase."""
        self._index = index
        self._decode = decode

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Write (B, Hkv, S, D) keys/values into the pool; return what attention reads.

        Decode reads the whole pool through the paged mask; prefill attends within the packed batch.
        """
        pool = self.kv[layer_idx]  # the views come from it here, so a compiled step's only input is the pool
        B, H, S, D = key_states.shape
        rows = torch.stack((key_states, value_states)).to(pool.dtype)  # (2, B, Hkv, S, D)
        _write(pool, self._index, rows.transpose(1, 2).reshape(2, H, B * S, D))
        if self._decode:
            return pool[0:1], pool[1:2]
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:  # some HF paths ask; positions are explicit here
        """Not meaningful for a paged cache; returns 0 (positions are passed explicitly)."""
        return 0
