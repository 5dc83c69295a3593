"""Packed rows through a tiny Gemma4: each document's logits equal those of the document alone.

This pins the contract between `pack_documents` and Hugging Face: with `attention_mask` absent,
`use_cache=False` and `position_ids` restarting per document, HF's masking splits the row into documents
(`masking_utils.find_packed_sequence_indices`). With a cache present HF skips that detection and
documents attend to each other, hence `use_cache=False` below.
"""

import pytest
import torch
import transformers

from lightning_ffpa.data import Document, PackedCollate, pack_documents
from lightning_ffpa.presets import build_text_config


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_packed_documents_do_not_see_each_other(attn):
    cfg = build_text_config("tiny")
    cfg._attn_implementation = attn
    torch.manual_seed(0)
    model = transformers.Gemma4ForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(1)
    # 20 > sliding window 16, so the sliding layers' window is exercised inside a document too
    docs = [torch.randint(0, 500, (n,), generator=g).tolist() for n in (20, 13, 5)]
    rows = pack_documents([Document(d, d) for d in docs], max_seq_length=48, pad_id=0)
    assert len(rows) == 1
    batch = PackedCollate()(rows)
    with torch.no_grad():
        packed = model(
            input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False
        ).logits[0]
        start = 0
        for d in docs:
            alone = model(input_ids=torch.tensor([d]), use_cache=False).logits[0]
            torch.testing.assert_close(packed[start : start + len(d)], alone, atol=1e-4, rtol=1e-4)
            start += len(d)
