"""Prompt data for GRPO: prompts from local files or Hugging Face datasets (or random token ids for tiny
models), and a DataModule whose batches are dicts the rollout Callback fills with completions in place.

Owns: reading prompts (a `prompt` text field or a chat `messages` field, through the same sources as
`TextDataModule`), rendering them with the tokenizer's chat template and its generation prompt, and
collating them with every other field of the row, which the Callback hands to reward functions as keyword
arguments. Completions, rewards and advantages come from the Callback (`callbacks/rollout.py`).
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import DataLoader, Dataset

from lightning_ffpa.data.base import SeededDataModule, option, require_at_least
from lightning_ffpa.data.sources import (
    check_dataset_config,
    check_file,
    check_split,
    load_rows,
    record_of,
    require_datasets,
)
from lightning_ffpa.data.tokenizer import (
    ChatTemplateError,
    format_plain_chat,
    load_tokenizer,
    render_chat,
    tokenizer_digest,
)
from lightning_ffpa.errors import ConfigError


class PromptDataset(Dataset):
    """Prompts as token ids (+ their text and any extra columns, passed to reward functions as kwargs)."""

    def __init__(self, rows: list[dict[str, Any]]) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.rows[i]


PROMPT_KEYS = ("prompt", "prompt_text", "prompt_ids")  # what a batch row holds beside the data's own fields


def collate_prompts(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Column lists, kept as Python lists (the Callback turns them into tensors after generation)."""
    keys = dict.fromkeys(k for r in rows for k in r)  # every row's fields, in first-seen order
    return {k: [r.get(k) for r in rows] for k in keys}


def render_prompt(tokenizer: Any, prompt: str | list[dict[str, Any]], chat_template: bool) -> tuple[str, list[int]]:
    """The text the policy is prompted with and its ids.

    With `chat_template` and a tokenizer that has one, a chat (or a text prompt, as one user turn) is
    rendered with the generation prompt appended; a chat is refused where a Hugging Face tokenizer has no
    template (the byte tokenizer, or `chat_template: false`, uses the plain ``role: content`` format); a text
    prompt without a template is tokenized as is, with special tokens but no end-of-sequence token after it (the
    policy continues the prompt; it does not start after an ended text).
    """
    has_template = chat_template and bool(getattr(tokenizer, "chat_template", None))
    if isinstance(prompt, str) and not has_template:
        ids = list(tokenizer.encode(prompt, add_special_tokens=True))
        eos = getattr(tokenizer, "eos_token_id", None)
        if eos is not None and len(ids) > 1 and ids[-1] == eos:
            plain = tokenizer.encode(prompt, add_special_tokens=False)
            if not plain or plain[-1] != eos:  # added by the tokenizer, not written in the prompt
                ids.pop()
        return prompt, ids
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    # `chat_template: false` asks for the plain `role: content` lines; else the template (refused without one)
    text = render_chat(tokenizer, messages, True) if chat_template else format_plain_chat(messages, True)
    return text, list(tokenizer.encode(text, add_special_tokens=False))


