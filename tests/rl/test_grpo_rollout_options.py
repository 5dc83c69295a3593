"""GRPO options a fresh trial found silent: batches with nothing to learn (the step count stood still and the run
never ended), completions handed to reward functions as id strings while prompts came as text, and checkpoint
intervals that `num_iterations` steps over."""

import json
import logging

import lightning as L
import pytest
import torch

from lightning_ffpa.callbacks.rollout import RolloutCallback
from lightning_ffpa.errors import ConfigError
from lightning_ffpa.rl.module import GRPOModule
from lightning_ffpa.rl.prompts import PromptDataModule
from lightning_ffpa.rollout.engine import EngineConfig
from lightning_ffpa.rollout.sampler import SamplingParams


def tied_reward(prompts, completions, completion_ids, **kwargs):
    return [1.0] * len(completions)  # every group ties: dynamic sampling drops it


SEEN: list[tuple] = []


def recording_reward(prompts, completions, completion_ids, **kwargs):
    SEEN.append((list(prompts), list(completions)))
    return [float(sum(c) % 7) for c in completion_ids]  # spread within a group


def _fit(reward, module_kw=None, data=None, max_steps=4, preflight=False, **callback_kw):
    torch.manual_seed(0)
    rollout = RolloutCallback([reward], num_generations=2, sampling=SamplingParams(max_new_tokens=4),
                              engine=EngineConfig(page_size=8, num_pages=32, max_batch_size=8, max_seq_len=64,
                                                  attention="dense"), **callback_kw)
    trainer = L.Trainer(max_steps=max_steps, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[rollout])
    module = GRPOModule(preset="tiny", **(module_kw or {}))
    data = data or PromptDataModule(num_random_prompts=8, prompt_len=4, batch_size=2)
    if preflight:  # as the CLI runs it before fit (`validation.preflight`)
        from lightning_ffpa.validation import preflight as run_preflight

        run_preflight(trainer, module, data)
    trainer.fit(module, datamodule=data)
    return trainer, module


@pytest.mark.timeout(120)
def test_batches_with_nothing_to_learn_warn_then_stop_the_run_naming_the_option():
    with pytest.warns(UserWarning, match="no update, every group's rewards tied"), \
            pytest.raises(ConfigError, match=r"`model.dynamic_sampling=True`: 2 rollout batches in a row") as err:
        _fit(tied_reward, {"dynamic_sampling": True, "max_empty_batches": 2}, eos_token_ids=[])
    assert "no update has run since step 0" in str(err.value)


@pytest.mark.timeout(120)
def test_a_batch_that_learns_resets_the_count():
    trainer, module = _fit(recording_reward, {"dynamic_sampling": True, "max_empty_batches": 1}, max_steps=2,
                           eos_token_ids=[])
    assert trainer.global_step == 2 and module.empty_batches == 0
    assert float(trainer.callback_metrics["rollout/empty_batches"]) == 0.0  # logged on update batches as well


def test_mask_truncated_completions_without_an_eos_is_refused_before_fit():
    # the tiny config has an eos_token_id: the message says that the explicit [] turned it off
    with pytest.raises(ConfigError, match=r"`model.mask_truncated_completions=True`: no token ends a completion "
                                          r"\(`RolloutCallback.eos_token_ids: \[\]` turns off the model config's "
                                          r"eos_token_id \[1\] \(null keeps it\)\)"):
        _fit(recording_reward, {"mask_truncated_completions": True}, eos_token_ids=[])


@pytest.mark.parametrize("kw, option", [({"pad_token_id": 512}, "RolloutCallback.pad_token_id"),
                                        ({"eos_token_ids": [600]}, "RolloutCallback.eos_token_ids")])
def test_token_ids_past_the_vocabulary_are_refused_before_fit(kw, option):
    with pytest.raises(ConfigError, match=f"`{option}="):
        _fit(recording_reward, **kw)


