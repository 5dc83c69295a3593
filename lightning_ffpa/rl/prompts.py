"""Prompt data for GRPO: a dataset of prompts (text via a tokenizer, or random token ids for tiny models)
and a DataModule whose batches are dicts the rollout Callback fills with completions in place.

Owns prompt loading and collation only; completions, rewards and advantages come from the Callback.
"""

from __future__ import annotations

import json
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset


class PromptDataset(Dataset):
    """Prompts as token ids (+ their text and any extra columns, passed to reward functions as kwargs)."""

    def __init__(self, rows: list[dict[str, Any]]) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.rows[i]


def collate_prompts(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Column lists, kept as Python lists (the Callback turns them into tensors after generation)."""
    return {k: [r[k] for r in rows] for k in rows[0]}


class PromptDataModule(L.LightningDataModule):
    """Prompts from a JSONL file (`prompt` field + extra columns) or random token prompts for tiny models."""

    def __init__(self, path: str | None = None, tokenizer: str | None = None, num_random_prompts: int = 64,
                 prompt_len: int = 8, vocab_size: int = 512, batch_size: int = 4, seed: int = 0) -> None:
        """
        Args:
            path: JSONL with a `prompt` string per line; None uses random token prompts.
            tokenizer: HF tokenizer name/path, required with `path`.
            num_random_prompts: How many random prompts when `path` is None.
            prompt_len: Tokens per random prompt.
            vocab_size: Random prompt ids are drawn from [2, vocab_size).
            batch_size: Prompts per training batch (each gets `num_generations` completions).
            seed: Seed of the random prompts.
        """
        super().__init__()
        if path is not None and tokenizer is None:
            raise ValueError("`data.path` needs `data.tokenizer` to turn prompts into ids")
        self.path, self.tokenizer, self.batch_size = path, tokenizer, batch_size
        self.num_random_prompts, self.prompt_len, self.vocab_size, self.seed = (
            num_random_prompts, prompt_len, vocab_size, seed)

    def setup(self, stage: str) -> None:
        if self.path is None:
            g = torch.Generator().manual_seed(self.seed)
            ids = torch.randint(2, self.vocab_size, (self.num_random_prompts, self.prompt_len), generator=g)
            rows = [{"prompt": " ".join(map(str, r)), "prompt_ids": r} for r in ids.tolist()]
        else:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(self.tokenizer)
            with open(self.path) as f:
                rows = [json.loads(line) for line in f if line.strip()]
            for r in rows:
                r["prompt_ids"] = tok(r["prompt"], add_special_tokens=True)["input_ids"]
        self.dataset = PromptDataset(rows)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.dataset, batch_size=self.batch_size, shuffle=True, collate_fn=collate_prompts,
                          generator=torch.Generator().manual_seed(self.seed))