class PromptDataModule(SeededDataModule):
    """GRPO prompts from a local .jsonl/.json/.parquet/.arrow file or a Hugging Face dataset (a `prompt` text
    or `messages` chat field), rendered by the tokenizer's chat template with its generation prompt; the
    other fields of each row reach the reward functions as keyword arguments. Without a source: random
    token prompts for tiny models. Also importable as `lightning_ffpa.rl.prompts.PromptDataModule`.
    """

    def __init__(
        self,
        path: str | None = None,
        dataset: str | None = None,
        dataset_config: str | None = None,
        split: str = "train",
        tokenizer: str | None = None,
        prompt_field: str = "prompt",
        messages_field: str = "messages",
        chat_template: bool = True,
        num_random_prompts: int = 64,
        prompt_len: int = 8,
        vocab_size: int = 512,
        batch_size: int = 4,
        seed: int = 0,
        num_workers: int = 0,
    ) -> None:
        """
        Args:
            path: Local prompts file (.jsonl, or .json/.parquet/.arrow through `datasets`); unset with no `dataset`: random token prompts.
            dataset: A Hugging Face hub dataset name, or a local folder of data files, for `datasets.load_dataset`.
            dataset_config: The `dataset`'s configuration name, if it has several (not with a local file).
            split: The split of `dataset` (or of a `datasets`-read file) to read; slices like `train[:512]` work.
            tokenizer: "byte", or a local folder or hub id for `AutoTokenizer`; required with `path` or `dataset`.
            prompt_field: Field of a row holding the prompt text.
            messages_field: Field of a row holding the prompt as a chat (a list of {role, content}).
            chat_template: Render prompts through the tokenizer's chat template with its generation prompt (a text prompt becomes one user turn).
            num_random_prompts: How many random prompts when neither `path` nor `dataset` is set.
            prompt_len: Tokens per random prompt.
            vocab_size: Random prompt ids are drawn from [2, vocab_size).
            batch_size: Prompts per training batch (each gets `num_generations` completions).
            seed: Seed of the random prompts and of the shuffle order (with the epoch).
            num_workers: DataLoader worker processes.
        """
        super().__init__(batch_size=batch_size, num_workers=num_workers, seed=seed)
        if path is not None and dataset is not None:
            raise ConfigError(option("dataset"), dataset, "give either `dataset` or `path`, not both")
        if path is not None:
            check_file(path, option("path"))
            check_split(path, split, option("split"))
            if path.lower().endswith(".txt"):
                raise ConfigError(option("path"), path, "prompts need rows with fields: .jsonl, .json, .parquet or .arrow")
        if dataset is not None:
            require_datasets(option("dataset"), dataset)
        check_dataset_config(dataset, dataset_config, option("dataset_config"))
        source = path if path is not None else dataset
        if source is not None and tokenizer is None:
            raise ConfigError(option("tokenizer"), None, "is needed to turn the prompts into ids")
        require_at_least(1, num_random_prompts=num_random_prompts, prompt_len=prompt_len)
        require_at_least(3, vocab_size=vocab_size)
        self.path, self.dataset, self.dataset_config, self.split = path, dataset, dataset_config, split
        self.prompt_field, self.messages_field, self.chat_template = prompt_field, messages_field, chat_template
        self.num_random_prompts, self.prompt_len, self.vocab_size = num_random_prompts, prompt_len, vocab_size
        self.tokenizer_spec = tokenizer  # recorded in checkpoints, with its digest (as TextDataModule's)
        self.tokenizer = load_tokenizer(tokenizer) if tokenizer is not None else None
        self.tokenizer_digest = tokenizer_digest(self.tokenizer) if self.tokenizer is not None else None
        if self.tokenizer is not None and source is not None:
            self.vocab_size = len(self.tokenizer)  # the ids the prompts can hold (checked against the model)
        self.dataset_rows: PromptDataset | None = None

    def _option_and_source(self) -> tuple[str, str]:
        return (option("path"), self.path) if self.path is not None else (option("dataset"), self.dataset)

    def _random_rows(self) -> list[dict[str, Any]]:
        g = torch.Generator().manual_seed(self.seed)
        ids = torch.randint(2, self.vocab_size, (self.num_random_prompts, self.prompt_len), generator=g)
        return [{"prompt": " ".join(map(str, r)), "prompt_text": " ".join(map(str, r)), "prompt_ids": r}
                for r in ids.tolist()]

    def _source_rows(self) -> list[dict[str, Any]]:
        opt, source = self._option_and_source()
        rows = []
        for n, row in enumerate(load_rows(source, opt, self.dataset_config, self.split), 1):
            # TRL's conversational format keeps the chat in `prompt` itself
            chat_field = self.prompt_field if isinstance(row.get(self.prompt_field), list) else self.messages_field
            prompt = record_of(row, f"row {n}", opt, source, self.prompt_field, chat_field)
            contents = [prompt] if isinstance(prompt, str) else [m.get("content") for m in prompt]
            if not any(isinstance(c, str) and c.strip() for c in contents):  # it would be the start token alone
                raise ConfigError(opt, source, f"row {n} has an empty prompt: the policy would be prompted with the "
                                               "start token alone; fill it or remove the row")
            try:
                text, ids = render_prompt(self.tokenizer, prompt, self.chat_template)
            except ChatTemplateError as err:
                raise ConfigError(opt, source, f"row {n}: {err}") from err
            # every other field (the chat, an answer, ...) rides along to the reward functions; `prompt` is the
            # prompt as the data gives it (text, or a chat), as TRL passes it, and `prompt_text` what was rendered
            extra = {k: v for k, v in row.items() if k not in PROMPT_KEYS}
            rows.append({**extra, "prompt": prompt, "prompt_text": text, "prompt_ids": ids})
        if not rows:
            raise ConfigError(opt, source, "holds no prompts (the file or split is empty)")
        fields = dict.fromkeys(k for row in rows for k in row)
        for row in rows:  # a field some rows lack reaches the reward functions as None, in every batch
            for key in fields:
                row.setdefault(key, None)
        templated = self.chat_template and bool(getattr(self.tokenizer, "chat_template", None))
        rank_zero_info(
            f"PromptDataModule: {len(rows)} prompts from `{opt}`; "
            + ("rendered by the tokenizer's chat template with its generation prompt" if templated
               else "no chat template applied (chats use the plain `role: content` format)")
        )
        return rows

    def setup(self, stage: str | None = None) -> None:
        """Read (or draw) and tokenize the prompts once; check the batch size against them."""
        if self.dataset_rows is None:
            source = self.path if self.path is not None else self.dataset
            rows = self._random_rows() if source is None else self._source_rows()
            self.dataset_rows = PromptDataset(rows)
        self.check_batch_size(len(self.dataset_rows))

    def max_prompt_length(self) -> int | None:
        """Token length of the longest prompt once `setup` has run (the rollout Callback checks it), else None."""
        if self.dataset_rows is None or len(self.dataset_rows) == 0:
            return None
        return max(len(row["prompt_ids"]) for row in self.dataset_rows.rows)

    def num_train_rows(self) -> int | None:
        """Prompts once `setup` has read them."""
        return None if self.dataset_rows is None else len(self.dataset_rows)

    def train_dataloader(self) -> DataLoader:
        """Shuffled (seed, epoch) loader over the prompts; resumes mid-epoch like the text data."""
        self.setup()
        return self._loader(self.dataset_rows, collate_prompts, train=True)