@pytest.mark.timeout(120)
def test_completions_are_decoded_with_the_datas_tokenizer(tmp_path, caplog):
    """Prompts reach the reward functions as text; completions must too, with the tokenizer that encoded them.
    Which tokenizer is said once, though the CLI's pre-flight and setup both check the options (it was said twice)."""
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"What is {i}+{i}?"}) + "\n" for i in range(4)))
    SEEN.clear()
    with caplog.at_level(logging.INFO):
        _fit(recording_reward, data=PromptDataModule(path=str(path), tokenizer="byte", batch_size=2), max_steps=1,
             eos_token_ids=[258], preflight=True)
    assert caplog.text.count("completions are decoded for the reward functions") == 1, caplog.text
    prompts, completions = SEEN[0]
    assert prompts[0].startswith("What is")
    # the byte tokenizer's text, not "193 36 502 ..." (ids joined by spaces)
    ids_joined = [c for c in completions if c and all(part.isdigit() for part in c.split(" "))]
    assert not ids_joined, completions


def test_an_unloadable_rollout_tokenizer_is_refused_before_fit(tmp_path):
    with pytest.raises(ConfigError, match="`RolloutCallback.tokenizer="):
        _fit(recording_reward, tokenizer=str(tmp_path / "no_such_tokenizer"))


@pytest.mark.parametrize("max_steps, every, option", [(3, None, "trainer.max_steps"),
                                                      (4, 3, "ModelCheckpoint.every_n_train_steps")])
def test_step_counts_between_multiples_of_num_iterations_are_refused(tmp_path, max_steps, every, option):
    from lightning.pytorch.callbacks import ModelCheckpoint

    rollout = RolloutCallback([recording_reward], num_generations=2, sampling=SamplingParams(max_new_tokens=4),
                              engine=EngineConfig(page_size=8, num_pages=32, max_batch_size=8, max_seq_len=64,
                                                  attention="dense"))
    callbacks = [rollout] + ([ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=every)] if every else [])
    trainer = L.Trainer(max_steps=max_steps, accelerator="cpu", logger=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=callbacks, default_root_dir=tmp_path)
    with pytest.raises(ConfigError, match=f"`{option}=.*multiple of `model.num_iterations=2`"):
        trainer.fit(GRPOModule(preset="tiny", num_iterations=2),
                    datamodule=PromptDataModule(num_random_prompts=8, prompt_len=4, batch_size=2))
    assert not list(tmp_path.iterdir())  # refused before any checkpoint


@pytest.mark.timeout(120)
def test_each_reward_function_and_the_shaped_reward_are_logged():
    """Only the sum of several reward functions was logged (each one's share unseen), and DAPO's overlong shaping
    left no trace in the logs."""
    torch.manual_seed(0)
    rollout = RolloutCallback([tied_reward, recording_reward], num_generations=2, eos_token_ids=[],
                              reward_weights=[2.0, 1.0],
                              sampling=SamplingParams(max_new_tokens=4),
                              engine=EngineConfig(page_size=8, num_pages=32, max_batch_size=8, max_seq_len=64,
                                                  attention="dense"))
    trainer = L.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[rollout])
    trainer.fit(GRPOModule(preset="tiny", overlong_buffer=2),
                datamodule=PromptDataModule(num_random_prompts=8, prompt_len=4, batch_size=2))
    logged = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("rollout/")}
    assert logged["rollout/reward/tied_reward"] == 1.0
    assert logged["rollout/reward"] == pytest.approx(2.0 + logged["rollout/reward/recording_reward"])  # weighted
    # every completion ran to max_new_tokens (no EOS) inside the 2-token buffer: the full penalty of 1
    assert logged["rollout/shaped_reward"] == pytest.approx(logged["rollout/reward"] - 1.0)


@pytest.mark.parametrize("weights, match", [([1.0], "gives 1 weight for 2 reward functions"),
                                            ([1.0, float("inf")], "must be finite numbers")])
def test_reward_weights_are_one_finite_number_per_function(weights, match):
    with pytest.raises(ConfigError, match=rf"^`RolloutCallback.reward_weights=.*`: {match}"):
        RolloutCallback([tied_reward, recording_reward], reward_weights=weights)


