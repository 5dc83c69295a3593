"""Paged KV cache: one K and one V pool per caching layer, shaped (1, kv_heads, num_pages * page_size, head_dim).

Owns the KV tensors and the `update` hook HF attention modules call. Where each token goes is decided
by the engine (`begin`, from the page tables); this file never allocates pages. KV-shared layers
(Gemma4 `num_kv_shared_layers`) get no pool: they reuse the pool of the layer that stores for them.
With `num_sliding_pages`, sliding-window layers get pools of that many pages, written at the sliding page
table's indices (`begin(..., sliding_index=)`): their pages are recycled once behind the window
(`page_pools.py`), so their pools are sized by the window, not by the sequences' length.

Under torch.compile the write is `aten.index_put_` on the pool (`fuse_write`, the default): inductor
re-inplaces it and fuses the scatter into the kernel that makes the rows (the K norm + RoPE, the V norm), so
no separate write kernel runs. `fuse_write=False` writes through the custom op `lightning_ffpa::kv_write`
instead: one `index_copy_` kernel per pool (row `ours_paged_flex_kvwrite_op` of the rollout benchmark). A
plain `index_copy_` into a graph input would be functionalized into an out-of-place copy: inductor would
rewrite the whole pool every layer every step. `tests/rollout/test_compiled_decode_step.py` checks the
generated code of both allocates no pool-sized buffer.
Eager runs call `index_copy_` directly (one kernel, no dispatch through either).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@torch.library.custom_op("lightning_ffpa::kv_write", mutates_args=("pool",))
def kv_write(pool: torch.Tensor, index: torch.Tensor, rows: torch.Tensor) -> None:
    """Write `rows` (Hkv, T, D) into `pool` (1, Hkv, N, D) at flat token indices `index` (T,), in place."""
    pool[0].index_copy_(1, index, rows)


@kv_write.register_fake
def _(pool: torch.Tensor, index: torch.Tensor, rows: torch.Tensor) -> None:
    return None


def _write(pool: torch.Tensor, index: torch.Tensor, rows: torch.Tensor, fuse: bool) -> None:
    if not torch.compiler.is_compiling():
        pool[0].index_copy_(1, index, rows)
    elif fuse:  # in place, fused into the rows' producer; see the module docstring
        torch.ops.aten.index_put_(pool, [None, None, index], rows.unsqueeze(0))
    else:
        kv_write(pool, index, rows)


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


def sliding_pool(spec: LayerSpec, num_sliding_pages: int) -> bool:
    """Whether `spec`'s layer keeps its KV in the sliding pool (a window, and a sliding pool at all)."""
    return spec.window is not None and num_sliding_pages > 0


def pool_bytes(specs: list[LayerSpec], num_pages: int, page_size: int, dtype: torch.dtype | int,
               num_sliding_pages: int = 0) -> int:
    """Bytes the K and V pools of every non-shared layer take (what `PagedKVCache` allocates) in `dtype` (or that
    many bytes per element): sliding layers hold `num_sliding_pages` pages when that is > 0, the others
    `num_pages`."""
    size = dtype if isinstance(dtype, int) else dtype.itemsize
    full = token_bytes([s for s in specs if not sliding_pool(s, num_sliding_pages)], size)
    sliding = token_bytes([s for s in specs if sliding_pool(s, num_sliding_pages)], size)
    return (full * num_pages + sliding * num_sliding_pages) * page_size


class PagedKVCache:
    """KV pools for every non-shared layer, written through `update(k, v, layer_idx)`."""

    def __init__(self, specs: list[LayerSpec], num_pages: int, page_size: int, dtype: torch.dtype,
                 device: torch.device | str, fuse_write: bool = True, num_sliding_pages: int = 0) -> None:
        """`fuse_write`: how a compiled step writes the pools (see the module docstring); `num_sliding_pages`:
        pages of the sliding-window layers' pools (0: they get `num_pages`, like the others)."""
        self.page_size = page_size
        self.fuse_write = fuse_write
        self.num_pages = num_pages
        self.num_sliding_pages = num_sliding_pages
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}
        self.sliding_layers: set[int] = set()  # layers written at the sliding table's indices
        for i, spec in enumerate(specs):
            if spec.shared:
                continue
            pages = num_pages
            if sliding_pool(spec, num_sliding_pages):
                self.sliding_layers.add(i)
                pages = num_sliding_pages
            shape = (1, spec.num_kv_heads, pages * page_size, spec.head_dim)
            self.k[i] = torch.zeros(shape, dtype=dtype, device=device)
            self.v[i] = torch.zeros(shape, dtype=dtype, device=device)
        self.shared_layers: dict[int, Any] = {}  # older Gemma4 shares KV through the cache object
        self._index: torch.Tensor | None = None
        self._sliding_index: torch.Tensor | None = None
        self._decode = False

    def layer_bytes_per_token(self, layer_idx: int) -> int:
        """K+V bytes one cached token costs in `layer_idx` (0 for shared layers)."""
        if layer_idx not in self.k:
            return 0
        k = self.k[layer_idx]
        return 2 * k.shape[1] * k.shape[3] * k.element_size()

    def begin(self, index: torch.Tensor, decode: bool, sliding_index: torch.Tensor | None = None) -> None:
        """Set where this forward's tokens are written (flat pool indices, batch-major; `sliding_index` for the
        sliding pools, when there are any) and the phase."""
        if self.sliding_layers and sliding_index is None:
            raise ValueError("this cache has sliding pools: `begin` needs the sliding table's `sliding_index`")
        self._index = index
        self._sliding_index = sliding_index
        self._decode = decode

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Write (B, Hkv, S, D) keys/values into the pool; return what attention reads.

        Decode reads the whole pool through the paged mask; prefill attends within the packed batch.
        """
        k_pool, v_pool = self.k[layer_idx], self.v[layer_idx]
        B, H, S, D = key_states.shape
        rows_k = key_states.permute(1, 0, 2, 3).reshape(H, B * S, D)  # (Hkv, B*S, D)
        rows_v = value_states.permute(1, 0, 2, 3).reshape(H, B * S, D)
        index = self._sliding_index if layer_idx in self.sliding_layers else self._index
        _write(k_pool, index, rows_k.to(k_pool.dtype), self.fuse_write)
        _write(v_pool, index, rows_v.to(v_pool.dtype), self.fuse_write)
        if self._decode:
            return k_pool, v_pool
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:  # some HF paths ask; positions are explicit here
        """Not meaningful for a paged cache; returns 0 (positions are passed explicitly)."""
        return 0
