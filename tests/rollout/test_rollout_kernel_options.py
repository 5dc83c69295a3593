"""Paged flex attention against SDPA on scrambled (non-contiguous) page layouts with padded rows.

CPU: the eager flex path checks the paged masks, page conversion and GQA. GPU: the compiled kernels
with the engine's kernel options at head_dim 256 and 512, plus the two options we refuse to enable.
Also checks that every allowed (q, kv) pair lies in a listed block and that sliding rows list only
pages inside their window.
"""

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import flex_attention

from lightning_ffpa.rollout.attention import UNSAFE_OPTIONS, kernel_options
from lightning_ffpa.rollout.masks import decode_block_mask, logical_block_mask
from lightning_ffpa.rollout.page_table import PageTable


def _paged_case(device, dtype, head_dim, page_size, lens, window, num_pages=40, hq=4, hkv=2, seed=0, kv_block=None):
    """Scrambled pages for `lens` sequences plus one padded row (slot 0); returns inputs and SDPA reference.
    `kv_block`: the masks' KV block (default: one page)."""
    kv_block = kv_block or page_size
    g = torch.Generator().manual_seed(seed)
    max_len = 16 * page_size
    pt = PageTable(num_pages, page_size, len(lens) + 1, max_len // page_size, device)
    slots = pt.fill_scrambled(lens, g)  # pages are not consecutive
    pool = num_pages * page_size
    k_pool = torch.randn(1, hkv, pool, head_dim, generator=g).to(device, dtype)
    v_pool = torch.randn(1, hkv, pool, head_dim, generator=g).to(device, dtype)
    q = torch.randn(len(lens) + 1, hq, 1, head_dim, generator=g).to(device, dtype)
    slot_t = torch.tensor([*slots, 0], device=device)
    pos_t = torch.tensor([n - 1 for n in lens] + [0], device=device)
    logical = logical_block_mask(max_len, kv_block, window, device)
    bm = decode_block_mask(logical, pt.table, pt.owner, slot_t, pos_t, page_size, kv_block, window)
    ref = torch.zeros_like(q)
    for b, (s, n) in enumerate(zip(slots, lens)):
        idx = pt.physical_index(torch.full((n,), s, device=device), torch.arange(n, device=device))
        k = k_pool[0][:, idx].repeat_interleave(hq // hkv, 0)[None]  # (1, Hq, n, D)
        v = v_pool[0][:, idx].repeat_interleave(hq // hkv, 0)[None]
        keep = torch.ones(1, n, dtype=torch.bool, device=device)
        if window is not None:
            keep[0, : max(0, n - window)] = False
        ref[b] = F.scaled_dot_product_attention(q[b:b + 1].float(), k.float(), v.float(), attn_mask=keep,
                                                scale=1.0)[0].to(dtype)
    return q, k_pool, v_pool, bm, ref, pt, slot_t, pos_t


@pytest.mark.parametrize("kv_block", [8, 4, 2])
@pytest.mark.parametrize("window", [None, 6])
def test_eager_paged_decode_matches_sdpa_with_padded_row(window, kv_block):
    q, k, v, bm, ref, *_ = _paged_case("cpu", torch.float32, 32, 8, [9, 30, 17], window, kv_block=kv_block)
    out = flex_attention(q, k, v, block_mask=bm, scale=1.0, enable_gqa=True)
    torch.testing.assert_close(out[:-1], ref[:-1], atol=1e-5, rtol=1e-5)
    assert torch.equal(out[-1], torch.zeros_like(out[-1]))  # padded row: fully masked, zeros, no NaN


@pytest.mark.parametrize("kv_block", [8, 4, 2])
@pytest.mark.parametrize("window", [None, 6])
def test_blocks_cover_mask_and_rows_list_no_block_they_do_not_read(window, kv_block):
    *_, bm, _, pt, slots, pos = _paged_case("cpu", torch.float32, 32, 8, [9, 30, 17], window, kv_block=kv_block)
    dense = bm.to_dense()[:, 0, 0].bool()  # (B, num_pages * page_size / kv_block): blocks listed per row
    assert dense.shape[1] == pt.num_pages * pt.page_size // kv_block
    kv = torch.arange(pt.num_pages * pt.page_size)
    for b in range(len(slots) - 1):
        allowed = bm.mask_mod(torch.tensor(b), torch.tensor(0), torch.tensor(0), kv)
        needed = torch.unique(kv[allowed] // kv_block)
        assert dense[b, needed].all(), "an allowed key lies in an unlisted block"
        # Full rows list exactly the blocks they read (a last page only up to the newest token's block); a
        # sliding row's list is its query block's union, at most one block more.
        assert needed.numel() <= dense[b].sum() <= needed.numel() + (window is not None)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_block", [128, 64])
@pytest.mark.parametrize("head_dim,window", [(256, None), (256, 64), (512, None)])
def test_compiled_kernel_options_match_sdpa_on_gpu(head_dim, window, kv_block):
    q, k, v, bm, ref, *_ = _paged_case("cuda", torch.bfloat16, head_dim, 128, [300, 1000, 77, 129], window,
                                       num_pages=24, hq=8, hkv=2 if head_dim == 256 else 1, kv_block=kv_block)
    flex = torch.compile(flex_attention, dynamic=False)
    out = flex(q, k, v, block_mask=bm, scale=1.0, enable_gqa=True,
               kernel_options=kernel_options(head_dim, True, torch.bfloat16, kv_block=kv_block))
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[:-1].float(), ref[:-1].float(), atol=2e-2, rtol=2e-2)
    assert not set(kernel_options(head_dim, True) or {}) & set(UNSAFE_OPTIONS)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_compiled_prefill_options_head_dim_512_match_sdpa_with_padding(dtype):
    """Packed prefill at D=512 with the prefill options: two documents and padded (fully masked) rows."""
    from lightning_ffpa.rollout.masks import prefill_block_mask

    g = torch.Generator().manual_seed(0)
    lens, S = [300, 150], 512
    doc = torch.full((S,), -1)
    pos = torch.zeros(S, dtype=torch.long)
    doc[:300], doc[300:450] = 0, 1
    pos[:300], pos[300:450] = torch.arange(300), torch.arange(150)
    doc, pos = doc.cuda(), pos.cuda()
    q = torch.randn(1, 8, S, 512, generator=g).to("cuda", dtype)
    k = torch.randn(1, 1, S, 512, generator=g).to("cuda", dtype)
    v = torch.randn(1, 1, S, 512, generator=g).to("cuda", dtype)
    flex = torch.compile(flex_attention, dynamic=False)
    out = flex(q, k, v, block_mask=prefill_block_mask(doc, pos, None), scale=1.0, enable_gqa=True,
               kernel_options=kernel_options(512, False, dtype))
    assert torch.isfinite(out).all() and out[:, :, 450:].abs().max() == 0
    start = 0
    for n in lens:
        sl = slice(start, start + n)
        ref = F.scaled_dot_product_attention(q[:, :, sl].float(), k[:, :, sl].float().expand(1, 8, n, 512),
                                             v[:, :, sl].float().expand(1, 8, n, 512), is_causal=True, scale=1.0)
        torch.testing.assert_close(out[:, :, sl].float(), ref, atol=2e-2, rtol=2e-2)
        start += n


@pytest.mark.gpu
@pytest.mark.parametrize("option", UNSAFE_OPTIONS)
def test_unsafe_options_are_unsafe_here_and_not_enabled(option):
    """Record whether each refused option breaks scrambled pages / padded rows; it must stay off either way."""
    q, k, v, bm, ref, *_ = _paged_case("cuda", torch.bfloat16, 256, 128, [300, 1000, 77, 129], None,
                                       num_pages=24, hq=8, hkv=2)
    flex = torch.compile(flex_attention, dynamic=False)
    try:
        out = flex(q, k, v, block_mask=bm, scale=1.0, enable_gqa=True, kernel_options={option: True})
        broken = not (torch.isfinite(out).all() and torch.allclose(out[:-1].float(), ref[:-1].float(), atol=2e-2))
        verdict = "breaks" if broken else "matched"
    except Exception as err:  # noqa: BLE001 - a refused option is recorded, not fatal
        verdict = f"raised {type(err).__name__}"
    print(f"{option}: {verdict} on scrambled pages with a padded row")
    for d in (256, 512):
        for decode in (True, False):
            for dtype in (torch.bfloat16, torch.float32):
                assert option not in (kernel_options(d, decode, dtype) or {})
