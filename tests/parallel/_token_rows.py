"""Eight rows whose labelled-token counts differ widely (masked prompts of growing length in the first four)."""

import torch


def token_rows(n: int = 8, seq: int = 24, vocab: int = 512) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    rows = []
    for i in range(n):
        ids = torch.randint(3, vocab, (seq,), generator=g)
        labels = ids.clone()
        if i < n // 2:
            labels[: 4 + 4 * i] = -100
        rows.append({"input_ids": ids, "labels": labels, "attention_mask": torch.ones_like(ids)})
    return rows
