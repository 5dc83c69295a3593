"""Where GRPO prompts used to live: `PromptDataModule` and its pieces now live in `lightning_ffpa.data.prompts`.

Kept so that `lightning_ffpa.rl.prompts.PromptDataModule` in configs and imports keeps working.
"""

from lightning_ffpa.data.prompts import PromptDataModule, PromptDataset, collate_prompts, render_prompt

__all__ = ["PromptDataModule", "PromptDataset", "collate_prompts", "render_prompt"]
