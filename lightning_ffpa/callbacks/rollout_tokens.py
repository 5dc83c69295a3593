"""The token side of `RolloutCallback`'s options, checked before fit: which ids end a completion, the padding
id, and the tokenizer that turns completions into the text reward functions read.

Owns: resolving `eos_token_ids` (the option, else the model's: config.json's and generation_config.json's) and the tokenizer (the option, else the
datamodule's own, else none: ids joined by spaces), and refusing ids outside the model's vocabulary and a
`mask_truncated_completions` that would mask every completion. Does not own sampling or the engine.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.utilities import rank_zero_info

from lightning_ffpa._compat.transformers import text_config
from lightning_ffpa.data.tokenizer import load_tokenizer, tokenizer_digest
from lightning_ffpa.errors import ConfigError


def _ids(value: Any) -> list[int]:
    return [] if value is None else ([value] if isinstance(value, int) else list(value))


def generation_eos(pretrained: Any) -> list[int]:
    """`generation_config.json`'s eos ids of a local (or cached) pretrained model, where it has one: what HF
    `generate` and vLLM stop at (a chat checkpoint's end-of-turn id is there, not in config.json)."""
    if not isinstance(pretrained, str):
        return []
    from transformers import GenerationConfig

    try:
        return _ids(GenerationConfig.from_pretrained(pretrained, local_files_only=True).eos_token_id)
    except (OSError, ValueError):  # no generation_config.json: config.json's eos alone
        return []


def resolve_eos(eos_token_ids: list[int] | None, config: Any, generation: list[int] = ()) -> list[int]:
    """The option's ids, else the model config's `eos_token_id` (an int or a list) and the pretrained model's
    generation-config eos ids (`generation_eos`), else none."""
    if eos_token_ids is not None:
        return list(eos_token_ids)
    return list(dict.fromkeys([*_ids(getattr(config, "eos_token_id", None)), *generation]))


def check_token_ids(option: str, eos_token_ids: list[int] | None, pad_token_id: int, config: Any,
                    mask_truncated: bool, generation: list[int] = ()) -> None:
    """Ids past the embedding fail mid-step with an index error; with no id that ends a completion, every one
    runs to `max_new_tokens`, and `mask_truncated_completions` would leave no token to learn from."""
    eos, eos_given = resolve_eos(eos_token_ids, config, generation), eos_token_ids is not None
    vocab = getattr(text_config(config), "vocab_size", None) if config is not None else None
    if isinstance(vocab, int):
        if pad_token_id >= vocab:
            raise ConfigError(f"{option}.pad_token_id", pad_token_id, f"is past the model's vocab_size={vocab}")
        if eos_given and any(t >= vocab for t in eos):
            raise ConfigError(f"{option}.eos_token_ids", eos, f"ids must be below the model's vocab_size={vocab}: "
                              "such a token can never be sampled, so it would never end a completion")
    if mask_truncated and not eos and (eos_given or config is not None):  # a config without an eos id: none
        config_eos = resolve_eos(None, config, generation) if config is not None else []
        why = (f"`{option}.eos_token_ids: []` turns off the model config's eos_token_id {config_eos} (null keeps it)"
               if eos_given and config_eos else f"`{option}.eos_token_ids` is empty and so is the model config's "
               "eos_token_id")
        raise ConfigError("model.mask_truncated_completions", True,
                          f"no token ends a completion ({why}), so every completion is cut at max_new_tokens and all "
                          "would be masked: no step would ever update; give eos_token_ids or set it false")


def resolve_tokenizer(option: str, name: str | None, datamodule: Any) -> Any:
    """The tokenizer completions are decoded with: the option's, else the datamodule's (the one that encoded the
    prompts, so prompts and completions reach reward functions as the same kind of text), else None."""
    if name:
        chosen = load_tokenizer(name, f"{option}.tokenizer")
        data_digest = getattr(datamodule, "tokenizer_digest", None)
        if data_digest is not None and tokenizer_digest(chosen) != data_digest:
            raise ConfigError(f"{option}.tokenizer", name, f"is not the tokenizer that encoded the prompts "
                                                           f"(`data.init_args.tokenizer="
                                                           f"{getattr(datamodule, 'tokenizer_spec', None)!r}`): "
                                                           "completions decoded with it would be other text; "
                                                           "leave it unset to decode with the data's")
        return chosen
    tokenizer = getattr(datamodule, "tokenizer", None)
    if tokenizer is not None and callable(getattr(tokenizer, "decode", None)):
        rank_zero_info(f"{option}: completions are decoded for the reward functions with the datamodule's "
                       f"tokenizer ({type(tokenizer).__name__})")
        return tokenizer
    return None