@pytest.mark.timeout(120)
def test_reward_functions_get_prompts_and_completions_in_trls_two_formats(tmp_path):
    """TRL's reward functions read a chat prompt's completion as `completions[i][0]["content"]`: they failed here
    (prompts came rendered, completions as text). Now as TRL passes them: a chat prompt (TRL's `prompt` list, or
    a `messages` field) and its completion as chats, a text prompt as the data gave it, not the template's text."""
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+3?"}]
    path = tmp_path / "prompts.jsonl"
    rows = [{"prompt": chat, "answer": "5"}, {"messages": chat, "answer": "5"}, {"prompt": "What is 1+1?"},
            {"prompt": "What is 2+2?"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    SEEN.clear()
    _fit(recording_reward, data=PromptDataModule(path=str(path), tokenizer="byte", batch_size=4, seed=1),
         max_steps=1, eos_token_ids=[258])
    prompts, completions = SEEN[0]
    for p, c in zip(prompts, completions):
        if isinstance(p, list):
            assert p == chat and isinstance(c, list) and c[0]["role"] == "assistant" and isinstance(c[0]["content"], str)
        else:
            assert p in ("What is 1+1?", "What is 2+2?") and isinstance(c, str)
    assert sum(isinstance(p, list) for p in prompts) == 4  # two chat prompts, two completions each


LOGGED: list[tuple] = []


def trl_keywords_reward(prompts, completions, completion_ids, trainer_state, log_metric, log_extra, **kwargs):
    """Written as TRL's docs write one: shaped by `trainer_state`, logging through `log_metric` / `log_extra`."""
    LOGGED.append((trainer_state.global_step, trainer_state.max_steps))
    log_metric("mean_len", sum(map(len, completion_ids)) / len(completion_ids))
    log_extra("length", [len(c) for c in completion_ids])
    return [float(sum(c) % 7) for c in completion_ids]


@pytest.mark.timeout(120)
def test_reward_functions_get_trls_trainer_state_log_metric_and_log_extra():
    """TRL passes `trainer_state`, `log_metric` and `log_extra` to every reward function; one that named them
    raised TypeError/KeyError at the first rollout."""
    LOGGED.clear()
    trainer, _ = _fit(trl_keywords_reward, max_steps=2)
    assert [step for step, _ in LOGGED] == [0, 1] and LOGGED[0][1] == 2
    assert "rollout/log_metric/mean_len" in trainer.callback_metrics
    rollout = next(c for c in trainer.callbacks if isinstance(c, RolloutCallback))
    assert len(rollout.extra_columns["length"]) == 4  # the last rollout's: 2 prompts x 2 completions
    m = {k.removeprefix("rollout/"): float(v) for k, v in trainer.callback_metrics.items() if k.startswith("rollout/")}
    # TRL's rollout statistics beside the mean reward
    assert m["completion_length_min"] <= m["completion_length"] <= m["completion_length_max"] == 4
    assert 0 <= m["clipped_ratio"] <= 1 and 0 <= m["frac_reward_zero_std"] <= 1 and m["reward_std"] >= 0


def test_a_rollout_tokenizer_other_than_the_datas_is_refused_before_fit(tmp_path):
    """Prompts encoded with the data's tokenizer and completions decoded with another went through silently: the
    reward functions scored other text."""
    from tests.data.conftest import PLAIN_TEMPLATE, save_tokenizer

    save_tokenizer(tmp_path / "tok", PLAIN_TEMPLATE)
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"what is {i}"}) + "\n" for i in range(4)))
    data = PromptDataModule(path=str(path), tokenizer=str(tmp_path / "tok"), batch_size=2)
    with pytest.raises(ConfigError, match=r"^`RolloutCallback.tokenizer='byte'`: is not the tokenizer that encoded"):
        _fit(recording_reward, data=data, tokenizer="byte", max_steps=1, preflight=True)


def test_completions_end_at_the_pretrained_models_generation_config_eos_too(tmp_path, caplog):
    """Rollouts stopped at config.json's eos alone; a chat checkpoint's end-of-turn id is in its
    generation_config.json, where `generate` (and vLLM) stop: the completions ran on to max_new_tokens."""
    from transformers import Gemma4ForCausalLM, GenerationConfig

    from lightning_ffpa.presets import build_text_config

    torch.manual_seed(0)
    Gemma4ForCausalLM(build_text_config("tiny")).save_pretrained(tmp_path / "chat_model")
    GenerationConfig(eos_token_id=[1, 106]).save_pretrained(tmp_path / "chat_model")
    with caplog.at_level(logging.INFO):
        _fit(recording_reward, module_kw={"pretrained": str(tmp_path / "chat_model")}, max_steps=1)
    assert "RolloutCallback: completions end at token ids [1, 106];" in caplog.text
